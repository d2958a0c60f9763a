"""The Supervisor's standard services: summaries, steps per second, and checkpoints.

Each service is a ``LooperThread`` on the Supervisor's coordinator, so its first run is
immediate, it runs on a fixed schedule, and its errors stop training and are re-raised by
``Supervisor.stop()``.

The checkpoint service differs from TF on purpose: its timer thread never reads the state.
It asks the training thread (through the session's ``StepBoundary``) to take a snapshot at its
next step boundary; the snapshot is then written by the saver's background writer and, once
committed, a ``SessionLog.CHECKPOINT`` event is written. A request that arrives while a save is
still being written is served at the first boundary after that save commits.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event, LogMessage, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary

from torchsupervisor.core.coordinator import Coordinator, LooperThread
from torchsupervisor.core.global_step import GlobalStep, read_step
from torchsupervisor.core.session import Session, call_op

__all__ = ["CheckpointService", "SVStepCounterThread", "SVSummaryThread", "SVTimerCheckpointThread"]

logger = logging.getLogger("torchsupervisor")

_STEP_RATE_LOGS = 10


class SVSummaryThread(LooperThread):
    """Every ``interval_secs``: evaluate the summary op and write it at the current step.

    TF name: ``tf.compat.v1.train.Supervisor``'s ``SVSummaryThread``.
    """

    def __init__(
        self,
        coord: Coordinator,
        interval_secs: float,
        sess: Session,
        summary_op: Any,
        global_step: Any,
        writer: Any,
    ) -> None:
        super().__init__(coord, interval_secs)
        self._sess = sess
        self._summary_op = summary_op
        self._global_step = global_step
        self._writer = writer

    def run_loop(self) -> None:
        summary = call_op(self._summary_op, self._sess)
        step = None if self._global_step is None else read_step(self._global_step)
        if self._writer is not None and summary is not None:
            logger.info("Recording summary at step %s.", step)
            self._writer.add_summary(summary, step)


class SVStepCounterThread(LooperThread):
    """Every ``interval_secs``: write the training speed as ``<global step name>/sec``.

    The first value, written at once when training starts, is 0.0 (nothing trained yet).

    TF name: ``tf.compat.v1.train.Supervisor``'s ``SVStepCounterThread``.
    """

    def __init__(
        self, coord: Coordinator, interval_secs: float, global_step: Any, writer: Any
    ) -> None:
        super().__init__(coord, interval_secs)
        self._global_step = global_step
        self._writer = writer
        self._clock = coord.clock
        name = global_step.name if isinstance(global_step, GlobalStep) else "global_step"
        self._tag = f"{name}/sec"
        self._last_time = 0.0
        self._last_step = 0
        self._logged = 0

    def start_loop(self) -> None:
        self._last_time = self._clock.monotonic()
        self._last_step = read_step(self._global_step)

    def run_loop(self) -> None:
        now = self._clock.monotonic()
        step = read_step(self._global_step)
        added, elapsed = step - self._last_step, now - self._last_time
        self._last_time, self._last_step = now, step
        rate = added / elapsed if elapsed > 0.0 else float("inf")
        summary = Summary(value=[Summary.Value(tag=self._tag, simple_value=rate)])
        self._writer.add_summary(summary, step)
        if self._logged < _STEP_RATE_LOGS:
            self._logged += 1
            logger.info("%s: %g", self._tag, rate)


class CheckpointService:
    """Takes checkpoints at step boundaries and writes them in the background.

    Args:
        sess: The session (its boundary runs the snapshot on the training thread).
        saver: The ``Saver``.
        save_path: Prefix without step, e.g. ``logdir/model.ckpt``.
        global_step: The global step, or None.
        writer: The summary writer for CHECKPOINT events, or None.
        on_error: Called with the exception of a failed background save, after it was
            logged and written to the event file (the Supervisor uses it to stop training when
            asked to); None: training continues.

    A checkpoint whose step equals the last committed (or restored) one is skipped: the state
    did not move, so it would only rewrite the same files.

    Thread safety: ``request`` from any thread; ``save_now`` on the training thread.
    """

    def __init__(
        self,
        sess: Session,
        saver: Any,
        save_path: str,
        global_step: Any,
        writer: Any,
        on_error: Any = None,
    ) -> None:
        self._sess = sess
        self._on_error = on_error
        self._saver = saver
        self._save_path = save_path
        self._global_step = global_step
        self._writer = writer
        self._lock = threading.Lock()
        self._requested = False
        self._deferred = False
        self._idle = threading.Event()
        self._idle.set()
        self._stuck = False  # An abandoned save is stuck in a file-system call.
        self._last_step = (
            read_step(global_step) if global_step is not None and sess.restored_checkpoint else None
        )
        self.last_prefix: str | None = sess.restored_checkpoint
        """The newest checkpoint committed (or restored) in this session; None: none yet."""
        self.last_error: str | None = None
        """Why the last save failed (None after a success): for the preemption report."""

    def _current_step(self) -> int | None:
        return None if self._global_step is None else read_step(self._global_step)

    def request(self) -> None:
        """Ask for a checkpoint at the training thread's next step boundary."""
        with self._lock:
            if self._requested:
                return
            self._requested = True
        self._sess.boundary.call_soon(self._at_boundary)

    def _at_boundary(self) -> None:
        with self._lock:
            self._requested = False
            if self._saver.in_flight or not self._idle.is_set():
                self._deferred = True
                return
        step = self._current_step()
        if step is not None and step == self._last_step:
            return
        self._start(step)

    def _start(self, step: int | None) -> concurrent.futures.Future[str | None] | None:
        """Start a background save at ``step``; None if it failed before the copy (reported)."""
        logger.info("Saving checkpoint to path %s", self._save_path)
        self._idle.clear()
        try:
            future = self._saver.save_async(self._sess, self._save_path, global_step=step)
        except (OSError, ValueError) as error:
            # Found before the copy (the directory vanished, ...): a failed save like any
            # other, reported, and training goes on unless on_error stops it.
            self._idle.set()
            self._report(error, step)
            return None
        except BaseException:
            self._idle.set()
            raise
        future.add_done_callback(lambda f: self._on_done(f, step))
        return future

    def _on_done(self, future: Any, step: int | None) -> None:
        try:
            error = future.exception()
            if error is None:
                self._committed(step, future.result())
            else:
                self._report(error, step)
        finally:
            self._idle.set()
        with self._lock:
            deferred, self._deferred = self._deferred, False
        if deferred:
            self.request()

    @property
    def last_step(self) -> int | None:
        """The step of the newest checkpoint committed (or restored) in this session."""
        return self._last_step

    def _committed(self, step: int | None, prefix: str | None = None) -> None:
        self._last_step = step
        self.last_prefix = prefix or self.last_prefix
        self.last_error = None
        if self._writer is not None and step is not None:
            self._writer.add_session_log(
                SessionLog(status=SessionLog.CHECKPOINT, checkpoint_path=self._save_path), step
            )
        if self._writer is not None:
            # The summaries of the steps up to this checkpoint go to disk with it.
            self._writer.request_flush()

    def _report(self, error: BaseException, step: int | None) -> None:
        self._failed(error, step)
        if self._on_error is not None:
            self._on_error(error)

    def _failed(self, error: BaseException, step: int | None) -> None:
        self.last_error = f"{type(error).__name__}: {error}"
        logger.error("Checkpoint at step %s failed; training continues: %s", step, error)
        if self._writer is not None:
            event = Event(
                log_message=LogMessage(
                    level=LogMessage.ERROR, message=f"Checkpoint at step {step} failed: {error}"
                )
            )
            if step is not None:
                event.step = step
            self._writer.add_event(event)

    def save_now(self, timeout_secs: float | None = None) -> str | None:
        """Save a checkpoint at the current step and wait until it is committed.

        Skipped (returns None) when the step did not move since the last checkpoint.

        Args:
            timeout_secs: A time budget (a preemption's grace period): a save in flight that
                does not finish in time, or this save, is cancelled (nothing half-written is
                left) and None is returned. None: no limit.

        Raises:
            CheckpointSaveError: If writing fails (without a time budget).
        """
        if timeout_secs is not None:
            return self._save_within(timeout_secs)
        self.wait()
        step = self._current_step()
        if step is not None and step == self._last_step:
            return None
        logger.info("Saving checkpoint to path %s", self._save_path)
        try:
            prefix = self._saver.save(self._sess, self._save_path, global_step=step)
        except Exception as e:
            self._failed(e, step)
            raise
        self._committed(step, prefix)
        return prefix

    def _save_within(self, budget_secs: float) -> str | None:
        """Save at the current step, returning within ``budget_secs`` whatever the disk does.

        Every wait is bounded by the deadline, including the waits for a cancelled save to
        end: a writer stuck in a system call (a hung fsync) is left behind, cancelled (it
        commits nothing and removes its files when the call returns), and None is returned.
        """
        deadline = time.monotonic() + budget_secs

        def remaining() -> float:
            return max(0.0, deadline - time.monotonic())

        if not (self._saver.wait(remaining()) and self._idle.wait(remaining())):
            logger.warning("The checkpoint being written did not finish in time: abandoned")
            if not self._abandon(remaining):
                self.last_error = f"a save stuck in a file-system call for {budget_secs:.1f} s"
                logger.error(
                    "The checkpoint being written is stuck in a file-system call; no final "
                    "checkpoint within %.1f s (the last committed checkpoint is kept)",
                    budget_secs,
                )
                return None
        step = self._current_step()
        if step is not None and step == self._last_step:
            return None
        future = self._start(step)
        if future is None:
            return None
        done, _ = concurrent.futures.wait([future], timeout=remaining())
        if not done:
            self.last_error = f"not written within the {budget_secs:g} s grace period"
            logger.error(
                "The final checkpoint at step %s could not be written within %.1f s: "
                "abandoned (the last committed checkpoint is kept)",
                step,
                budget_secs,
            )
            self._abandon(remaining)
            return None
        return future.result() if future.exception() is None else None

    def abandon(self, timeout_secs: float) -> bool:
        """Cancel the save in flight (a second Ctrl-C): it commits nothing, leaves no file.

        Args:
            timeout_secs: Longest wait for the writer to stop, in seconds.

        Returns:
            True if it ended in time; otherwise later waits skip it.
        """
        deadline = time.monotonic() + timeout_secs
        return self._abandon(lambda: max(0.0, deadline - time.monotonic()))

    def _abandon(self, remaining: Any) -> bool:
        """Cancel the save in flight; wait for it to end until the deadline at the latest.

        Returns:
            True if it ended (its CHECKPOINT event or error reported), False if it is still
            stuck; later waits of this service then do not wait for it.
        """
        ended = self._saver.cancel(remaining()) and self._idle.wait(remaining())
        if not ended:
            self._stuck = True
        return ended

    def wait(self, timeout_secs: float | None = None) -> bool:
        """Wait for the save being written, if any, and for its CHECKPOINT event.

        A save abandoned by ``save_now(timeout_secs=...)`` that is still stuck in a
        file-system call is not waited for.

        Args:
            timeout_secs: Longest wait, in seconds; None: no limit.

        Returns:
            True if no save is in flight any more (or only an abandoned, stuck one).
        """
        if self._stuck:
            if self._saver.in_flight or not self._idle.is_set():
                logger.warning("Not waiting for the abandoned checkpoint save (stuck)")
                return True
            self._stuck = False
        deadline = None if timeout_secs is None else time.monotonic() + timeout_secs

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        return self._saver.wait(left()) and self._idle.wait(left())


class SVTimerCheckpointThread(LooperThread):
    """Every ``interval_secs``: request a checkpoint from the ``CheckpointService``.

    TF name: ``tf.compat.v1.train.Supervisor``'s ``SVTimerCheckpointThread``.
    """

    def __init__(self, coord: Coordinator, interval_secs: float, service: CheckpointService):
        super().__init__(coord, interval_secs)
        self._service = service

    def run_loop(self) -> None:
        self._service.request()
