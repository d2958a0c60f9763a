"""``CheckpointSaverHook``: checkpoint at session creation, every N steps or seconds, and at end.

Checkpoints keep the library's guarantees (SPEC section 4):

* The snapshot is taken in ``after_run``, on the training thread between two steps, so a
  checkpoint is always the state of one step.
* The checkpoints land at the steps of TF's schedule whatever the speed of the disk: a save
  that becomes due while the previous one is still being written waits for it (on the
  training thread), then snapshots the due step. No due step is skipped.
* Without listeners the checkpoint is written in the background (``Saver.save_async``): a run
  waits only for the copy to host memory (and, when a save is due, for the previous save).
* With listeners the hook waits, inside the same ``after_run``, for the checkpoint to be
  committed and then calls ``after_save``, as TF's synchronous save did: a listener returning
  True stops training at that very run.
* A checkpoint taken in ``after_run`` is written once the summaries logged up to the next
  step boundary (the loop's summaries of that step) are flushed, so they reach disk before
  it; the ``SessionLog.CHECKPOINT`` event is written once it is committed.
* ``end()`` waits for the save in flight and saves the last step synchronously; after a
  preemption signal, within the grace period (``set_final_save_budget``): a checkpoint that
  cannot finish in time is cancelled, never left half-written.

The skip rule, the one save in flight, the reports and the grace budget are the
``CheckpointDriver``'s (``checkpoint_driver``, the capability sessions look for); this hook only
keeps TF's schedule and calls the listeners.

TF names: ``tf.compat.v1.train.CheckpointSaverHook``, ``CheckpointSaverListener``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from torchsupervisor.core.checks import check_bool, check_int, check_number, check_path, check_str
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.global_step import read_step
from torchsupervisor.core.registry import GraphKeys, get_collection
from torchsupervisor.core.timers import SecondOrStepTimer
from torchsupervisor.driver.checkpoint_driver import CheckpointDriver
from torchsupervisor.hooks._global_step import require_global_step, session_global_step
from torchsupervisor.hooks.session_run_hook import (
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)
from torchsupervisor.storage import paths as url_paths
from torchsupervisor.summary.writer_cache import SummaryWriterCache

if TYPE_CHECKING:
    from torchsupervisor.core.coordinator import Coordinator
    from torchsupervisor.core.session import SessionLike
    from torchsupervisor.driver.checkpoint_driver import SaverLike

__all__ = ["CheckpointSaverHook", "CheckpointSaverListener"]

logger = logging.getLogger("torchsupervisor")


class CheckpointSaverListener:
    """Code to run around the checkpoints of a ``CheckpointSaverHook``; all no-ops by default.

    Call order: ``begin()`` (in the hook's ``begin``); per checkpoint ``before_save`` (just
    before the snapshot) then ``after_save`` (once the checkpoint is committed, in the same hook
    call: the hook waits for the commit); ``end()`` after the final checkpoint.

    Thread safety: every method is called on the training thread.

    TF name: ``tf.compat.v1.train.CheckpointSaverListener``.
    """

    def begin(self) -> None:
        """Prepare before the session is created (called from the hook's ``begin``).

        TF name: ``tf.compat.v1.train.CheckpointSaverListener.begin``.
        """

    def before_save(self, session: SessionLike, global_step_value: int) -> None:
        """Act just before the snapshot of the checkpoint at ``global_step_value``.

        Args:
            session: The session being checkpointed (no hooks).
            global_step_value: The step of the checkpoint (int).

        TF name: ``tf.compat.v1.train.CheckpointSaverListener.before_save``.
        """

    def after_save(self, session: SessionLike, global_step_value: int) -> bool | None:
        """Act once the checkpoint at ``global_step_value`` is committed.

        Not called for a save that failed.

        Args:
            session: The session that was checkpointed (no hooks).
            global_step_value: The step of the checkpoint (int).

        Returns:
            True to request that training stops after the current run (ignored for the
            checkpoint saved when a session is created, as in TF); None or False: go on.

        TF name: ``tf.compat.v1.train.CheckpointSaverListener.after_save``.
        """

    def end(self, session: SessionLike, global_step_value: int) -> None:
        """Act at the end, after the final checkpoint at ``global_step_value``.

        Also called when a final save under a time budget was abandoned.

        Args:
            session: The last session (no hooks).
            global_step_value: The last step (int).

        TF name: ``tf.compat.v1.train.CheckpointSaverListener.end``.
        """


class CheckpointSaverHook(SessionRunHook):
    """Save checkpoints at session creation, every N steps or seconds, and at the end.

    Schedule (as TF): a checkpoint at the step of each new session (step 0 for a fresh run),
    then at every step whose timer is due, then at the last step in ``end()`` if it was not
    saved; with ``save_steps=2`` and one step per run: 0, 2, 4, ... Used in a bare hooked
    session (no ``after_create_session``), the first run saves: 1, 3, 5, ... A session restored
    from this directory's checkpoint of its current step does not write it again (a
    deliberate difference: TF rewrote the same checkpoint).

    A due save never waits for the disk more than TF's synchronous save would: without
    listeners it waits only for the previous save still being written, if any, and is then
    written in the background; with listeners it is committed before ``after_run`` returns.

    Args:
        checkpoint_dir: Directory of the checkpoints (created if missing); its shared writer
            (``SummaryWriterCache``) receives the CHECKPOINT events.
        save_secs: Seconds between two checkpoints (monotonic clock); None: use ``save_steps``.
        save_steps: Steps between two checkpoints; None: use ``save_secs``.
        saver: The ``Saver``; None: ``scaffold.saver``, else the single saver of the
            ``SAVERS`` collection.
        checkpoint_basename: File name prefix: checkpoints are ``<dir>/<basename>-<step>``.
        scaffold: A ``Scaffold`` whose saver to use.
        listeners: ``CheckpointSaverListener``s, called in order.
        save_graph_def: Accepted for TF compatibility; there is no graph to write.
        stop_on_checkpoint_error: By default a save that fails is logged and reported in the
            event file, and training continues (the next due step tries again; older
            checkpoints are untouched). With True, the error is raised on the training thread
            at the hook's next call (or at once when listeners make the hook wait).
        clock: Time source; None means the real clock.

    Raises:
        ValueError: ``"You cannot provide both saver and scaffold."``; the timer's errors.
        RuntimeError: From ``begin()``, ``"Global step should be created to use
            CheckpointSaverHook."``; at the first save, TF's texts when the ``SAVERS``
            collection has no saver or more than one.
        CheckpointSaveError: From ``end()`` when the final save fails; with
            ``stop_on_checkpoint_error``, from the hook call that sees a save fail.

    Thread safety: used on the training thread; the commit callback (the CHECKPOINT event)
    runs on the saver's writer thread.

    TF name: ``tf.compat.v1.train.CheckpointSaverHook``.
    """

    def __init__(
        self,
        checkpoint_dir: str,
        save_secs: float | None = None,
        save_steps: int | None = None,
        saver: SaverLike | None = None,
        checkpoint_basename: str = "model.ckpt",
        scaffold: Any = None,
        listeners: Iterable[CheckpointSaverListener] | None = None,
        save_graph_def: bool = True,
        *,
        stop_on_checkpoint_error: bool = False,
        clock: Clock | None = None,
    ) -> None:
        if saver is not None and scaffold is not None:
            raise ValueError("You cannot provide both saver and scaffold.")
        checkpoint_dir = check_path("checkpoint_dir", checkpoint_dir, allow_none=False)
        save_secs = check_number("save_secs", save_secs, allow_none=True)
        save_steps = check_int("save_steps", save_steps, allow_none=True)
        check_str("checkpoint_basename", checkpoint_basename, allow_empty=False)
        stop_on_checkpoint_error = check_bool("stop_on_checkpoint_error", stop_on_checkpoint_error)
        del save_graph_def  # No graph in eager PyTorch.
        logger.info("Create CheckpointSaverHook.")
        self._saver = saver
        self._checkpoint_dir = os.fspath(checkpoint_dir)
        self._save_path = os.path.join(self._checkpoint_dir, checkpoint_basename)
        self._scaffold = scaffold
        self._timer = SecondOrStepTimer(every_secs=save_secs, every_steps=save_steps, clock=clock)
        self._listeners = list(listeners or [])
        self._stop_on_checkpoint_error = stop_on_checkpoint_error
        # The saver is resolved at the first save (scaffold, then the SAVERS collection).
        self._driver = CheckpointDriver(
            saver, self._save_path, clock=clock, stop_on_error=stop_on_checkpoint_error
        )
        # The save being written in the background (no listeners), until the training thread
        # has seen it end.
        self._pending: tuple[concurrent.futures.Future, int, Any] | None = None
        self.final_save_failure: str | None = None
        """After ``end()`` under a budget: why the final checkpoint is missing; else None."""
        self.final_held_elsewhere: str | None = None
        """What holds the final step already (``"this node's memory tier"``: a
        ``MonitoredSession`` sets it at a preemption): the final save is then not started
        when it cannot fit in its budget (``CheckpointDriver.final``)."""

    @property
    def save_path(self) -> str:
        """The checkpoint prefix without step, ``<checkpoint_dir>/<basename>``.

        TF name: none (TF keeps it private, ``CheckpointSaverHook._save_path``).
        """
        return self._save_path

    @property
    def checkpoint_driver(self) -> CheckpointDriver:
        """The ``CheckpointDriver`` of this hook (the capability sessions look for).

        TF name: none.
        """
        return self._driver

    def begin(self) -> None:
        """Find the writer and the global step; call the listeners' ``begin``.

        Raises:
            RuntimeError: ``"Global step should be created to use CheckpointSaverHook."``.

        TF name: ``tf.compat.v1.train.CheckpointSaverHook.begin``.
        """
        self._driver.writer = SummaryWriterCache.get(self._checkpoint_dir)
        self._driver.global_step = require_global_step("CheckpointSaverHook")
        for listener in self._listeners:
            listener.begin()

    def after_create_session(self, session: SessionLike, coord: Coordinator) -> None:
        """Save a checkpoint at the step of the new session (unless it was just restored).

        Waits first for a save still being written. Without listeners the new save is left
        in flight; with listeners it is committed before this returns. A listener's request to
        stop from this save is ignored, as in TF.

        Raises:
            RuntimeError: TF's texts when no saver was given and the ``SAVERS`` collection has
                none or more than one.
            CheckpointSaveError: With ``stop_on_checkpoint_error``, if the previous save failed
                (or this one, with listeners).

        TF name: ``tf.compat.v1.train.CheckpointSaverHook.after_create_session``.
        """
        del coord
        step = self._session_step(session)
        if not self._restored_at(session, step):
            self._save(session, step)
        self._timer.update_last_triggered_step(step)

    def _session_step(self, session: SessionLike) -> int:
        """A new session's global step (the driver's from now on), once the save still being
        written is finished."""
        driver = self._driver
        driver.global_step = session_global_step(session, driver.global_step)
        self._finish_pending()
        return read_step(driver.global_step)

    def _restored_at(self, session: SessionLike, step: int) -> bool:
        """Whether ``session`` was restored from this hook's checkpoint of ``step`` (then the
        driver's last checkpoint: it is not written again)."""
        restored = getattr(session, "restored_checkpoint", None)
        if restored is None or url_paths.abspath(restored) != url_paths.abspath(
            f"{self._save_path}-{step}"
        ):
            return False
        self._driver.last_step, self._driver.last_prefix = step, restored
        return True

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """Save when the timer is due (waiting first for a save still being written).

        Requests a stop when a listener's ``after_save`` returns True.

        Raises:
            RuntimeError: As ``after_create_session``, when there is no single saver.
            CheckpointSaveError: With ``stop_on_checkpoint_error``, if a save failed.

        TF name: ``tf.compat.v1.train.CheckpointSaverHook.after_run``.
        """
        del run_values
        if self._pending is not None and not self._driver.in_flight:
            self._finish_pending()
        step = read_step(self._driver.global_step)
        if self._timer.should_trigger_for_step(step):
            self._timer.update_last_triggered_step(step)
            if self._save(run_context.session, step, in_step=True):
                run_context.request_stop()

    def end(self, session: SessionLike) -> None:
        """Wait for the save in flight, save the last step if needed, end the listeners.

        With a budget (``set_final_save_budget``) a save that fails or does not commit in
        time is logged, not raised. Then the listeners' ``end`` is called, the saver closed
        and the writer flushed.

        Raises:
            CheckpointSaveError: If the final save fails (without a time budget); with
                ``stop_on_checkpoint_error``, if the save in flight failed.
            RuntimeError: As ``after_create_session``, when there is no single saver.

        TF name: ``tf.compat.v1.train.CheckpointSaverHook.end``.
        """
        driver = self._driver
        last_step = read_step(driver.global_step)
        self.final_save_failure = None
        budget = driver.grace_budget_secs
        try:
            self._get_saver()
            if budget is None:
                self._finish_pending()
            # Under a budget, final() waits for the save in flight (or abandons it); it is
            # finished here once it has ended, its failure logged and not raised.

            def before_save(step: int | None) -> None:
                self._finish_pending(raise_error=budget is None)
                self._before_save(session)(step)

            prefix = driver.final(
                session,
                last_step,
                before_save=before_save,
                held_elsewhere=self.final_held_elsewhere,
            )
            if self._pending is not None:
                if driver.in_flight:  # Abandoned and stuck: it will commit nothing.
                    self._pending = None
                else:
                    self._finish_pending(raise_error=False)
            if prefix is not None:
                self._after_save(session, last_step)
            if driver.grace_budget_secs is not None and driver.last_step != last_step:
                self.final_save_failure = driver.last_error or "it was not written"
            for listener in self._listeners:
                listener.end(session, last_step)
        finally:  # Also after a failed final save: its error event reaches the disk.
            driver.close()  # No idle writer thread outlives the session.
            if driver.writer is not None:
                driver.writer.flush()

    @property
    def last_saved_step(self) -> int | None:
        """The step of the newest checkpoint committed (or found restored) by this hook.

        TF name: none.
        """
        return self._driver.last_step

    def abandon(self, timeout_secs: float = 5.0) -> None:
        """Cancel the save in flight and close the saver, without a final checkpoint.

        For an abort (a second Ctrl-C): the save commits nothing and leaves no file; the last
        committed checkpoint stays the newest.

        Args:
            timeout_secs: Longest wait for the writer to stop, in seconds.

        TF name: none.
        """
        self._pending = None
        self._get_saver()
        if self._driver.abandon(timeout_secs):
            self._driver.close()

    def set_final_save_budget(self, timeout_secs: float | None) -> None:
        """Bound the time ``end()`` spends on checkpoints, in seconds (a grace period).

        Within the budget ``end()`` waits for the save being written and writes the final
        checkpoint; a save that cannot finish in time is cancelled (``Saver.cancel``): it
        commits nothing and leaves no file, and the last committed checkpoint stays the
        newest. (``CheckpointDriver.grace_budget_secs``.)

        Args:
            timeout_secs: The budget (the driver's clock); None: no limit.

        TF name: none (TF had no preemption grace period).
        """
        self._driver.grace_budget_secs = timeout_secs

    def wait_for_save(self, timeout_secs: float | None = None) -> bool:
        """Wait until the checkpoint being written in the background (if any) is committed.

        The save's outcome is handled at the hook's next call.

        Args:
            timeout_secs: Longest wait, in seconds; None: no limit.

        Returns:
            True when no save is being written any more, False on timeout.

        Thread safety: call from the training thread.

        TF name: none (TF's saves were synchronous).
        """
        return self._driver.wait(timeout_secs)

    # ------------------------------------------------------------------------------ saving

    def _get_saver(self) -> Any:
        if self._saver is None:
            if self._scaffold is not None:
                self._saver = self._scaffold.saver
            else:
                savers = get_collection(GraphKeys.SAVERS)
                if not savers:
                    raise RuntimeError(
                        "No items in collection savers. Please add a saver to the collection "
                        "or provide a saver or scaffold."
                    )
                if len(savers) > 1:
                    raise RuntimeError(
                        "More than one item in collection savers. Please indicate which one to "
                        "use by passing it to the constructor."
                    )
                self._saver = savers[0]
        self._driver.saver = self._saver
        return self._saver

    def _before_save(self, session: SessionLike) -> Any:
        def before(step: int | None) -> None:
            logger.info("Saving checkpoints for %d into %s.", step, self._save_path)
            for listener in self._listeners:
                listener.before_save(session, step)

        return before

    def _save(self, session: SessionLike, step: int, *, in_step: bool = False) -> bool:
        """Save at ``step`` in the background; return True if a listener asked to stop.

        Waits for the previous save first. With listeners the new save is waited for and
        ``after_save`` is called. ``in_step``: called from ``after_run``, before the loop
        logs the step's summaries; the save writes once they are flushed, at the next step
        boundary (``CheckpointDriver.start``).
        """
        self._finish_pending()
        self._get_saver()
        self._before_save(session)(step)
        future = self._driver.start(session, step, flush_at_next_boundary=in_step)
        if future is not None:
            self._pending = (future, step, session)
        return bool(self._listeners) and self._finish_pending()

    def _finish_pending(self, raise_error: bool = True) -> bool:
        """Wait for the save in flight (if any) and finish it on the training thread.

        Args:
            raise_error: Raise the save's error with ``stop_on_checkpoint_error``; False: it
                was reported (logged, an event), nothing more.

        Returns:
            True if a listener's ``after_save`` asked to stop.

        Raises:
            CheckpointSaveError: With ``stop_on_checkpoint_error`` and ``raise_error``, if the
                save failed.
        """
        self._driver.wait()  # The save and its report (CHECKPOINT event, or failure).
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        future, step, session = pending
        error = future.exception()
        if error is not None:
            if self._stop_on_checkpoint_error and raise_error:
                raise error
            return False
        if future.result() is None:  # An empty state saved nothing.
            return False
        return self._after_save(session, step)

    def _after_save(self, session: SessionLike, step: int) -> bool:
        stop = False
        for listener in self._listeners:
            if listener.after_save(session, step):
                logger.info(
                    "A CheckpointSaverListener requested that training be stopped. listener: %s",
                    listener,
                )
                stop = True
        return stop
