"""``ShardedCheckpointSaverHook``: a ``CheckpointSaverHook`` on every rank of a sharded state.

With a sharded state (FSDP2 / DTensor) no rank holds the whole model: a checkpoint is a
collective that every rank enters at the same step, each writing its own shards. The hook
keeps ``CheckpointSaverHook``'s schedule, listeners and reports, and takes each checkpoint
with the other ranks through a ``ShardedCheckpointService`` (``driver/sharded_checkpoints``)
on the session's replica group (``Session.replicas``, set by ``ShardedSessionCreator``):

* The checkpoint of a new session and those of ``save_steps``: every rank's timer is due at
  the same steps (the ranks start at the same restored step and count the same steps), so
  each rank votes at that step and every rank saves, or none does (a rank whose previous
  save is still being written, a skip of a step already saved, a veto).
* Those of ``save_secs``: each rank's clock is its own, so only the chief's timer counts; it
  asks the others through the store (``ShardedCheckpointService.request``) and every rank
  saves at the step they then agree on, the next one any rank reaches (not the step the
  chief's timer was due at).
* The final one in ``end()``: every rank stopped at the same step (``MonitoredSession``'s
  agreed stop); every rank votes and saves, or none does. A rank whose session ended with an
  error vetoes (``ReplicaStop.end``): the others skip it at once. After a preemption the vote
  gets what is left of the grace period; a save in progress cannot be cancelled (the others
  write too), so a rank whose last save took longer than that votes no.

Listeners run on every rank. Only the chief writes the ``SessionLog.CHECKPOINT`` events (to
``SummaryWriterCache.get(checkpoint_dir)``); the other ranks create no event file.

TF name: none (TF's ``CheckpointSaverHook`` ran on the chief alone).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torchsupervisor.core.global_step import read_step
from torchsupervisor.driver.sharded_checkpoints import (
    DEFAULT_AGREEMENT_SECS,
    ShardedCheckpointService,
)
from torchsupervisor.errors import CheckpointSaveError
from torchsupervisor.hooks._global_step import require_global_step
from torchsupervisor.hooks.checkpoint_saver import CheckpointSaverHook
from torchsupervisor.summary.writer_cache import SummaryWriterCache

if TYPE_CHECKING:
    from torchsupervisor.core.coordinator import Coordinator
    from torchsupervisor.core.session import SessionLike
    from torchsupervisor.hooks.session_run_hook import SessionRunContext, SessionRunValues

__all__ = ["ShardedCheckpointSaverHook"]

logger = logging.getLogger("torchsupervisor")


class ShardedCheckpointSaverHook(CheckpointSaverHook):
    """Save a sharded state's checkpoints together with every other rank (module docstring).

    Give it to every rank's ``MonitoredSession`` (``MonitoredTrainingSession`` does, for a
    sharded state), with the same arguments on every rank.

    Args:
        *args: ``CheckpointSaverHook``'s arguments, in its order.
        agreement_secs: The longest wait for the other ranks' votes on a checkpoint, in
            seconds (a rank that does not vote in time makes the others skip it).
        **kwargs: ``CheckpointSaverHook``'s keyword arguments.

    Raises:
        ValueError: As ``CheckpointSaverHook``; from ``after_create_session``, for a session
            that the ranks did not prepare together (no ``Session.replicas``).
        DeadlineExceededError: From ``after_create_session`` or ``after_run``, when not every
            rank voted on a checkpoint of ``save_steps`` within ``agreement_secs``.
        CheckpointSaveError: As ``CheckpointSaverHook``.

    Thread safety: the training thread, as ``CheckpointSaverHook``; the service's poller
    thread only queues work for the training thread's next step boundary.
    Distributed: every rank of the replica group, with the same schedule.

    TF name: none (see the module docstring).
    """

    def __init__(
        self, *args: Any, agreement_secs: float = DEFAULT_AGREEMENT_SECS, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._agreement_secs = agreement_secs
        self._service: ShardedCheckpointService | None = None
        self._is_chief = False
        self._listener_stop = False  # A listener of an agreed periodic save asked to stop.

    def begin(self) -> None:
        """Find the global step and call the listeners' ``begin`` (the chief's event writer
        is found with the session, which tells which rank this is).

        Raises:
            RuntimeError: ``"Global step should be created to use CheckpointSaverHook."``.

        TF name: none (``CheckpointSaverHook.begin``).
        """
        self._driver.global_step = require_global_step("CheckpointSaverHook")
        for listener in self._listeners:
            listener.begin()

    def after_create_session(self, session: SessionLike, coord: Coordinator) -> None:
        """Join the session's replica group; save at the session's step with every rank
        (unless every rank restored that step's checkpoint).

        Raises:
            ValueError: If ``session`` has no replica group.
            DeadlineExceededError: If not every rank voted within ``agreement_secs``.
            CheckpointSaveError: With ``stop_on_checkpoint_error``, if the previous save
                failed (or this one, with listeners).

        TF name: none (``CheckpointSaverHook.after_create_session``).
        """
        del coord
        group = getattr(session, "replicas", None)
        if group is None:
            raise ValueError(
                "ShardedCheckpointSaverHook needs a session that every rank prepared together "
                "(ShardedSessionCreator, as MonitoredTrainingSession uses for a sharded state)"
            )
        self._close_service(wait=True)
        self._is_chief = group.rank == group.chief_rank
        driver = self._driver
        driver.writer = SummaryWriterCache.get(self._checkpoint_dir) if self._is_chief else None
        step = self._session_step(session)
        self._get_saver()
        self._restored_at(session, step)  # Every rank then votes "same": nobody saves.
        self._service = ShardedCheckpointService(
            session,
            driver,
            group,
            start=lambda agreed: self._agreed_save(session, agreed),
            agreement_secs=self._agreement_secs,
            clock=driver.clock,
        )
        self._service.start()
        if self._service.agree_now():
            self._save(session, step)
        self._timer.update_last_triggered_step(step)

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """Save with every rank when the timer is due (module docstring).

        Raises:
            DeadlineExceededError: (``save_steps``) if not every rank voted in time.
            CheckpointSaveError: With ``stop_on_checkpoint_error``, if a save failed.

        TF name: none (``CheckpointSaverHook.after_run``).
        """
        del run_values
        service = self._service
        if service is None:
            raise RuntimeError("ShardedCheckpointSaverHook: after_run before a session")
        if self._pending is not None and not self._driver.in_flight:
            self._finish_pending()
        if self._listener_stop:
            run_context.request_stop()
        step = read_step(self._driver.global_step)
        if not self._timer.should_trigger_for_step(step):
            return
        self._timer.update_last_triggered_step(step)
        if self._timer.every_steps:  # Due at this step on every rank.
            if service.agree_now() and self._save(run_context.session, step, in_step=True):
                run_context.request_stop()
        elif self._is_chief:  # Every rank saves at the step they agree on.
            service.request()

    def _agreed_save(self, session: SessionLike, step: int) -> None:
        """The background save of a ``save_secs`` checkpoint, at the agreed step."""
        if self._save(session, step):
            self._listener_stop = True

    def end(self, session: SessionLike) -> None:
        """Save the last step with every rank (or with none), then end the listeners.

        Raises:
            CheckpointSaveError: If the final save fails (without a time budget); with
                ``stop_on_checkpoint_error``, if the save in flight failed.

        TF name: none (``CheckpointSaverHook.end``).
        """
        service = self._service
        if service is None:  # No session was created.
            super().end(session)
            return
        driver = self._driver
        last_step = read_step(driver.global_step)
        budget = driver.grace_budget_secs
        self.final_save_failure = None
        try:
            self._finish_pending(raise_error=budget is None)
            if service.agree_final(self._agreement_secs, budget):
                self._before_save(session)(last_step)
                try:
                    prefix = driver.save(session, last_step)
                except CheckpointSaveError:
                    if budget is None:
                        raise
                    prefix = None
                if prefix is not None:
                    self._after_save(session, last_step)
            if budget is not None and driver.last_step != last_step:
                self.final_save_failure = driver.last_error or "it was not written"
            for listener in self._listeners:
                listener.end(session, last_step)
        finally:
            self._close_service(wait=True)
            driver.close()
            if driver.writer is not None:
                driver.writer.flush()

    def abandon(self, timeout_secs: float = 5.0) -> None:
        """Stop taking part in the ranks' checkpoints, then ``CheckpointSaverHook.abandon``.

        TF name: none.
        """
        self._close_service(wait=False)
        super().abandon(timeout_secs)

    def _close_service(self, wait: bool) -> None:
        service, self._service = self._service, None
        if service is not None:
            service.close(wait=wait)
