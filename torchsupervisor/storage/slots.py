"""Staging buffers that are files: a snapshot copied straight into its file on a tmpfs.

The memory tier's snapshots are files on a tmpfs. Staged into ordinary host memory, a snapshot
costs two copies of the state: the training thread's into the staging buffer (the stall), then
the writer thread's from the buffer into the file, which on a machine whose cores all train is
CPU and memory bandwidth taken from training. ``SlotFiles`` makes the staging buffers the files
themselves: each buffer is a shared mapping of a file in the tier's directory
(``.stage-<hex>``), so the training thread's copy lands in the file's pages, and the commit
puts the data file by renaming the slot file to the data file's name (``adopt``: the same
commit protocol, a complete file appearing under its name at once) instead of writing it.
When retention deletes that data file, it is renamed back to a slot name (``release``) and
staged into again: its pages and its mapping stay, so a snapshot costs one copy and no new
page.

A slot is one of:

* free: named ``.stage-<hex>``, no snapshot's; the stager may copy into it;
* committed: renamed to a snapshot's data file; never written while it has that name;
* retired: deleted while something read it (a peer copy being sent from it), or closed:
  unlinked, never written again; its pages are freed with the last view of its mapping.

A kill at any moment leaves at most free slot files besides the snapshots: they are never a
snapshot (no manifest names them) and the next start deletes them (``remove_leftovers``).

Thread safety: every method under one lock; ``allocate`` and ``reusable`` on the training
thread, ``adopt`` and ``release`` on the writer thread or any thread deleting.

TF name: none.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["STAGE_PREFIX", "SlotFiles"]

STAGE_PREFIX = ".stage-"
"""The name of a free slot file (``SlotFiles``)."""
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass
class _Slot:
    path: str  # Its name now: a free slot's, or the data file it was committed as.
    size: int
    state: str  # "free", "committed" or "retired"
    inode: int

    def intact(self) -> bool:
        """Whether its file is still the one mapped, whole: a copy into a mapping past a file
        cut shorter (by another process) would kill this one (``SIGBUS``)."""
        try:
            info = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        return (
            stat.S_ISREG(info.st_mode) and info.st_ino == self.inode and info.st_size == self.size
        )


def _nothing() -> None:
    pass


def _address(buffer: memoryview) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


class SlotFiles:
    """The slot files of one directory of the memory tier (module docstring).

    Args:
        directory: The tier's directory (on a tmpfs; made 0700 by its storage).
        file_mode: The files' permission bits.
    """

    def __init__(self, directory: str, file_mode: int = 0o600) -> None:
        self.directory = os.path.abspath(directory)
        self._file_mode = file_mode
        self._lock = threading.Lock()
        self._by_address: dict[int, _Slot] = {}
        self._committed: dict[str, _Slot] = {}  # By the data file's path.

    def allocate(self, size_bytes: int) -> torch.Tensor:
        """A new free slot of ``size_bytes`` (> 0): a uint8 tensor over its file's mapping.

        Raises:
            OSError: The file could not be made or mapped (nothing of it is left).
        """
        path = os.path.join(self.directory, f"{STAGE_PREFIX}{uuid.uuid4().hex}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
        fd = os.open(path, flags, self._file_mode)
        try:
            os.ftruncate(fd, size_bytes)
            mapping = mmap.mmap(fd, size_bytes)  # Shared, read and write.
            inode = os.fstat(fd).st_ino
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)  # The mapping stays.
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # Keeps the mapping alive.
        with self._lock:
            self._by_address[buffer.data_ptr()] = _Slot(path, size_bytes, "free", inode)
        return buffer

    def reusable(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` may be staged into now: a free slot whose file is intact (else
        it is retired), or not a slot at all."""
        with self._lock:
            slot = self._by_address.get(buffer.data_ptr())
            if slot is None:
                return True
            if slot.state == "free" and not slot.intact():
                slot.state = "retired"  # Changed by another process: never written again.
            return slot.state == "free"

    def retired(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` is a slot that will never be staged into again (a slot made
        later at the same address takes its place here)."""
        with self._lock:
            slot = self._by_address.get(buffer.data_ptr())
            return slot is not None and slot.state == "retired"

    def adopt(self, path: str, data: memoryview, before: Callable[[], None] = _nothing) -> bool:
        """Make ``data`` the file ``path`` by renaming its slot file (after calling
        ``before``), when ``data`` is a whole free slot; False (nothing done) when it is not.

        Raises:
            OSError: The rename failed: the slot is retired (its file gone or not ours).
            Exception: What ``before`` raised (the slot stays free).
        """
        address = _address(data) if len(data) else None
        with self._lock:
            slot = self._by_address.get(address) if address is not None else None
            if slot is None or slot.state != "free" or slot.size != len(data):
                return False
            before()
            try:
                os.replace(slot.path, path)
            except OSError:
                slot.state = "retired"
                raise
            slot.path, slot.state = os.path.abspath(path), "committed"
            self._committed[slot.path] = slot
            return True

    def is_committed(self, path: str) -> bool:
        """Whether ``path`` is a slot's file committed as a data file."""
        with self._lock:
            return os.path.abspath(path) in self._committed

    def release(self, path: str, *, being_read: bool) -> bool:
        """A deletion of ``path``: when it is a committed slot, rename it back to a free slot
        (unlink it and retire the slot when ``being_read``) and return True; else False
        (nothing done).

        Raises:
            OSError: The rename or unlink failed (the slot is retired, its file as it is).
        """
        with self._lock:
            slot = self._committed.pop(os.path.abspath(path), None)
            if slot is None:
                return False
            if being_read:
                slot.state = "retired"
                os.unlink(slot.path)
                return True
            free = os.path.join(self.directory, f"{STAGE_PREFIX}{uuid.uuid4().hex}")
            try:
                os.replace(slot.path, free)
            except BaseException:
                slot.state = "retired"
                raise
            slot.path, slot.state = free, "free"
            return True

    def close(self) -> None:
        """Retire every slot and delete the free ones' files (the committed ones are the
        snapshots': deleted with them)."""
        with self._lock:
            for slot in self._by_address.values():
                if slot.state == "free":
                    try:
                        os.unlink(slot.path)
                    except FileNotFoundError:
                        pass
                slot.state = "retired"
            self._committed.clear()

    @staticmethod
    def remove_leftovers(directory: str) -> list[str]:
        """Delete the free slot files a killed process left in ``directory``; return them."""
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return []
        removed = []
        for name in names:
            if name.startswith(STAGE_PREFIX):
                path = os.path.join(directory, name)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                removed.append(path)
        return removed
