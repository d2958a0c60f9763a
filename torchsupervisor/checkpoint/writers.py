"""The two ``Writer`` implementations (``writer.py``): one process's snapshot, every rank's shards.

* ``SnapshotWriter``: the state of this process. ``stage`` copies it into host staging buffers
  on the calling thread (incremental: frozen tensors unchanged since the last commit of the
  same prefix family are referenced, not copied); ``persist`` writes it with the commit
  protocol (``commit.persist``), on the calling thread or the background writer thread, then
  hands it to the ``Keeper`` (state file, retention).
* ``ShardedWriter``: a state of DTensors (FSDP2), ``collective``. Every rank stages and persists
  at the same step and writes its own part with ``sharded.write_sharded`` (the same commit
  protocol); rank 0 then applies retention and the others keep the same bookkeeping. A
  background save copies the local shards into reusable host buffers in ``stage`` and agrees
  through a process group of its own (``env.background_group``) in ``persist``, so it never
  interleaves with training's collectives.

Thread safety: ``stage`` on the training thread; ``persist`` on the writer thread (or the
training thread for a synchronous save).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from torchsupervisor._version import __version__
from torchsupervisor.checkpoint.commit import persist
from torchsupervisor.checkpoint.engine import CheckpointEngine
from torchsupervisor.checkpoint.incremental import StaleReferenceError
from torchsupervisor.checkpoint.restore import restore_state
from torchsupervisor.checkpoint.retention import Keeper
from torchsupervisor.checkpoint.save_cache import SaveCache
from torchsupervisor.checkpoint.sharded.collective import load_sharded, write_sharded
from torchsupervisor.checkpoint.sharded.staging import (
    ShardedSave,
    failed,
    prepare,
    stage,
)
from torchsupervisor.checkpoint.snapshot import Snapshot, Stager
from torchsupervisor.checkpoint.writer import Directories, SaveStats, SaveTarget
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.global_step import read_step
from torchsupervisor.core.training_state import shared_entries
from torchsupervisor.core.walk import walk_state
from torchsupervisor.distributed.env import background_group, on_every_rank, rank, world_size
from torchsupervisor.errors import CheckpointSaveError
from torchsupervisor.storage import Storage

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from torchsupervisor.core.global_step import GlobalStepLike

__all__ = ["ShardedWriter", "SnapshotWriter", "replica_entries"]

logger = logging.getLogger("torchsupervisor")


def replica_entries(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """The entries of ``state`` this process saves to or loads from a checkpoint that the
    replicas share: all of them on rank 0 (and in a single process); on another rank, all
    but the per-rank ones (``training_state.is_per_rank``), since the checkpoint holds rank
    0's (told once per process at INFO).
    """
    if world_size() <= 1 or rank() == 0:
        return state
    shared = shared_entries(state)
    if shared is not state and not _told_per_rank:
        _told_per_rank.append(True)
        logger.info(
            "Rank %d: the per-rank entries %s are not restored from (nor saved to) the "
            "checkpoint, which holds rank 0's: this rank's start where it made them",
            rank(),
            sorted(shared.per_rank),  # type: ignore[attr-defined]
        )
    return shared


_told_per_rank: list[bool] = []


class SnapshotWriter:
    """This process's state, staged now and persisted later (a ``Writer``, not collective).

    Args:
        storage: Where the checkpoints go.
        clock: Time for the manifest's wall time.
        keeper: The Saver's ``Keeper``.
        engine: The Saver's writer thread (``stage`` waits for its save in flight).
        cancel: Set to abandon the save being persisted.
        stager: The host staging buffers, reused between saves.
        directories: Checks and locks the directories written to.
        incremental: Reference unchanged frozen tensors instead of copying them.
        max_shard_bytes: Largest shard in bytes; None: one shard.
        allow_empty: ``stage`` returns None for an empty state instead of raising.
        origin: Recorded in every manifest (``Saver(origin=)``).
        row_blocks: Record the larger tensors' blocks of rows (``Saver(row_blocks=)``).
    """

    collective = False

    def __init__(
        self,
        storage: Storage,
        clock: Clock,
        keeper: Keeper,
        engine: CheckpointEngine,
        cancel: threading.Event,
        stager: Stager,
        directories: Directories,
        *,
        incremental: bool,
        max_shard_bytes: int | None,
        allow_empty: bool,
        origin: dict[str, str | int] | None = None,
        row_blocks: bool = True,
    ) -> None:
        self._origin = origin
        self._row_blocks = row_blocks
        self._storage = storage
        self._clock = clock
        self._keeper = keeper
        self._engine = engine
        self._cancel = cancel
        self._stager = stager
        self._directories = directories
        self._incremental = incremental
        self._max_shard_bytes = max_shard_bytes
        self._allow_empty = allow_empty
        self._cache = SaveCache.create()  # The walk's and the manifest tree's memos.

    def _record(self, target: SaveTarget) -> None:
        if target.write_state:
            self._keeper.record_and_sweep(
                target.prefix, target.save_path, target.latest_filename, metrics=target.metrics
            )

    def flatten(self, state: Mapping[str, Any]) -> tuple[Any, dict[str, Any], set[str]]:
        """Flatten ``state``: its skeleton, its tensors, and the names of the frozen ones.

        The tensors are the live ones, parameters included (undetached: ``stage`` copies
        them under ``no_grad``), so the walk takes again what it made of the last save's
        state where nothing changed (``WalkMemo``).

        Raises:
            What ``state.flatten_state`` raises (``ShardedStateError`` for a DTensor).
        """
        frozen: set[str] = set()
        skeleton, tensors = walk_state(
            state,
            keep_vars=True,
            memo=self._cache.walk,
            sharded=False,
            detach=False,
            frozen=frozen if self._incremental else None,
        )
        return skeleton, tensors, frozen

    def stage(
        self,
        state: Mapping[str, Any],
        target: SaveTarget,
        global_step: GlobalStepLike,
        *,
        background: bool,
        error: Exception | None = None,
    ) -> Snapshot | None:
        """1. Copy ``state`` into staging buffers, after the save in flight (``Writer``).

        Raises:
            ValueError: Nothing to save (without ``allow_empty``), or (not ``background``)
                the directory is missing.
            TypeError: An entry that cannot be saved.
            LogdirLockedError: Another process writes to the directory.
        """
        if error is not None:
            raise error
        if not background:
            self._directories.check(target.save_path)
        skeleton, tensors, frozen = self.flatten(state)
        if not skeleton:
            if self._allow_empty:
                return None
            raise ValueError("No variables to save")
        self._directories.lock(target.save_path)
        step = None if global_step is None else read_step(global_step)
        self._engine.wait()
        self._cancel.clear()  # A cancellation is for the save it was aimed at only.
        frozen = self._keeper.copied_always(frozen)
        return self._stager.stage(
            skeleton,
            tensors,
            step=step,
            wall_time=self._clock.time(),
            max_shard_bytes=self._max_shard_bytes,
            committed=self._keeper.reusable(
                target.save_path, target.prefix, frozen, target.latest_filename
            ),
            reusable=frozen,
            wait=False,  # The device copies are waited for by ``persist`` (writer thread).
        )

    def release(self, staged: Snapshot) -> None:
        """3. Give the staging buffers back without writing."""
        self._stager.release(staged)

    def persist(
        self, snapshot: Snapshot, target: SaveTarget, stall_secs: float, *, background: bool
    ) -> SaveStats:
        """2. Write ``snapshot`` with the commit protocol, then record it and apply retention.

        Raises:
            CheckpointSaveError: If writing fails (the next save copies everything), or
                (``background``) the directory is missing, with ``stage``'s text.
        """
        snapshot.wait_copied()  # CUDA tensors: their copies were only queued by ``stage``.
        if background:  # The directory is checked here: a stat is not worth a stall.
            try:
                self._directories.check(target.save_path)
            except ValueError as e:
                self.release(snapshot)
                raise CheckpointSaveError(str(e), path=target.prefix) from None
        start = time.perf_counter()
        try:
            result = persist(
                snapshot,
                target.prefix,
                library_version=__version__,
                torch_version=torch.__version__,
                world_size=world_size(),
                storage=self._storage,
                cancel=self._cancel,
                trees=self._cache.trees,
                metrics=target.metrics,
                origin=self._origin,
                row_blocks=self._row_blocks,
            )
        except CheckpointSaveError as e:
            stale = e.names if isinstance(e, StaleReferenceError) else ()
            self._keeper.failed(target.save_path, stale)  # The next save copies everything.
            raise
        finally:
            self.release(snapshot)
        committed = time.perf_counter()
        self._keeper.committed(
            target.save_path,
            target.prefix,
            result.committed,
            full=not snapshot.references,
            recorded=target.write_state,
        )
        self._record(target)
        return SaveStats(
            prefix=target.prefix,
            stall_secs=stall_secs,
            commit_secs=committed - start,
            total_secs=time.perf_counter() - start,
            bytes_written=result.bytes_written,
            bytes_reused=sum(c.entry.nbytes for c in snapshot.references.values()),
        )

    def restore(
        self,
        state: Mapping[str, Any],
        save_path: str,
        *,
        found: bool,
        optional: set[str],
        whole_state: bool,
    ) -> None:
        """Verify checkpoint ``save_path`` and load it into ``state`` (``Saver.restore``).

        Raises:
            ValueError: ``found`` is False (TF's text).
            CorruptCheckpointError, NotFoundError, InvalidArgumentError: As ``restore_state``.
        """
        if not found:
            raise ValueError("The passed save_path is not a valid checkpoint: " + save_path)
        logger.info("Restoring parameters from %s", save_path)
        restore_state(
            state,
            save_path,
            storage=self._storage,
            optional=optional,
            whole_state=whole_state,
        )


class ShardedWriter:
    """Every rank saves its part of a state of DTensors (a collective ``Writer``).

    A synchronous save (``background=False``) stages nothing: ``persist`` plans, writes and
    commits on the calling thread through the default process group. A background save copies
    this rank's local shards into reusable host buffers in ``stage`` (the training thread's
    whole part) and writes them in ``persist`` through a process group of its own.

    Args:
        storage: Where the checkpoints go.
        clock: Time for the manifest's wall time.
        keeper: The Saver's ``Keeper``.
        engine: The Saver's writer thread (``stage`` waits for its save in flight).
        stager: Staging buffers of the shard layout, reused between saves.
        directories: Checks and locks the directories written to (rank 0 locks).

    Distributed: every rank calls each method at the same step.
    """

    collective = True

    def __init__(
        self,
        storage: Storage,
        clock: Clock,
        keeper: Keeper,
        engine: CheckpointEngine,
        stager: Stager,
        directories: Directories,
    ) -> None:
        self._storage = storage
        self._clock = clock
        self._keeper = keeper
        self._engine = engine
        self._stager = stager
        self._directories = directories
        self._host = Stager()  # The asynchronous saves' copies of the local shards.
        self._cache = SaveCache.create()  # The walk's, the staging's and the plan's memos.
        self._sequence = 0  # Sharded saves begun (the ranks agree on it at each save).

    def stage(
        self,
        state: Mapping[str, Any],
        target: SaveTarget,
        global_step: GlobalStepLike,
        *,
        background: bool,
        error: Exception | None = None,
    ) -> ShardedSave:
        """1. This rank's part of the save, after the save in flight; copied to host buffers
        when ``background`` (which also makes the background group at the first call, a
        collective).

        Nothing is raised here: what is wrong (``error``, the directory, the state or its
        copy) is raised by ``persist``, on every rank.
        """
        self._engine.wait()
        if error is None and not background:
            error = self._directory_error(target)
        save = self._begin(state, target, global_step, error, keep_vars=background)
        if background:
            background_group()
            # At once (the parameters are not detached); CUDA copies are only queued: the
            # writer thread waits for them (``persist``).
            stage(save, self._host, self._cache.staged, wait=False)
        return save

    def release(self, staged: ShardedSave) -> None:
        """3. Give the host buffers back without writing."""
        staged.release()

    def _directory_error(self, target: SaveTarget) -> Exception | None:
        """What is wrong with the directory on this rank: missing, or (rank 0) locked by
        another process; None when nothing is. Takes the lock at the first save."""
        try:
            self._directories.check(target.save_path)
            if rank() == 0:  # The other ranks write their shards under rank 0's lock.
                self._directories.lock(target.save_path)
        except Exception as e:
            return e
        return None

    def restore(
        self,
        state: Mapping[str, Any],
        save_path: str,
        *,
        found: bool,
        optional: set[str],
        whole_state: bool,
    ) -> None:
        """Every rank reads the chunks it needs of ``save_path`` (a collective).

        Raises:
            ValueError: On every rank, when any rank did not find the checkpoint.
        """
        del whole_state  # Each rank's state is its part; the manifest is checked per chunk.
        if not on_every_rank(found):  # Else this rank alone would raise.
            where = "" if not found else " (another rank cannot find it)"
            raise ValueError(f"The passed save_path is not a valid checkpoint: {save_path}{where}")
        logger.info("Restoring parameters from %s", save_path)
        load_sharded(state, save_path, allow_missing=optional, storage=self._storage)

    def _begin(
        self,
        state: Mapping[str, Any],
        target: SaveTarget,
        global_step: GlobalStepLike,
        error: Exception | None,
        *,
        keep_vars: bool,
    ) -> ShardedSave:
        """The save's flattened state (or ``error`` to carry), numbered for the ranks'
        agreement (``ShardedSave.sequence``)."""
        wall_time = self._clock.time()
        if error is None:
            save = prepare(
                state,
                target.prefix,
                global_step=global_step,
                wall_time=wall_time,
                keep_vars=keep_vars,
                memo=self._cache.walk if keep_vars else None,
            )
        else:
            save = failed(target.prefix, error, wall_time)
        save.sequence, self._sequence = self._sequence, self._sequence + 1
        return save

    def persist(
        self, save: ShardedSave, target: SaveTarget, stall_secs: float, *, background: bool
    ) -> SaveStats:
        """2. Write and commit every rank's part, then retention; frees the host buffers.

        Raises:
            CheckpointSaveError: On every rank, if any rank failed (nothing committed), or the
                ranks are at different saves.
            Exception: On every rank, what any rank found before the save or in its state
                (``ValueError``, ``TypeError``, what a ``state_dict`` raised; nothing written).
        """
        start = time.perf_counter() - stall_secs  # The save began with its stall.
        if not background:  # The whole save is the stall.
            return self._write(save, target, start, None, None)
        if save.snapshot is not None:
            save.snapshot.wait_copied()  # CUDA tensors: their copies were only queued.
        if save.error is None:  # The directory is checked here: a stat is not worth a stall.
            save.error = self._directory_error(target)
        try:
            return self._write(save, target, start, background_group(), stall_secs)
        finally:
            save.release()

    def _write(
        self,
        save: ShardedSave,
        target: SaveTarget,
        start: float,
        group: ProcessGroup | None,
        stall_secs: float | None,
    ) -> SaveStats:
        """Write ``save`` through ``group``; ``stall_secs`` None: the whole save was the stall."""
        write_sharded(
            save,
            process_group=group,
            write_state=False,
            storage=self._storage,
            stager=self._stager,
            plans=self._cache.plans,
        )
        committed = time.perf_counter()
        # Sharded saves are never incremental.
        self._keeper.committed(
            target.save_path, target.prefix, {}, full=True, recorded=target.write_state
        )
        if target.write_state:
            if rank() == 0:
                self._keeper.record_and_sweep(
                    target.prefix, target.save_path, target.latest_filename
                )
            else:  # Same bookkeeping; files are rank 0's business.
                self._keeper.record(target.prefix, target.save_path, target.latest_filename)
        total = time.perf_counter() - start
        return SaveStats(
            prefix=target.prefix,
            stall_secs=total if stall_secs is None else stall_secs,
            commit_secs=committed - start,
            total_secs=total,
            bytes_written=self._local_bytes(target.prefix),
            bytes_reused=0,
        )

    def _local_bytes(self, prefix: str) -> int:
        """Bytes of the data shard this rank wrote for ``prefix``."""
        directory, base = os.path.split(prefix)
        mine = f"{base}.data-{rank():05d}-of-"
        try:
            names = [n for n in self._storage.list(directory) if n.startswith(mine)]
            return sum(self._storage.size(os.path.join(directory, n)) for n in names)
        except OSError:
            return 0
