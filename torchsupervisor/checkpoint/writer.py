"""The ``Writer`` seam: how one snapshot of a state becomes a durable checkpoint, and back.

A ``Saver`` holds one writer per state, chosen once (``writer_choice``), and drives it in
this order for every save:

1. ``stage(state, target, global_step, background=..., error=...)`` on the calling (training)
   thread, at a step boundary: flatten the state and copy it into host buffers. This is the
   stall. A synchronous save (``background=False``) checks the target's directory here; a
   background one leaves that to ``persist`` (a ``stat`` is not worth a stall).
2. ``persist(staged, target, stall_secs, background=...)`` on the calling thread
   (``Saver.save``) or on the background writer thread (``Saver.save_async``): write, verify
   and commit with the commit protocol (parts first, manifest last, then the state file and
   retention through the ``Keeper``), and free the staged buffers, on success or failure.
   Returns ``SaveStats``.
3. ``release(staged)`` instead of ``persist`` when the save is abandoned between the two.

and for a restore, ``restore(state, save_path, found=..., optional=..., whole_state=...)`` on the
calling thread.

At most one save is in flight: the ``Saver`` waits for the last one before ``stage``.

Which ranks call what (``collective``):

* ``collective = False`` (``SnapshotWriter``: one process's state; the chief of a replicated
  run): only the process that saves calls the methods.
* ``collective = True`` (``ShardedWriter``: DTensor/FSDP2 states): every rank calls each method
  at the same step, in the same order. ``stage`` raises nothing: whatever a rank found wrong
  (``error``, its directory, its state) is carried into ``persist``, which raises it on every
  rank, so no rank waits alone in a collective. ``restore`` raises on every rank when any rank
  cannot find the checkpoint.

What each may raise:

* ``stage``: ``ValueError`` (nothing to save, a missing directory), ``TypeError`` (an entry
  that cannot be saved), ``LogdirLockedError`` (another process writes there); none for a
  collective writer.
* ``persist``: ``CheckpointSaveError`` (nothing committed; older checkpoints untouched); a
  collective writer also what any rank carried (``ValueError``, ``TypeError``, ...).
* ``restore``: ``ValueError`` (no such checkpoint), ``CorruptCheckpointError``,
  ``NotFoundError``, ``InvalidArgumentError`` (the state is then unchanged).

A tier that keeps snapshots elsewhere (host memory, a peer) is a third implementation.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from torchsupervisor.storage import DirectoryLock, Storage

if TYPE_CHECKING:
    from torchsupervisor.core.global_step import GlobalStepLike

__all__ = ["Directories", "SaveStats", "SaveTarget", "Staged", "Writer"]


@dataclass(frozen=True)
class SaveTarget:
    """Where one save goes.

    Attributes:
        prefix: The checkpoint prefix (``save_path-<step>``).
        save_path: The prefix family (``logdir/model.ckpt``).
        latest_filename: The state file's name; None: ``"checkpoint"``.
        write_state: Record the checkpoint in the state file and apply retention.
        metrics: What the run measured at this checkpoint (in its manifest; keep-best
            retention ranks by it); None: none.
    """

    prefix: str
    save_path: str
    latest_filename: str | None
    write_state: bool
    metrics: dict[str, float] | None = None


@dataclass(frozen=True)
class SaveStats:
    """What the last committed save cost.

    Attributes:
        prefix: The checkpoint written.
        stall_secs: Time the calling (training) thread spent in the snapshot.
        commit_secs: Time from the end of the snapshot until the index was committed.
        total_secs: ``commit_secs`` plus the state file and the deletion of old checkpoints.
        bytes_written: Bytes of shard data written (headers included, the index excluded).
        bytes_reused: Bytes of unchanged tensors referenced instead of written (incremental).
    """

    prefix: str
    stall_secs: float
    commit_secs: float
    total_secs: float
    bytes_written: int
    bytes_reused: int


Staged = TypeVar("Staged")
"""What a writer's ``stage`` returns and its ``persist`` takes (its own kind of snapshot)."""


class Writer(Protocol[Staged]):
    """One way of making a snapshot durable (see the module docstring for the call order)."""

    collective: bool
    """Whether every rank calls each method at the same step (a DTensor state)."""

    def stage(
        self,
        state: Mapping[str, Any],
        target: SaveTarget,
        global_step: GlobalStepLike,
        *,
        background: bool,
        error: Exception | None = None,
    ) -> Staged | None:
        """1. Copy ``state`` for ``target`` (training thread); None: nothing to save
        (``allow_empty``). ``error``: what this rank found wrong before (collective only)."""
        ...

    def persist(
        self, staged: Staged, target: SaveTarget, stall_secs: float, *, background: bool
    ) -> SaveStats:
        """2. Write and commit ``staged``, record it, apply retention; frees ``staged``."""
        ...

    def release(self, staged: Staged) -> None:
        """3. Free ``staged`` without writing it."""
        ...

    def restore(
        self,
        state: Mapping[str, Any],
        save_path: str,
        *,
        found: bool,
        optional: set[str],
        whole_state: bool,
    ) -> None:
        """Load checkpoint ``save_path`` into ``state`` (``found``: this rank sees it)."""
        ...


class Directories:
    """The directories a ``Saver`` writes to: checked before a write, locked at the first.

    Args:
        storage: Where they are.

    Thread safety: ``check`` and ``lock`` from the training or writer thread; ``release`` once
    no save is in flight.
    """

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._locks: dict[str, DirectoryLock] = {}
        self._mutex = threading.Lock()

    def check(self, save_path: str) -> None:
        """Raise ``ValueError`` when ``save_path``'s directory does not exist (TF's text)."""
        save_dir = os.path.dirname(save_path)
        if save_dir and not self._storage.accepts_objects(save_dir):
            raise ValueError(f"Parent directory of {save_path} doesn't exist, can't save.")

    def lock(self, save_path: str) -> None:
        """Take the writer lock of ``save_path``'s directory at the first save there.

        Raises:
            LogdirLockedError: Another process writes to that directory.
        """
        directory = os.path.dirname(save_path)
        if directory in self._locks:  # One dict lookup per save: the training thread's.
            return
        if not self._storage.accepts_objects(directory):
            return  # The save reports the missing directory.
        lock = self._storage.lock(directory)  # Shared with other handles on the same dir.
        with self._mutex:
            self._locks[directory] = lock

    def release(self) -> None:
        """Release every lock taken (a later save takes them again)."""
        with self._mutex:
            locks, self._locks = self._locks, {}
        for lock in locks.values():
            lock.release()
