"""Where the memory tier lives: a directory on a tmpfs that outlives the training process.

Layout: ``<base>/torchsupervisor-<uid>/<run key>/rank-<rank>``, ``<base>`` being
``$TORCHSUPERVISOR_MEMORY_ROOT`` or ``/dev/shm``. The run key is derived from the run's log
directory (its absolute path or URL), so a restart of the same run finds its snapshots and two
runs never share them. Every directory from ``torchsupervisor-<uid>`` down is the user's alone
(mode 0700, owned by them, not a symbolic link): another user can neither read a snapshot nor
plant one. Snapshots are written there as checkpoints (same layout, same CRC-32C table, same
commit protocol) by the tier's writer, through ``MemoryTierStorage`` (``storage/private.py``:
it makes and checks the directories, writes files 0600 and checks the room).

Thread safety: the functions may be called from any thread.
"""

from __future__ import annotations

import hashlib
import os

from torchsupervisor.storage.private import MemoryTierStorage

__all__ = ["MEMORY_ROOT_ENV", "MemoryTierStorage", "memory_root", "rank_directory", "run_key"]

MEMORY_ROOT_ENV = "TORCHSUPERVISOR_MEMORY_ROOT"
"""The environment variable naming the file system the memory tier uses (default ``/dev/shm``)."""

_DEFAULT_BASE = "/dev/shm"


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
