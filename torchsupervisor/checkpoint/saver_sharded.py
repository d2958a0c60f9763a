"""The ``Saver``'s saves and restores of a state of DTensors (FSDP2): every rank together.

A sharded save is a collective: every rank writes its part and the coordinator commits
(``sharded/``). Whatever one rank finds wrong before the collective (its step, its
directory, its state) is not raised on that rank alone, which would leave the others waiting
in the collective and then pair them with its next save: it is carried into the collective,
which raises it on every rank. A restore likewise: every rank agrees that the checkpoint
exists before any reads.

``ShardedSaves`` is the part of ``Saver`` that does this (a base class of it; the rest of
the saver, its writers, engine and keeper, is ``saver.py``'s).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torchsupervisor.checkpoint.sharded.collective import load_sharded
from torchsupervisor.checkpoint.sharded.staging import ShardedSave
from torchsupervisor.checkpoint.writers import SaveStats, SaveTarget, ShardedWriter
from torchsupervisor.distributed.env import on_every_rank, rank

if TYPE_CHECKING:
    from torchsupervisor.checkpoint.engine import CheckpointEngine
    from torchsupervisor.checkpoint.saver import Waitable
    from torchsupervisor.storage import Storage

__all__ = ["ShardedSaves"]

logger = logging.getLogger("torchsupervisor")


class ShardedSaves:
    """Saves and restores of a state of DTensors, for ``Saver`` (which provides the fields
    and methods annotated below)."""

    _engine: CheckpointEngine
    _sharded_writer: ShardedWriter
    _storage: Storage
    _optional: set[str]
    last_save: SaveStats | None

    _target: Callable[[str, Any, str | None, bool], SaveTarget]
    _check_dir: Callable[[str], None]  # Raises ValueError for a missing directory.
    _lock_directory: Callable[[str], None]  # Raises LogdirLockedError.
    _wait_before_writing: Callable[[Waitable | None], None]

    def _save_sharded(
        self,
        state: Mapping[str, Any],
        save_path: str,
        global_step: Any,
        latest_filename: str | None,
        write_state: bool,
    ) -> str:
        """``Saver.save`` of a state of DTensors: written and committed by every rank now."""
        target, error = self._sharded_target(save_path, global_step, latest_filename, write_state)
        self.last_save = self._sharded_writer.save(state, target, global_step, error)
        return target.prefix

    def _save_async_sharded(
        self,
        state: Mapping[str, Any],
        save_path: str,
        global_step: Any,
        latest_filename: str | None,
        write_state: bool,
        start: float,
        write_after: Waitable | None = None,
    ) -> concurrent.futures.Future[str | None]:
        """``Saver.save_async`` of a state of DTensors: the local shards copied now (since
        ``start``, the stall), written and committed by every rank's writer thread (after
        ``write_after``, as ``Saver.save_async``)."""
        target, error = self._sharded_target(
            save_path, global_step, latest_filename, write_state, check_dir=False
        )
        save = self._sharded_writer.stage(state, target, global_step, error)
        stall = time.perf_counter() - start
        return self._engine.submit(self._persist_sharded, save, target, stall, write_after)

    def _restore_sharded(self, state: Mapping[str, Any], save_path: str, found: bool) -> None:
        """``Saver.restore`` of a state of DTensors; ``found``: whether this rank found it.

        Raises:
            ValueError: On every rank, when any rank did not find the checkpoint.
        """
        if not on_every_rank(found):  # Else this rank alone would raise.
            where = "" if not found else " (another rank cannot find it)"
            raise ValueError(f"The passed save_path is not a valid checkpoint: {save_path}{where}")
        logger.info("Restoring parameters from %s", save_path)
        load_sharded(state, save_path, allow_missing=self._optional, storage=self._storage)

    def _sharded_target(
        self,
        save_path: str,
        global_step: Any,
        latest_filename: str | None,
        write_state: bool,
        *,
        check_dir: bool = True,
    ) -> tuple[SaveTarget, Exception | None]:
        """Where a sharded save goes, and what this rank found wrong before it (or None).

        Waits for the save in flight first (one at a time), then (``check_dir``) checks the
        directory and takes its lock (rank 0). An error is returned, not raised: this rank
        still joins the collective, which raises it on every rank. A rank that raised alone
        would leave the others waiting in the collective, then meet their next save with
        this one.
        """
        self._engine.wait()
        try:
            target = self._target(save_path, global_step, latest_filename, write_state)
        except Exception as e:  # No prefix: the save fails before anything is written.
            return SaveTarget(save_path, save_path, latest_filename, write_state=False), e
        return target, self._sharded_dir_error(target) if check_dir else None

    def _sharded_dir_error(self, target: SaveTarget) -> Exception | None:
        """What is wrong with a sharded save's directory on this rank: missing, or (rank 0)
        locked by another process; None when nothing is. Takes the lock at the first save."""
        try:
            self._check_dir(target.save_path)
            if rank() == 0:  # The other ranks write their shards under rank 0's lock.
                self._lock_directory(target.save_path)
        except Exception as e:
            return e
        return None

    def _persist_sharded(
        self,
        save: ShardedSave,
        target: SaveTarget,
        stall_secs: float,
        write_after: Waitable | None = None,
    ) -> str:
        """Write a staged sharded save (on the writer thread; a collective of every rank).

        The directory is checked here, not at the step boundary (a ``stat``, 0.1 ms of the
        stall); what is wrong with it fails the save on every rank, in the collective.
        """
        self._wait_before_writing(write_after)
        if save.error is None:
            save.error = self._sharded_dir_error(target)
        self.last_save = self._sharded_writer.persist(save, target, stall_secs)
        logger.debug("Checkpoint %s: %s", target.prefix, self.last_save)
        return target.prefix
