"""File-system calls of the checkpoint code, behind one seam so that tests can inject faults.

Everything that writes or reads checkpoint files goes through a ``FileSystem``. The default one
calls ``os`` directly; a test subclass can fail any single call (``ENOSPC`` on the third write,
``EIO`` on an fsync, a rename that is denied) and the tests then check that nothing committed
was damaged and no temporary file is left behind.

Writes go straight from the caller's buffer to the kernel with ``os.write`` (which releases the
GIL), so a background writer does not slow the training thread. Large shards are written with
``O_DIRECT`` where the file system supports it: the device reads the staging buffer itself, so
the write costs almost no CPU (no copy into the page cache), which on a machine with few cores
is CPU taken from training.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import threading
import uuid
from collections.abc import Iterable

import numpy as np

__all__ = [
    "LOCAL_FS",
    "TEMP_SUFFIX_RE",
    "FileSystem",
    "NotRegularFileError",
    "WriteCancelled",
    "file_kind",
    "is_temporary_name",
    "temporary_name",
    "write_all",
    "write_file_atomically",
]

# Temporary files carry ".tmp" + 32 hex digits after the final name (TF's state-file habit).
TEMP_SUFFIX_RE = re.compile(r"\.tmp[0-9a-f]{32}$")

_WRITE_CHUNK_BYTES = 64 << 20

DIRECT_IO_ALIGNMENT = 4096
"""Alignment (bytes) of buffer addresses, file offsets and lengths for ``O_DIRECT`` writes."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)


_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class NotRegularFileError(OSError):
    """A checkpoint or state file is a FIFO, a device, a socket or a directory.

    Such a file is damage, never data: reading a FIFO blocks forever and a device such as
    ``/dev/zero`` never ends. ``FileSystem.open_for_read`` raises it before reading a byte.

    Attributes:
        filename: The path.
        kind: What it is instead (``"a FIFO"``, ``"a directory"``, ...).
    """

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(errno.EINVAL, f"not a regular file ({kind})", path)
        self.kind = kind


def file_kind(mode: int) -> str:
    """Describe what ``st_mode`` is, for messages (``"a FIFO"``, ``"a regular file"``)."""
    for test, kind in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def temporary_name(path: str) -> str:
    """Return a fresh temporary name for ``path`` in the same directory."""
    return f"{path}.tmp{uuid.uuid4().hex}"


def is_temporary_name(name: str) -> bool:
    """Return True if ``name`` was made by ``temporary_name``."""
    return TEMP_SUFFIX_RE.search(name) is not None


class FileSystem:
    """The file operations used by checkpoints; every method maps to one system call.

    Thread safety: stateless; safe to share between threads.
    """

    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents if missing."""
        os.makedirs(path, exist_ok=True)

    def open_for_write(self, path: str, *, direct: bool = False) -> int:
        """Create ``path`` exclusively (it must not exist) and return a file descriptor.

        Args:
            path: The file to create.
            direct: Ask for ``O_DIRECT`` (bypass the page cache). Where the platform or the
                file system does not support it, the file is opened normally; see
                ``is_direct``.
        """
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        if direct and _O_DIRECT:
            try:
                return os.open(path, flags | _O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                try:
                    os.remove(path)  # Some file systems create the file, then refuse.
                except FileNotFoundError:
                    pass
        return os.open(path, flags, 0o644)

    def is_direct(self, fd: int) -> bool:
        """Return True if ``fd`` was opened with ``O_DIRECT``."""
        return bool(_O_DIRECT) and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT)

    def end_direct(self, fd: int) -> None:
        """Turn ``O_DIRECT`` off for ``fd`` (to write an unaligned tail)."""
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_O_DIRECT)

    def write(self, fd: int, data: memoryview | bytes) -> None:
        """Write all of ``data`` to ``fd`` (loops over short writes)."""
        view = memoryview(data).cast("B")
        while view:
            written = os.write(fd, view[:_WRITE_CHUNK_BYTES])
            if written <= 0:
                raise OSError(errno.EIO, "write returned 0 bytes")
            view = view[written:]

    def fsync(self, fd: int) -> None:
        """Flush ``fd``'s data and metadata to the device."""
        os.fsync(fd)

    def close(self, fd: int) -> None:
        """Close ``fd``."""
        os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        """Atomically rename ``src`` to ``dst``, replacing ``dst`` if it exists."""
        os.replace(src, dst)

    def remove(self, path: str) -> None:
        """Delete the file ``path``."""
        os.remove(path)

    def fsync_dir(self, path: str) -> None:
        """Make renames and deletions inside directory ``path`` durable."""
        try:
            fd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            return  # Platforms that cannot open directories (Windows) have nothing to sync.
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
                raise
        finally:
            os.close(fd)

    def listdir(self, path: str) -> list[str]:
        """Return the names in directory ``path``."""
        return os.listdir(path or ".")

    def exists(self, path: str) -> bool:
        """Return True if ``path`` exists."""
        return os.path.exists(path)

    def getsize(self, path: str) -> int:
        """Return the size of ``path`` in bytes."""
        return os.path.getsize(path)

    def getmtime(self, path: str) -> float:
        """Return the modification time of ``path`` in seconds since the epoch."""
        return os.stat(path).st_mtime_ns / 1e9

    def open_for_read(self, path: str):
        """Open the regular file ``path`` for binary reading, unbuffered.

        The file is opened without blocking (a FIFO's open would wait for a writer) and
        checked before anything is read: anything but a regular file (after symbolic links)
        is refused. Reads go straight to the caller's buffers.

        Raises:
            NotRegularFileError: ``path`` is a FIFO, device, socket or directory.
            OSError: From ``open`` (``FileNotFoundError``, ``PermissionError``, ...).
        """
        flags = os.O_RDONLY | _O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise NotRegularFileError(path, file_kind(mode))
            if _O_NONBLOCK:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_NONBLOCK)
            return os.fdopen(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise

    def is_regular_file(self, path: str) -> bool:
        """Return True if ``path`` is a regular file (after symbolic links)."""
        try:
            return stat.S_ISREG(os.stat(path).st_mode)
        except (OSError, ValueError):
            return False

    def realpath(self, path: str) -> str:
        """Return ``path`` with every symbolic link resolved (``os.path.realpath``)."""
        return os.path.realpath(path)


LOCAL_FS = FileSystem()


class WriteCancelled(Exception):
    """Raised by ``write_all`` when its ``cancel`` event is set between two chunks."""


def write_all(
    fs: FileSystem, fd: int, data: memoryview, cancel: threading.Event | None = None
) -> None:
    """Write ``data`` to ``fd``; the aligned part directly if ``fd`` is ``O_DIRECT``.

    With ``O_DIRECT`` the buffer must start on a ``DIRECT_IO_ALIGNMENT`` boundary (staging
    buffers do); the whole multiple of the alignment goes straight to the device, then
    ``O_DIRECT`` is turned off and the tail is written through the page cache. An unaligned
    buffer is written normally. The data goes in chunks of 64 MiB.

    Raises:
        WriteCancelled: If ``cancel`` is set before a chunk (what was written stays).
        OSError: From the system calls.
    """
    view = memoryview(data).cast("B")

    def chunks(part: memoryview) -> None:
        for start in range(0, len(part), _WRITE_CHUNK_BYTES):
            if cancel is not None and cancel.is_set():
                raise WriteCancelled()
            fs.write(fd, part[start : start + _WRITE_CHUNK_BYTES])

    if fs.is_direct(fd):
        address = _address(view)
        aligned = len(view) // DIRECT_IO_ALIGNMENT * DIRECT_IO_ALIGNMENT
        if address % DIRECT_IO_ALIGNMENT == 0 and aligned:
            chunks(view[:aligned])
            view = view[aligned:]
        fs.end_direct(fd)
    chunks(view)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def write_file_atomically(
    path: str, chunks: Iterable[memoryview | bytes], fs: FileSystem = LOCAL_FS
) -> None:
    """Write ``chunks`` to ``path`` so that ``path`` is either the old or the complete new file.

    The data goes to a temporary name in the same directory, is fsynced, renamed over ``path``
    and the directory is fsynced. On any failure the temporary file is removed and the error
    re-raised; ``path`` is then untouched.

    Raises:
        OSError: From the failed system call.
    """
    tmp = temporary_name(path)
    fd = fs.open_for_write(tmp)
    try:
        try:
            for chunk in chunks:
                fs.write(fd, chunk)
            fs.fsync(fd)
        finally:
            fs.close(fd)
        fs.rename(tmp, path)
    except BaseException:
        try:
            fs.remove(tmp)
        except OSError:
            pass
        raise
    fs.fsync_dir(os.path.dirname(path))
