"""Files for one user alone: the memory tier's directories and snapshots on a tmpfs.

``MemoryTierStorage`` is a ``LocalStorage`` (same commit protocol: temporary name, fsync,
rename) whose files are created 0600, which makes its directories 0700 and refuses a level
another user could reach, and which checks that its file system has room for the snapshots.
Where the directories are is ``tiers/memory_root``'s business.

Thread safety: as ``LocalStorage``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import mmap
import os
import stat
import struct
import threading
import uuid
from collections.abc import Iterable, Iterator

from torchsupervisor.errors import MemoryTierFullError
from torchsupervisor.storage.base import Buffer
from torchsupervisor.storage.local import LocalStorage
from torchsupervisor.storage.slots import SlotFiles

__all__ = ["SPARE_PREFIX", "MemoryTierStorage", "SharedCounter"]

SPARE_PREFIX = ".spare-"
"""The name of a deleted data file kept for its pages (``MemoryTierStorage``)."""
_DATA_FILE = ".data-"  # In the name of a checkpoint's data files.
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class MemoryTierStorage(LocalStorage):
    """The memory tier's files: written as any checkpoint's, readable by their owner only.

    A deleted snapshot's data file is kept as a spare (``.spare-<hex>``, at most
    ``MAX_SPARES`` per directory: the spare takes the place of the slot being written next, so
    the tier still holds at most ``slots`` x the state's bytes) and the next data file written
    there overwrites its pages
    (then is cut to its length): on a tmpfs, writing into pages that exist costs about 2/3
    of writing into new ones, and the deletion is a rename instead of freeing them (48 MB on
    this machine: 20 ms instead of 29 + 6 ms). The commit protocol is unchanged: the new
    file is written under a temporary name and renamed when complete.

    A file being read through ``reading`` (a peer copy being sent from it) never becomes a
    spare: deleted, it is unlinked, and its pages stay the reader's until it closes it, so
    what it reads is never overwritten by the next snapshot.

    Thread safety: as ``LocalStorage``; a directory's spares are taken by one writer at a
    time (the tier's writer thread, or a peer server's). ``reading`` and ``delete`` from any
    thread of the process.
    """

    file_mode = 0o600
    MAX_SPARES = 1
    slots: SlotFiles | None = None
    """The staging buffers that are this storage's files (``storage.slots``), once the
    memory tier stages into them: ``put`` of a whole free slot renames its file, ``delete``
    of a committed one renames it back (and no data file becomes a spare)."""
    _read_lock = threading.Lock()
    _being_read: collections.Counter[str] = collections.Counter()  # Of the whole process.

    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[None]:
        """While in the block, a deletion of ``path`` by any ``MemoryTierStorage`` of this
        process unlinks it instead of keeping its pages as a spare (open it inside)."""
        key = os.path.abspath(path)
        with self._read_lock:
            self._being_read[key] += 1
        try:
            yield
        finally:
            with self._read_lock:
                self._being_read[key] -= 1
                if not self._being_read[key]:
                    del self._being_read[key]

    def put(
        self, path: str, chunks: Iterable[Buffer], *, cancel: threading.Event | None = None
    ) -> None:
        """``LocalStorage.put``; a single chunk that is a whole free slot (``slots``) becomes
        the file by a rename of its slot file, without a copy."""
        chunks = list(chunks)
        if self.slots is not None and len(chunks) == 1:
            before = functools.partial(self._before, "rename", path)
            if self.slots.adopt(path, memoryview(chunks[0]).cast("B"), before):
                self._fsync_dir(os.path.dirname(path))
                return
        super().put(path, chunks, cancel=cancel)

    def delete(self, path: str) -> None:
        """Delete ``path``. A committed slot's file becomes a free slot again (``slots``);
        else a data file becomes a spare while there are fewer than ``MAX_SPARES``, no
        ``slots`` and it is not being read (``reading``)."""
        directory = os.path.dirname(path)
        slots = self.slots
        data = _DATA_FILE in os.path.basename(path)
        if data and (slots is not None or len(self.spares(directory)) < self.MAX_SPARES):
            with self._read_lock:  # Its readers open it by name: before, or never.
                being_read = bool(self._being_read[os.path.abspath(path)])
                if slots is not None and slots.is_committed(path):
                    self._before("delete", path)
                    slots.release(path, being_read=being_read)
                    return
                if slots is None and not being_read:
                    self._before("delete", path)
                    spare = os.path.join(directory, f"{SPARE_PREFIX}{uuid.uuid4().hex}")
                    os.replace(path, spare)
                    return
        super().delete(path)

    def spares(self, directory: str) -> list[str]:
        """The spare files of ``directory``."""
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return []
        return [os.path.join(directory, n) for n in names if n.startswith(SPARE_PREFIX)]

    def _open_new(self, tmp: str, path: str, *, direct: bool) -> tuple[int, bool]:
        if _DATA_FILE in os.path.basename(path):
            for spare in self.spares(os.path.dirname(path)):
                try:
                    os.rename(spare, tmp)
                except FileNotFoundError:
                    continue
                self._before("open", tmp)
                try:
                    # Non-blocking: a FIFO in its place fails at once (no effect on a file).
                    flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC
                    fd = os.open(tmp, flags)
                except OSError:  # A link (never followed), a FIFO, not openable: not reused.
                    os.unlink(tmp)
                    continue
                info = os.fstat(fd)
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
                    os.fchmod(fd, self.file_mode)
                    return fd, True
                os.close(fd)  # Not a file of ours: never written through.
                os.unlink(tmp)
        return self._create(tmp, direct=direct), False

    def prepare_directory(self, root: str, directory: str) -> None:
        """Create ``directory`` under ``root`` (both mode 0700), checking each level.

        Raises:
            ValueError: ``directory`` is not under ``root``.
            PermissionError: A level is a symbolic link, not a directory, not the user's, or
                open to others (group or other permission bits): named, and nothing is
                written there.
        """
        root = os.path.abspath(root)
        directory = os.path.abspath(directory)
        if os.path.commonpath([root, directory]) != root:
            raise ValueError(f"{directory} is not under the memory root {root}")
        levels = [root]
        for part in os.path.relpath(directory, root).split(os.sep):
            if part != ".":
                levels.append(os.path.join(levels[-1], part))
        for level in levels:
            self._before("makedirs", level)
            try:
                os.mkdir(level, 0o700)
            except FileExistsError:
                pass
            _check_private(level)

    def check_room(
        self,
        directory: str,
        needed_bytes: int,
        *,
        tier: str = "memory",
        advice: str = "give it room (a larger tmpfs, or TORCHSUPERVISOR_MEMORY_ROOT naming "
        "another), keep fewer slots, or turn the memory tier off",
    ) -> None:
        """Check that the file system of ``directory`` can hold ``needed_bytes`` more than
        now, counting what ``directory`` holds already as free (its slots are rewritten in
        place of it).

        Args:
            directory: The tier's directory.
            needed_bytes: What its snapshots take at most (bytes).
            tier: The tier's name, and ``advice``: what to do, for the message.

        Raises:
            MemoryTierFullError: It cannot; the message names the directory, the bytes
                needed and the bytes free.
        """
        fs = os.statvfs(directory)
        free = fs.f_bavail * fs.f_frsize + _bytes_under(directory)
        if free < needed_bytes:
            raise MemoryTierFullError(
                f"The {tier} tier at {directory} needs {needed_bytes} bytes but its file "
                f"system has {free} bytes free; {advice}",
                path=directory,
                needed_bytes=needed_bytes,
                free_bytes=free,
            )

    def remove_directory(self, root: str, directory: str) -> None:
        """Delete ``directory`` (under ``root``) and the files in it, then its parents up to
        ``root`` (excluded) that are left empty. Links are deleted, never followed; a
        sub-directory (which the tier never makes) is left, and so is the directory then.

        Raises:
            ValueError: ``directory`` is not under ``root``.
            OSError: A file could not be deleted.
        """
        root = os.path.abspath(root)
        directory = os.path.abspath(directory)
        if os.path.commonpath([root, directory]) != root or directory == root:
            raise ValueError(f"{directory} is not under the memory root {root}")
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return
        for name in names:
            path = os.path.join(directory, name)
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                self._before("delete", path)
                os.unlink(path)
        level = directory
        while level != root:
            try:
                os.rmdir(level)
            except OSError:  # Not empty (another rank's directory, a sub-directory): kept.
                return
            level = os.path.dirname(level)

    def open_counter(self, path: str) -> SharedCounter:
        """A counter in the file ``path`` (made 0600 if missing, 8 bytes), mapped in memory:
        what it is set to stays when the process is killed, at the cost of a store.

        Raises:
            OSError: It cannot be opened (a link in its place is refused: ``ELOOP``).
        """
        return SharedCounter(self.open_mapped(path, _COUNTER_BYTES))

    def read_counter(self, path: str) -> int | None:
        """The value of the counter ``path`` (``open_counter``); None if there is none."""
        try:
            data = self.read_bytes(path, max_bytes=_COUNTER_BYTES)
        except FileNotFoundError:
            return None
        return struct.unpack("<q", data)[0] if len(data) == _COUNTER_BYTES else None


_COUNTER_BYTES = 8


class SharedCounter:
    """A signed 64-bit integer in a mapped file (``MemoryTierStorage.open_counter``).

    Thread safety: one writer; an aligned 8-byte store is never seen torn.
    """

    __slots__ = ("_map",)

    def __init__(self, mapped: mmap.mmap) -> None:
        self._map = mapped

    def set(self, value: int) -> None:
        """Store ``value`` (no system call)."""
        struct.pack_into("<q", self._map, 0, value)

    def close(self) -> None:
        """Unmap it (the value stays in the file)."""
        self._map.close()


def _check_private(path: str) -> None:
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise PermissionError(f"The memory tier's directory {path} is a symbolic link; refusing it")
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"The memory tier's directory {path} is not a directory")
    if info.st_uid != os.getuid():
        raise PermissionError(
            f"The memory tier's directory {path} belongs to user {info.st_uid}, not to this "
            f"user ({os.getuid()}); refusing it"
        )
    if info.st_mode & 0o077:
        raise PermissionError(
            f"The memory tier's directory {path} is open to other users (mode "
            f"{stat.S_IMODE(info.st_mode):04o}); make it 0700 or remove it"
        )


def _bytes_under(directory: str) -> int:
    total = 0
    for parent, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total
