"""Where the memory tier lives: a directory on a tmpfs that outlives the training process.

Layout: ``<base>/torchsupervisor-<uid>/<run key>/rank-<rank>``, ``<base>`` being
``$TORCHSUPERVISOR_MEMORY_ROOT`` or ``/dev/shm``. The run key is derived from the run's log
directory (its absolute path or URL), so a restart of the same run finds its snapshots and two
runs never share them. Every directory from ``torchsupervisor-<uid>`` down is the user's alone
(mode 0700, owned by them, not a symbolic link): another user can neither read a snapshot nor
plant one. Snapshots are written there as checkpoints (same layout, same CRC-32C table, same
commit protocol) by the tier's writer.

Thread safety: the functions may be called from any thread.
"""

from __future__ import annotations

import hashlib
import os
import stat

from torchsupervisor.errors import MemoryTierFullError
from torchsupervisor.storage.local import LocalStorage

__all__ = [
    "MEMORY_ROOT_ENV",
    "MemoryTierStorage",
    "check_room",
    "memory_root",
    "prepare_directory",
    "rank_directory",
    "run_key",
]

MEMORY_ROOT_ENV = "TORCHSUPERVISOR_MEMORY_ROOT"
"""The environment variable naming the file system the memory tier uses (default ``/dev/shm``)."""

_DEFAULT_BASE = "/dev/shm"


class MemoryTierStorage(LocalStorage):
    """The memory tier's files: written as any checkpoint's (temporary name, fsync, rename),
    but readable by their owner only (mode 0600).

    Thread safety: as ``LocalStorage``.
    """

    file_mode = 0o600


def memory_root(base: str | None = None) -> str:
    """This user's root of the memory tier: ``<base>/torchsupervisor-<uid>``.

    Args:
        base: The file system to use; None: ``$TORCHSUPERVISOR_MEMORY_ROOT`` or ``/dev/shm``.
    """
    base = base or os.environ.get(MEMORY_ROOT_ENV) or _DEFAULT_BASE
    return os.path.join(os.path.abspath(base), f"torchsupervisor-{os.getuid()}")


def run_key(logdir: str) -> str:
    """The directory name of a run's snapshots: 16 hex digits of a hash of its log directory
    (``os.path.abspath`` of a local path, a URL as given less a trailing slash)."""
    where = logdir.rstrip("/") if "://" in logdir else os.path.abspath(logdir)
    return hashlib.sha256(where.encode("utf-8")).hexdigest()[:16]


def rank_directory(root: str, logdir: str, rank: int) -> str:
    """The directory of one rank's snapshots of a run: ``<root>/<run key>/rank-<rank>``."""
    if rank < 0:
        raise ValueError(f"rank must be at least 0, got {rank}")
    return os.path.join(root, run_key(logdir), f"rank-{rank}")


def prepare_directory(root: str, directory: str) -> None:
    """Create ``directory`` under ``root`` (both mode 0700), checking each level.

    Raises:
        ValueError: ``directory`` is not under ``root``.
        PermissionError: A level is a symbolic link, not a directory, not the user's, or open
            to others (group or other permission bits): named, and nothing is written there.
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
        try:
            os.mkdir(level, 0o700)
        except FileExistsError:
            pass
        _check_private(level)


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


def check_room(directory: str, needed_bytes: int) -> None:
    """Check that the file system of ``directory`` can hold ``needed_bytes`` more than now,
    counting what ``directory`` holds already as free (its slots are rewritten in place of it).

    Raises:
        MemoryTierFullError: It cannot; the message names the directory, the bytes needed and
            the bytes free.
    """
    fs = os.statvfs(directory)
    free = fs.f_bavail * fs.f_frsize + _bytes_under(directory)
    if free < needed_bytes:
        raise MemoryTierFullError(
            f"The memory tier at {directory} needs {needed_bytes} bytes but its file system has "
            f"{free} bytes free; give it room (a larger tmpfs, or {MEMORY_ROOT_ENV} naming "
            "another), keep fewer slots, or turn the memory tier off",
            path=directory,
            needed_bytes=needed_bytes,
            free_bytes=free,
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
