"""``LocalStorage``: the storage seam on a POSIX file system.

``put`` writes to a temporary name in the same directory (``<name>.tmp`` + 32 hex digits),
fsyncs it, renames it over the final name and fsyncs the directory: the object is the old file
or the complete new one, and a crash leaves at most a temporary file, which ``list`` never
shows and ``clean_leftovers`` removes at the next start.

Writes go straight from the caller's buffer to the kernel with ``os.write`` (which releases the
GIL), so a background writer does not slow the training thread. A large object given as one
buffer is written with ``O_DIRECT`` where the file system supports it: the device reads the
staging buffer itself, so the write costs almost no CPU (no copy into the page cache), which on
a machine with few cores is CPU taken from training.

Reads are ``preadv`` at an offset, after checking that the file is a regular one (a FIFO is
opened without blocking and refused; a device such as ``/dev/zero`` is refused).

Every system call goes through ``_before(operation, path)`` first, which does nothing here:
``torchsupervisor.testing.FaultyStorage`` overrides it to fail, delay or hold any stage.

TF name: none (TF's ``gfile`` on a local disk).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import select
import socket
import stat
import sys
import threading
import uuid
from collections.abc import Callable, Iterable

import numpy as np

from torchsupervisor.errors import NotRegularFileError, OutsideDirectoryError, WriteCancelled
from torchsupervisor.storage import lock as lock_module
from torchsupervisor.storage.base import Appendable, Buffer, DirectoryLock, Readable, Storage
from torchsupervisor.storage.base import file_kind as _file_kind
from torchsupervisor.storage.writeback import start_writeback

__all__ = [
    "DIRECT_IO_ALIGNMENT",
    "OPERATIONS",
    "LocalStorage",
    "is_temporary_name",
    "temporary_name",
]

OPERATIONS = (
    "makedirs",
    "open",
    "write",
    "fsync",
    "close",
    "rename",
    "fsync_dir",
    "delete",
    "list",
    "read",
)
"""The system calls ``LocalStorage._before`` sees (``open``: a create for writing; ``read``:
an open for reading)."""

# Temporary files carry ".tmp" + 32 hex digits after the final name (TF's state-file habit).
_TEMP_SUFFIX_RE = re.compile(r"\.tmp[0-9a-f]{32}$")

_WRITE_CHUNK_BYTES = 64 << 20
_LINUX = sys.platform.startswith("linux")
_COPY_CHUNK_BYTES = 8 << 20  # Bytes a call of ``put_copied`` (a few calls per snapshot).
_RECEIVE_CHUNK_BYTES = 1 << 20  # A pipe's size for splice(2), or the buffer without it.
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux's value (Python 3.10+ names it).

DIRECT_IO_ALIGNMENT = 4096
"""Alignment (bytes) of buffer addresses, file offsets and lengths for ``O_DIRECT`` writes."""

_DIRECT_MIN_BYTES = 1 << 20  # Smaller objects gain nothing from O_DIRECT.
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def temporary_name(path: str) -> str:
    """Return a fresh temporary name for ``path`` in the same directory."""
    return f"{path}.tmp{uuid.uuid4().hex}"


def is_temporary_name(name: str) -> bool:
    """Return True if ``name`` was made by ``temporary_name``."""
    return _TEMP_SUFFIX_RE.search(name) is not None


class LocalStorage(Storage):
    """Files on a local (POSIX) file system; see the module docstring.

    Attributes:
        file_mode: The permission bits of the files it creates (less the umask): 0644, so that
            a group that shares a log directory reads its checkpoints; a subclass may narrow
            it (the memory tier's files are 0600).

    Thread safety: stateless but for the process-wide writer locks; share it freely.
    """

    file_mode = 0o644

    def _before(self, operation: str, path: str) -> None:
        """Called before each system call (one of ``OPERATIONS``) on ``path``; no-op here."""

    # ------------------------------------------------------------------------------ writing

    def put(
        self, path: str, chunks: Iterable[Buffer], *, cancel: threading.Event | None = None
    ) -> None:
        """Write ``path`` atomically: temporary name, write, fsync, rename, fsync directory.

        A first chunk of at least 1 MiB is written with ``O_DIRECT`` where supported (its
        aligned part; the rest, and the other chunks, buffered). See ``Storage.put``.
        """
        parts = [memoryview(c).cast("B") for c in chunks]
        direct = bool(parts) and len(parts[0]) >= _DIRECT_MIN_BYTES
        self._put_parts(path, parts, direct, cancel)

    def put_streamed(self, path: str, chunks: Iterable[Buffer]) -> None:
        """Write ``path`` as ``put`` does, each chunk as it comes (buffered): a chunk's buffer
        may be reused once the next is asked for (a socket's), and the file is never held in
        memory whole.

        Raises:
            OSError: The write failed (nothing of it is left); whatever ``chunks`` raises.
        """

        def write(fd: int, tmp: str) -> None:
            offset = 0
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                self._write_chunks(fd, tmp, view, None)
                start_writeback(fd, offset, len(view))
                offset += len(view)

        self._commit(path, write, False, None)

    def put_received(self, path: str, conn: socket.socket, size: int) -> None:
        """Write ``path`` as ``put`` does with the next ``size`` bytes read from ``conn``: moved
        from the socket into the file by ``splice(2)`` where the OS has it (Linux), never
        through this process's memory (a snapshot of 500 MB from a peer on the loopback here:
        0.25 s instead of 0.50 s through a buffer); else read into a buffer and written.

        Raises:
            ConnectionError: The peer closed the connection before ``size`` bytes came.
            TimeoutError: No byte came for the socket's timeout (in seconds).
            OSError: The write failed. In every case nothing of the file is left.
        """
        self._commit(path, lambda fd, tmp: self._receive(fd, tmp, conn, size), False, None)

    def put_copied(self, path: str, source: int, size: int) -> None:
        """Write ``path`` as ``put`` does with the first ``size`` bytes of the open file
        ``source`` (a file descriptor), copied in the kernel (``sendfile(2)`` where the OS has
        it: Linux), never through this process's memory (the local tier's copy of a memory
        snapshot, ``tiers/disk``); else read into a buffer and written.

        Raises:
            OSError: The read or the write failed, or ``source`` holds fewer than ``size``
                bytes (``EIO``, naming both); nothing of the file is left.
        """
        self._commit(path, lambda fd, tmp: self._copy_from(fd, tmp, source, size), False, None)

    def _copy_from(self, fd: int, path: str, source: int, size: int) -> None:
        """Write ``size`` bytes of ``source`` from its start at ``fd``'s offset."""
        offset = 0
        while offset < size:
            count = min(size - offset, _COPY_CHUNK_BYTES)
            self._before("write", path)
            if _LINUX:  # A file to a file: Linux's sendfile only.
                moved = os.sendfile(fd, source, offset, count)
            else:
                data = os.pread(source, count, offset)
                self._write(fd, path, memoryview(data))
                moved = len(data)
            if not moved:
                raise OSError(
                    errno.EIO, f"the source of {path} ended at byte {offset} of {size}", path
                )
            offset += moved

    def _receive(self, fd: int, path: str, conn: socket.socket, size: int) -> None:
        """Write ``size`` bytes from ``conn`` at ``fd``'s offset (``put_received``)."""
        if not hasattr(os, "splice"):
            buffer = memoryview(bytearray(min(size, _RECEIVE_CHUNK_BYTES) or 1))
            left = size
            while left:
                got = conn.recv_into(buffer[: min(left, len(buffer))])
                if not got:
                    raise ConnectionError(f"the peer closed the connection {left} bytes short")
                self._write(fd, path, buffer[:got])
                left -= got
            return
        pipe_out, pipe_in = os.pipe2(_O_CLOEXEC)
        try:
            with contextlib.suppress(OSError):  # A smaller pipe only means more calls.
                fcntl.fcntl(pipe_in, _F_SETPIPE_SZ, _RECEIVE_CHUNK_BYTES)
            poller = select.poll()
            poller.register(conn, select.POLLIN)
            timeout = conn.gettimeout()
            left = size
            while left:
                self._before("write", path)
                try:
                    moved = os.splice(conn.fileno(), pipe_in, min(left, _RECEIVE_CHUNK_BYTES))
                except BlockingIOError:  # A socket with a timeout is non-blocking.
                    if not poller.poll(None if timeout is None else timeout * 1000):
                        raise TimeoutError(
                            f"no data from the peer for {timeout} s ({left} bytes to come)"
                        ) from None
                    continue
                if not moved:
                    raise ConnectionError(f"the peer closed the connection {left} bytes short")
                left -= moved
                while moved:
                    moved -= os.splice(pipe_out, fd, moved)
        finally:
            os.close(pipe_out)
            os.close(pipe_in)

    def _put_parts(
        self,
        path: str,
        parts: Iterable[memoryview],
        direct: bool,
        cancel: threading.Event | None,
    ) -> None:
        def write(fd: int, tmp: str) -> None:
            for part in parts:
                self._write_all(fd, tmp, part, cancel)

        self._commit(path, write, direct, cancel)

    def _commit(
        self,
        path: str,
        write: Callable[[int, str], None],
        direct: bool,
        cancel: threading.Event | None,
    ) -> None:
        """The commit protocol of one file: temporary name, ``write(fd, tmp)``, fsync,
        rename, fsync dir."""
        tmp = temporary_name(path)
        renamed = False
        try:
            fd, reused = self._open_new(tmp, path, direct=direct)
            try:
                write(fd, tmp)
                if reused:  # An old file's pages, overwritten: cut what is left of it.
                    os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR))
                self._before("fsync", tmp)
                os.fsync(fd)
            finally:
                try:
                    self._before("close", tmp)
                finally:
                    os.close(fd)
            if cancel is not None and cancel.is_set():
                raise WriteCancelled()
            self._before("rename", path)
            os.replace(tmp, path)
            renamed = True
            self._fsync_dir(os.path.dirname(path))
        except BaseException:
            # Take the attempt back: the temporary file, or a renamed file whose directory
            # entry could not be made durable (it must not be mistaken for a committed one).
            _remove_quietly(path if renamed else tmp)
            raise

    def delete(self, path: str) -> None:
        """Unlink ``path`` and fsync its directory."""
        self._before("delete", path)
        os.remove(path)
        self._fsync_dir(os.path.dirname(path))

    def makedirs(self, path: str) -> None:
        """``os.makedirs(path, exist_ok=True)``."""
        self._before("makedirs", path)
        os.makedirs(path, exist_ok=True)

    def open_append(self, path: str) -> Appendable:
        """Create ``path`` exclusively and return it for appends (``sync`` is an fsync)."""
        fd = self._create(path, direct=False)
        return _LocalAppendable(self, path, fd)

    def open_mapped(self, path: str, size_bytes: int) -> mmap.mmap:
        """The file ``path`` (made ``file_mode`` if missing) of ``size_bytes``, mapped shared:
        what is stored into it stays when the process is killed, at the cost of a store (the
        memory tier's step counter, the goodput ledger's heartbeat). Never a link or a
        non-regular file.

        Raises:
            OSError: It cannot be opened (a link in its place is refused: ``ELOOP``; anything
                but a regular file: ``EINVAL``).
        """
        self._before("open", path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, self.file_mode)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            os.ftruncate(fd, size_bytes)
            return mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------------------ reading

    def open_read(self, path: str, *, inside: str | None = None) -> Readable:
        """Open the regular file ``path`` without blocking; see ``Storage.open_read``."""
        if inside is not None:
            real = os.path.dirname(os.path.realpath(path))
            if real != os.path.realpath(inside or os.curdir):
                raise OutsideDirectoryError(path, inside or os.curdir, real)
        self._before("read", path)
        fd = os.open(path, os.O_RDONLY | _O_NONBLOCK | _O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotRegularFileError(path, _file_kind(st.st_mode))
            return _LocalReadable(path, fd, st.st_size)
        except BaseException:
            os.close(fd)
            raise

    def list(self, directory: str) -> list[str]:
        """The names in ``directory`` but temporary files; see ``Storage.list``."""
        self._before("list", directory)
        return [n for n in os.listdir(directory or os.curdir) if not is_temporary_name(n)]

    def list_tree(self, directory: str) -> list[str]:
        """Every file below ``directory`` (``os.walk``), but temporary files."""
        self._before("list", directory)
        if not os.path.isdir(directory or os.curdir):
            raise FileNotFoundError(errno.ENOENT, "no such directory", directory)
        found = []
        for root, _, files in os.walk(directory or os.curdir):
            rel = os.path.relpath(root, directory or os.curdir)
            for name in files:
                if not is_temporary_name(name):
                    found.append(name if rel == os.curdir else os.path.join(rel, name))
        return sorted(found)

    def exists(self, path: str) -> bool:
        """True if anything (a file, a directory, a dangling link) is at ``path``."""
        return os.path.lexists(path)

    def is_file(self, path: str) -> bool:
        """True if ``path`` is a regular file (after symbolic links)."""
        try:
            return stat.S_ISREG(os.stat(path).st_mode)
        except (OSError, ValueError):
            return False

    def is_dir(self, path: str) -> bool:
        """True if ``path`` is a directory (after symbolic links)."""
        return os.path.isdir(path or os.curdir)

    def size(self, path: str) -> int:
        """``os.path.getsize``."""
        return os.path.getsize(path)

    def mtime(self, path: str) -> float:
        """The modification time in seconds (``st_mtime_ns / 1e9``)."""
        return os.stat(path).st_mtime_ns / 1e9

    def canonical(self, path: str) -> str:
        """``os.path.realpath`` (the empty path is the current directory)."""
        return os.path.realpath(path or os.curdir)

    # ----------------------------------------------------------------------- one writer

    def lock(self, directory: str) -> DirectoryLock:
        """A POSIX record lock on ``<directory>/.torchsupervisor-writer.lock`` (``lock.py``)."""
        return lock_module.acquire(directory, self.file_mode)

    def lock_owner(self, directory: str) -> dict[str, object]:
        """What the lock file says about its writer; see ``lock.read_owner``."""
        return lock_module.read_owner(directory)

    def leftovers(self, directory: str) -> list[str]:
        """The temporary files interrupted writes left (never a directory)."""
        self._before("list", directory)
        try:
            names = os.listdir(directory or os.curdir)
        except FileNotFoundError:
            return []
        paths = (os.path.join(directory, n) for n in sorted(names) if is_temporary_name(n))
        return [p for p in paths if not os.path.isdir(p)]

    # ----------------------------------------------------------------------- system calls

    def _open_new(self, tmp: str, path: str, *, direct: bool) -> tuple[int, bool]:
        """The descriptor ``_put_parts`` writes ``path`` through, at the temporary ``tmp``,
        and whether it is an old file to overwrite (then truncated to what was written).
        Here a new file, created exclusively; ``MemoryTierStorage`` reuses old pages."""
        return self._create(tmp, direct=direct), False

    def _create(self, path: str, *, direct: bool) -> int:
        """Create ``path`` exclusively; with ``O_DIRECT`` if asked and supported."""
        self._before("open", path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
        if direct and _O_DIRECT:
            try:
                return os.open(path, flags | _O_DIRECT, self.file_mode)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                _remove_quietly(path)  # Some file systems create the file, then refuse.
        return os.open(path, flags, self.file_mode)

    def _write_all(
        self, fd: int, path: str, data: memoryview, cancel: threading.Event | None
    ) -> None:
        """Write ``data``; its aligned part straight to the device if ``fd`` is ``O_DIRECT``."""
        view = data
        if _O_DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT:
            aligned = len(view) // DIRECT_IO_ALIGNMENT * DIRECT_IO_ALIGNMENT
            if _address(view) % DIRECT_IO_ALIGNMENT == 0 and aligned:
                self._write_chunks(fd, path, view[:aligned], cancel)
                view = view[aligned:]
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
        self._write_chunks(fd, path, view, cancel)

    def _write_chunks(
        self, fd: int, path: str, view: memoryview, cancel: threading.Event | None
    ) -> None:
        for start in range(0, len(view), _WRITE_CHUNK_BYTES):
            if cancel is not None and cancel.is_set():
                raise WriteCancelled()
            self._write(fd, path, view[start : start + _WRITE_CHUNK_BYTES])

    def _write(self, fd: int, path: str, view: memoryview) -> None:
        """Write all of ``view`` (loops over short writes)."""
        self._before("write", path)
        while view:
            written = os.write(fd, view)
            if written <= 0:
                raise OSError(errno.EIO, "write returned 0 bytes")
            view = view[written:]

    def _fsync_dir(self, directory: str) -> None:
        """Make renames and deletions inside ``directory`` durable."""
        self._before("fsync_dir", directory)
        try:
            fd = os.open(directory or os.curdir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            return  # Platforms that cannot open directories (Windows) have nothing to sync.
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
                raise
        finally:
            os.close(fd)


class _LocalReadable(Readable):
    # Four buffered reads in flight read a file that is not in the page cache about 1.5x
    # faster than one sequential reader here, and no hint beats the kernel's own read-ahead:
    # asking for the whole file at once (POSIX_FADV_WILLNEED) made a cold 2 GB restore 2.6x
    # slower. O_DIRECT reads (8 of 4 MiB in flight) were slower than the four buffered ones
    # on this virtual disk (docs/performance.md, "Cold restores").
    concurrent_reads = 4

    def __init__(self, path: str, fd: int, size: int) -> None:
        super().__init__(path, size)
        if _O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_NONBLOCK)
        self._fd = fd

    def readinto(self, view: memoryview, offset: int) -> int:
        return os.preadv(self._fd, [view], offset)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _LocalAppendable(Appendable):
    def __init__(self, storage: LocalStorage, path: str, fd: int) -> None:
        self._storage = storage
        self.path = path
        self._fd = fd

    def write(self, data: Buffer) -> None:
        self._storage._write(self._fd, self.path, memoryview(data).cast("B"))

    def sync(self) -> None:
        self._storage._before("fsync", self.path)
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                self._storage._before("close", self.path)
            finally:
                os.close(fd)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
