"""The two writers of a ``Saver``: one process's snapshot, or every rank's shards.

A ``Saver`` chooses one per state, once (``Saver._is_sharded``):

* ``SnapshotWriter``: the state of this process. ``stage`` copies it into host staging buffers
  on the calling thread (incremental: frozen tensors unchanged since the last commit of the
  same prefix family are referenced, not copied); ``persist`` writes it with the commit
  protocol (``commit.persist``), on the calling thread or the background writer thread, then
  hands it to the ``Keeper`` (state file, retention).
* ``ShardedWriter``: a state of DTensors (FSDP2). Every rank calls ``save`` (or, for an
  asynchronous save, ``stage`` then ``persist`` on the writer thread) at the same step and
  writes its own part with ``sharded.write_sharded`` (the same commit protocol), then rank 0
  applies retention and the others keep the same bookkeeping.

Both return ``SaveStats``: what the save cost.

Thread safety: ``stage``/``save`` on the training thread; ``persist`` on the writer thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchsupervisor._version import __version__
from torchsupervisor.checkpoint.commit import persist
from torchsupervisor.checkpoint.engine import CheckpointEngine
from torchsupervisor.checkpoint.incremental import StaleReferenceError
from torchsupervisor.checkpoint.retention import Keeper
from torchsupervisor.checkpoint.sharded.collective import write_sharded
from torchsupervisor.checkpoint.sharded.replay import PlanCache
from torchsupervisor.checkpoint.sharded.staging import (
    ShardedSave,
    StageMemo,
    failed,
    prepare,
    stage,
)
from torchsupervisor.checkpoint.snapshot import Snapshot, Stager
from torchsupervisor.checkpoint.tree_memo import TreeMemo
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.walk import WalkMemo, walk_state
from torchsupervisor.distributed.env import background_group, rank, world_size
from torchsupervisor.errors import CheckpointSaveError
from torchsupervisor.storage import Storage

__all__ = ["SaveStats", "SaveTarget", "ShardedWriter", "SnapshotWriter"]

logger = logging.getLogger("torchsupervisor")


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


class SnapshotWriter:
    """Stage this process's state now, persist it later (see the module docstring).

    Args:
        storage: Where the checkpoints go.
        clock: Time for the manifest's wall time.
        keeper: The Saver's ``Keeper``.
        incremental: Reference unchanged frozen tensors instead of copying them.
        max_shard_bytes: Largest shard in bytes; None: one shard.
    """

    def __init__(
        self,
        storage: Storage,
        clock: Clock,
        keeper: Keeper,
        *,
        incremental: bool,
        max_shard_bytes: int | None,
    ) -> None:
        self._storage = storage
        self._clock = clock
        self._keeper = keeper
        self._incremental = incremental
        self._max_shard_bytes = max_shard_bytes
        self.stager = Stager()
        self.engine = CheckpointEngine()
        self.cancel = threading.Event()
        self._memo = WalkMemo()  # What the last save's walk made of the state, reused.
        self._trees = TreeMemo()  # The last manifest's tree encodings (the writer thread).

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
            memo=self._memo,
            sharded=False,
            detach=False,
            frozen=frozen if self._incremental else None,
        )
        return skeleton, tensors, frozen

    def stage(
        self, flat: tuple[Any, dict[str, Any], set[str]], target: SaveTarget, step: int | None
    ) -> Snapshot:
        """Copy the flattened state into staging buffers (after the save in flight)."""
        skeleton, tensors, frozen = flat
        self.engine.wait()
        self.cancel.clear()  # A cancellation is for the save it was aimed at only.
        frozen = self._keeper.copied_always(frozen)
        return self.stager.stage(
            skeleton,
            tensors,
            step=step,
            wall_time=self._clock.time(),
            max_shard_bytes=self._max_shard_bytes,
            committed=self._keeper.reusable(
                target.save_path, target.prefix, frozen, target.latest_filename
            ),
            reusable=frozen,
        )

    def persist(self, snapshot: Snapshot, target: SaveTarget, stall_secs: float) -> SaveStats:
        """Write ``snapshot`` with the commit protocol, then record it and apply retention.

        Raises:
            CheckpointSaveError: If writing fails (the next save copies everything).
        """
        start = time.perf_counter()
        try:
            result = persist(
                snapshot,
                target.prefix,
                library_version=__version__,
                torch_version=torch.__version__,
                world_size=world_size(),
                storage=self._storage,
                cancel=self.cancel,
                trees=self._trees,
                metrics=target.metrics,
            )
        except CheckpointSaveError as e:
            stale = e.names if isinstance(e, StaleReferenceError) else ()
            self._keeper.failed(target.save_path, stale)  # The next save copies everything.
            raise
        finally:
            self.stager.release(snapshot)
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


class ShardedWriter:
    """Every rank saves its part of a state of DTensors (see the module docstring).

    ``save`` writes on the calling thread. ``stage`` + ``persist`` split an asynchronous
    save: ``stage`` (training thread) copies this rank's local shards into reusable host
    buffers, ``persist`` (writer thread) writes and commits them through a process group of
    its own (``env.background_group``), so it never interleaves with training's collectives.

    Args:
        storage: Where the checkpoints go.
        clock: Time for the manifest's wall time.
        keeper: The Saver's ``Keeper``.
        stager: Staging buffers of the shard layout, reused between saves (the snapshot
            writer's).

    Distributed: every rank calls ``save`` (or ``stage``) at the same step.
    """

    def __init__(self, storage: Storage, clock: Clock, keeper: Keeper, stager: Stager) -> None:
        self._storage = storage
        self._clock = clock
        self._keeper = keeper
        self._stager = stager
        self._host = Stager()  # The asynchronous saves' copies of the local shards.
        self._staged = StageMemo()  # What the last one staged over them, reused.
        self._memo = WalkMemo()  # The asynchronous saves' walks of the state, reused.
        self._plans = PlanCache()  # The last save's plan, replayed while the layout holds.
        self._sequence = 0  # Sharded saves begun (the ranks agree on it at each save).

    def save(
        self,
        state: Mapping[str, Any],
        target: SaveTarget,
        global_step: Any,
        error: Exception | None = None,
    ) -> SaveStats:
        """Save every rank's part as checkpoint ``prefix`` (a collective), then retention.

        ``error``: what this rank found wrong before the save (the save fails with it).

        Raises:
            CheckpointSaveError: On every rank, if any rank failed (nothing committed).
            Exception: On every rank, what any rank found before the save or in its state
                (``TypeError``, ``ValueError``, what a ``state_dict`` raised; nothing is
                written).
        """
        start = time.perf_counter()
        save = self._begin(state, target, global_step, error, keep_vars=False)
        return self._write(save, target, start, None, None)

    def stage(
        self,
        state: Mapping[str, Any],
        target: SaveTarget,
        global_step: Any,
        error: Exception | None = None,
    ) -> ShardedSave:
        """Copy this rank's local shards to host buffers (the training thread's whole part).

        Also makes the background process group at the first call (a collective). Nothing
        is raised here: what is wrong (``error``, found before the save, or in the state or
        its copy) is raised by ``persist``, on every rank.
        """
        save = self._begin(state, target, global_step, error, keep_vars=True)
        background_group()
        stage(save, self._host, self._staged)  # At once: the live parameters are not detached.
        return save

    def _begin(
        self,
        state: Mapping[str, Any],
        target: SaveTarget,
        global_step: Any,
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
                memo=self._memo if keep_vars else None,
            )
        else:
            save = failed(target.prefix, error, wall_time)
        save.sequence, self._sequence = self._sequence, self._sequence + 1
        return save

    def persist(self, save: ShardedSave, target: SaveTarget, stall_secs: float) -> SaveStats:
        """Write and commit a staged save (writer thread), then retention; frees its buffers.

        Raises:
            CheckpointSaveError, TypeError, ValueError: As ``save`` (on every rank).
        """
        try:
            start = time.perf_counter() - stall_secs  # The save began with its stall.
            return self._write(save, target, start, background_group(), stall_secs)
        finally:
            save.release()

    def _write(
        self,
        save: ShardedSave,
        target: SaveTarget,
        start: float,
        group: Any,
        stall_secs: float | None,
    ) -> SaveStats:
        """Write ``save`` through ``group``; ``stall_secs`` None: the whole save was the stall."""
        write_sharded(
            save,
            process_group=group,
            write_state=False,
            storage=self._storage,
            stager=self._stager,
            plans=self._plans,
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
