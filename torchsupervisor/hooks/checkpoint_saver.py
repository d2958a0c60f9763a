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
* The ``SessionLog.CHECKPOINT`` event is written once the checkpoint is committed, followed by
  a flush request, so the summaries of the steps up to a checkpoint reach disk with it.
* ``end()`` waits for the save in flight and saves the last step synchronously; after a
  preemption signal, within the grace period (``set_final_save_budget``): a checkpoint that
  cannot finish in time is cancelled, never left half-written.

TF names: ``tf.compat.v1.train.CheckpointSaverHook``, ``CheckpointSaverListener``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event, LogMessage, SessionLog

from torchsupervisor.core.checks import check_bool, check_int, check_number, check_path, check_str
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.global_step import read_step
from torchsupervisor.core.registry import GraphKeys, get_collection
from torchsupervisor.core.timers import SecondOrStepTimer
from torchsupervisor.errors import CheckpointSaveError
from torchsupervisor.hooks._global_step import require_global_step, session_global_step
from torchsupervisor.hooks.session_run_hook import (
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)
from torchsupervisor.summary.writer_cache import SummaryWriterCache

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

    def before_save(self, session: Any, global_step_value: int) -> None:
        """Act just before the snapshot of the checkpoint at ``global_step_value``.

        Args:
            session: The session being checkpointed (no hooks).
            global_step_value: The step of the checkpoint (int).

        TF name: ``tf.compat.v1.train.CheckpointSaverListener.before_save``.
        """

    def after_save(self, session: Any, global_step_value: int) -> bool | None:
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

    def end(self, session: Any, global_step_value: int) -> None:
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

    Thread safety: used on the training thread; the commit callback (CHECKPOINT event and
    flush request) runs on the saver's writer thread.

    TF name: ``tf.compat.v1.train.CheckpointSaverHook``.
    """

    def __init__(
        self,
        checkpoint_dir: str,
        save_secs: float | None = None,
        save_steps: int | None = None,
        saver: Any = None,
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
        self._summary_writer: Any = None
        self._global_step: Any = None
        # The save being written in the background (no listeners), until the training thread
        # sees it finished.
        self._pending: _PendingSave | None = None
        self._last_saved_step: int | None = None
        self._last_error: str | None = None
        self._final_budget_secs: float | None = None
        self.final_save_failure: str | None = None
        """After ``end()`` under a budget: why the final checkpoint is missing; else None."""

    @property
    def save_path(self) -> str:
        """The checkpoint prefix without step, ``<checkpoint_dir>/<basename>``.

        TF name: none (TF keeps it private, ``CheckpointSaverHook._save_path``).
        """
        return self._save_path

    def begin(self) -> None:
        """Find the writer and the global step; call the listeners' ``begin``.

        Raises:
            RuntimeError: ``"Global step should be created to use CheckpointSaverHook."``.

        TF name: ``tf.compat.v1.train.CheckpointSaverHook.begin``.
        """
        self._summary_writer = SummaryWriterCache.get(self._checkpoint_dir)
        self._global_step = require_global_step("CheckpointSaverHook")
        for listener in self._listeners:
            listener.begin()

    def after_create_session(self, session: Any, coord: Any) -> None:
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
        self._global_step = session_global_step(session, self._global_step)
        step = read_step(self._global_step)
        self._finish_pending()
        restored = getattr(session, "restored_checkpoint", None)
        if restored is not None and os.path.abspath(restored) == os.path.abspath(
            f"{self._save_path}-{step}"
        ):
            self._last_saved_step = step
        else:
            self._save(session, step)
        self._timer.update_last_triggered_step(step)

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """Save when the timer is due (waiting first for a save still being written).

        Requests a stop when a listener's ``after_save`` returns True.

        Raises:
            RuntimeError: As ``after_create_session``, when there is no single saver.
            CheckpointSaveError: With ``stop_on_checkpoint_error``, if a save failed.

        TF name: ``tf.compat.v1.train.CheckpointSaverHook.after_run``.
        """
        del run_values
        if self._pending is not None and self._pending.future.done():
            self._finish_pending()
        step = read_step(self._global_step)
        if self._timer.should_trigger_for_step(step):
            self._timer.update_last_triggered_step(step)
            if self._save(run_context.session, step):
                run_context.request_stop()

    def end(self, session: Any) -> None:
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
        last_step = read_step(self._global_step)
        self.final_save_failure = None
        try:
            if self._final_budget_secs is None:
                self._finish_pending()
                if last_step != self._last_saved_step:
                    self._save_sync(session, last_step)
            else:
                self._save_within(session, last_step, self._final_budget_secs)
                if last_step != self._last_saved_step:
                    self.final_save_failure = self._last_error or "it was not written"
            for listener in self._listeners:
                listener.end(session, last_step)
        finally:  # Also after a failed final save: its error event reaches the disk.
            self._get_saver().close()  # No idle writer thread outlives the session.
            if self._summary_writer is not None:
                self._summary_writer.flush()

    @property
    def last_saved_step(self) -> int | None:
        """The step of the newest checkpoint committed (or found restored) by this hook.

        TF name: none.
        """
        return self._last_saved_step

    def abandon(self, timeout_secs: float = 5.0) -> None:
        """Cancel the save in flight and close the saver, without a final checkpoint.

        For an abort (a second Ctrl-C): the save commits nothing and leaves no file; the last
        committed checkpoint stays the newest.

        Args:
            timeout_secs: Longest wait for the writer to stop, in seconds.

        TF name: none.
        """
        self._pending = None
        saver = self._get_saver()
        if saver.cancel(timeout_secs):
            saver.close()

    def set_final_save_budget(self, timeout_secs: float | None) -> None:
        """Bound the time ``end()`` spends on checkpoints, in seconds (a grace period).

        Within the budget ``end()`` waits for the save being written and writes the final
        checkpoint; a save that cannot finish in time is cancelled (``Saver.cancel``): it
        commits nothing and leaves no file, and the last committed checkpoint stays the
        newest. ``MonitoredSession`` sets its ``preemption_grace_secs`` here after a
        preemption signal.

        Args:
            timeout_secs: The budget (real time); None: no limit.

        TF name: none (TF had no preemption grace period).
        """
        self._final_budget_secs = timeout_secs

    def wait_for_save(self, timeout_secs: float | None = None) -> bool:
        """Wait until the checkpoint being written in the background (if any) is committed.

        A ``MonitoredSession`` calls it before it re-creates a session after a recoverable
        error, so that the new session restores the newest checkpoint, not an older one. The
        save's outcome is handled at the hook's next call.

        Args:
            timeout_secs: Longest wait, in seconds, for the write and again for its commit
                callback; None: no limit.

        Returns:
            True when no save is being written any more, False on timeout.

        Thread safety: call from the training thread.

        TF name: none (TF's saves were synchronous).
        """
        pending = self._pending
        if pending is None:
            return True
        done, _ = concurrent.futures.wait([pending.future], timeout=timeout_secs)
        return bool(done) and pending.committed.wait(timeout_secs)

    # ------------------------------------------------------------------------------ saving

    def _get_saver(self) -> Any:
        if self._saver is not None:
            return self._saver
        if self._scaffold is not None:
            self._saver = self._scaffold.saver
            return self._saver
        savers = get_collection(GraphKeys.SAVERS)
        if not savers:
            raise RuntimeError(
                "No items in collection savers. Please add a saver to the collection or "
                "provide a saver or scaffold."
            )
        if len(savers) > 1:
            raise RuntimeError(
                "More than one item in collection savers. Please indicate which one to use by "
                "passing it to the constructor."
            )
        self._saver = savers[0]
        return self._saver

    def _save(self, session: Any, step: int, wait: bool = True) -> bool:
        """Save at ``step``; return True if a listener asked to stop.

        Waits for the previous save first. Without listeners (or ``wait``) the new save is
        left in flight; with listeners it is waited for and ``after_save`` is called.
        """
        self._finish_pending()
        saver = self._get_saver()
        logger.info("Saving checkpoints for %d into %s.", step, self._save_path)
        for listener in self._listeners:
            listener.before_save(session, step)
        future = saver.save_async(session, self._save_path, global_step=step)
        pending = _PendingSave(future, step, session)
        self._pending = pending
        future.add_done_callback(functools.partial(self._on_done, pending))
        if not (self._listeners and wait):
            return False
        return self._finish_pending()

    def _on_done(self, pending: _PendingSave, future: concurrent.futures.Future) -> None:
        """On the writer thread: write the CHECKPOINT event, or report the failure."""
        try:
            error = future.exception()
            if error is None:
                if future.result() is not None:  # None: an empty state saved nothing.
                    self._write_checkpoint_event(pending.step)
                return
            self._report_failure(pending.step, error)
        finally:
            pending.committed.set()

    def _report_failure(self, step: int, error: BaseException) -> None:
        """Log a failed save and write it to the event file (an ERROR ``LogMessage``)."""
        self._last_error = f"{type(error).__name__}: {error}"
        logger.error("Checkpoint at step %s failed: %s", step, error)
        if self._summary_writer is not None:
            event = Event(
                step=step,
                log_message=LogMessage(
                    level=LogMessage.ERROR, message=f"Checkpoint at step {step} failed: {error}"
                ),
            )
            self._summary_writer.add_event(event)

    def _write_checkpoint_event(self, step: int) -> None:
        if self._summary_writer is not None:
            self._summary_writer.add_session_log(
                SessionLog(status=SessionLog.CHECKPOINT, checkpoint_path=self._save_path), step
            )
            # The summaries of the steps up to this checkpoint go to disk with it.
            flush = getattr(self._summary_writer, "request_flush", None)
            if flush is not None:
                flush()

    def _finish_pending(self) -> bool:
        """Wait for the save in flight (if any) and finish it on the training thread.

        Returns:
            True if a listener's ``after_save`` asked to stop.

        Raises:
            CheckpointSaveError: With ``stop_on_checkpoint_error``, if the save failed.
        """
        pending = self._pending
        if pending is None:
            return False
        error = pending.future.exception()  # Waits for the save.
        pending.committed.wait()  # The commit callback is running or has run: a short wait.
        self._pending = None
        if error is not None:
            if self._stop_on_checkpoint_error:
                raise error
            return False
        self._last_saved_step = pending.step
        self._last_error = None
        return self._after_save(pending.session, pending.step)

    def _save_within(self, session: Any, step: int, budget_secs: float) -> None:
        """Save at ``step`` (unless saved), cancelling whatever does not commit in time."""
        deadline = time.monotonic() + budget_secs

        def remaining() -> float:
            return max(0.0, deadline - time.monotonic())

        saver = self._get_saver()
        pending = self._pending
        if pending is not None:
            if self.wait_for_save(remaining()):
                self._finish_pending()
            else:
                self._pending = None
                logger.warning(
                    "The checkpoint at step %s being written did not finish in time: abandoned",
                    pending.step,
                )
                if not saver.cancel(remaining()):
                    self._last_error = f"a save stuck in a file-system call for {budget_secs:g} s"
                    logger.error(
                        "The checkpoint being written is stuck in a file-system call; no final "
                        "checkpoint within %.1f s (the last committed checkpoint is kept)",
                        budget_secs,
                    )
                    return
        if step == self._last_saved_step:
            return
        self._save(session, step, wait=False)
        if self.wait_for_save(remaining()):
            self._finish_pending()
            return
        self._pending = None
        self._last_error = f"not written within the {budget_secs:g} s grace period"
        logger.error(
            "The final checkpoint at step %s could not be written within %.1f s: abandoned "
            "(the last committed checkpoint is kept)",
            step,
            budget_secs,
        )
        saver.cancel(remaining())

    def _after_save(self, session: Any, step: int) -> bool:
        stop = False
        for listener in self._listeners:
            if listener.after_save(session, step):
                logger.info(
                    "A CheckpointSaverListener requested that training be stopped. listener: %s",
                    listener,
                )
                stop = True
        return stop

    def _save_sync(self, session: Any, step: int) -> None:
        saver = self._get_saver()
        logger.info("Saving checkpoints for %d into %s.", step, self._save_path)
        for listener in self._listeners:
            listener.before_save(session, step)
        try:
            prefix = saver.save(session, self._save_path, global_step=step)
        except CheckpointSaveError as e:
            self._report_failure(step, e)
            raise
        if prefix is not None:
            self._write_checkpoint_event(step)
        self._last_saved_step = step
        self._after_save(session, step)


class _PendingSave:
    """A save handed to the saver's writer thread, until the training thread finishes it."""

    __slots__ = ("committed", "future", "session", "step")

    def __init__(self, future: concurrent.futures.Future, step: int, session: Any) -> None:
        self.future = future
        self.step = step
        self.session = session
        self.committed = threading.Event()
        """Set once the commit callback (CHECKPOINT event, or failure report) has run."""
