"""``CheckpointDriver``: the one place that decides *when* a checkpoint is taken, and reports it.

Every front end checkpoints through one driver: the Supervisor (its timer thread asks, the
training thread snapshots at its next step boundary), ``CheckpointSaverHook`` (its schedule
runs on the training thread), and every rank of a sharded save (the ranks' agreement decides
the step, ``driver/sharded_checkpoints.py``). The driver owns:

* the skip rule: a checkpoint at the step of the last one committed (or restored) is not
  written again;
* at most one save in flight: a request that arrives while a save is being written is served
  at the first step boundary after that save ends (never lost, never blocking the caller);
* the summaries of the steps up to a checkpoint on disk before it: the summary writer is
  asked to flush when the snapshot is taken, and the save waits for it before writing;
* the report of every save: once committed, a ``SessionLog.CHECKPOINT`` event; on failure,
  one log line and an ERROR ``LogMessage`` event, then ``on_error``;
* the final checkpoint within a grace budget (``grace_budget_secs``, set after a preemption
  signal): the save in flight and the final one get what is left of the budget, measured on
  the driver's clock (``core.clock.Deadline``); a save that cannot finish in time is
  cancelled (nothing half-written; the last committed checkpoint stays the newest), even one
  stuck in a file-system call, which later waits then skip; one that cannot fit (the fastest
  save so far takes longer than the time left) is not started when another tier (the memory
  tier) holds its step already.

It decides and reports; writing is the ``Saver``'s (the commit protocol); the schedule (a
timer, steps, an agreement between ranks) is the caller's.

Thread safety: ``request`` may be called from any thread; ``start``, ``save``, ``final`` and
``abandon`` on the training thread; the report runs on the saver's writer thread.

TF name: none (TF's ``SVTimerCheckpointThread`` and ``CheckpointSaverHook`` saved themselves).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from tensorboard.compat.proto.event_pb2 import Event, LogMessage, SessionLog

from torchsupervisor.checkpoint.write_after import WRITE_AFTER_WAIT_SECS
from torchsupervisor.core import threads
from torchsupervisor.core.clock import REAL_CLOCK, Clock, Deadline
from torchsupervisor.core.global_step import read_step

if TYPE_CHECKING:
    from torchsupervisor.core.global_step import GlobalStepLike
    from torchsupervisor.core.session import SessionLike

__all__ = ["CHECKPOINT_AGE_TAG", "LAG_FACTOR", "CheckpointDriver", "EventSink", "SaverLike"]


class SaverLike(Protocol):
    """What the drivers, the session managers and the hooks use of a saver: a ``Saver``, or
    anything with these members."""

    @property
    def in_flight(self) -> bool: ...

    def save(
        self,
        sess: SessionLike | None,
        save_path: str,
        global_step: GlobalStepLike | None = None,
        *args: object,
        **kwargs: object,
    ) -> str | None: ...

    def save_async(
        self,
        sess: SessionLike | None,
        save_path: str,
        global_step: GlobalStepLike | None = None,
        *args: object,
        **kwargs: object,
    ) -> concurrent.futures.Future[str | None]: ...

    def restore(self, sess: SessionLike | None, save_path: str | None) -> None: ...

    def cancel(self, timeout_secs: float | None = None) -> bool: ...

    def close(self) -> None: ...


class EventSink(Protocol):
    """Where a driver (and the Supervisor's services) write events: a ``SummaryWriter``, or
    anything with these members."""

    def add_session_log(
        self, session_log: SessionLog, global_step: GlobalStepLike | None = None
    ) -> None: ...

    def add_summary(self, summary: object, global_step: GlobalStepLike | None = None) -> None: ...

    def add_event(self, event: Event) -> None: ...

    def flush(self) -> None: ...


LAG_FACTOR = 2.0
"""A newest checkpoint older than this many intervals is reported (``keep_up``)."""

CHECKPOINT_AGE_TAG = "torchsupervisor/checkpoint_age_secs"
"""The scalar of a checkpoint that fell behind: the newest commit's age in seconds."""

logger = logging.getLogger("torchsupervisor")


class CheckpointDriver:
    """Decide when to save, keep one save in flight, report each save (module docstring).

    Args:
        saver: The ``Saver`` (``save``, ``save_async``, ``wait``, ``cancel``, ``in_flight``).
        save_path: Prefix without step, e.g. ``logdir/model.ckpt``.
        global_step: The global step (``GlobalStep`` or integer tensor), or None.
        writer: Summary writer for the CHECKPOINT and error events; None: no events. May be
            set later (``writer`` attribute).
        clock: Time for the grace budget; None: the real clock.
        on_error: Called with the exception of a failed save after it was reported (the
            Supervisor stops training with it when asked to), before another save can start;
            requests are ignored from then on. None: training goes on.
        stop_on_error: Only changes the log line (``"...; training continues"`` without).
        last_step: The step of a checkpoint restored or known committed (it is not saved
            again); None: none.
        last_prefix: That checkpoint's prefix.

    Attributes:
        grace_budget_secs: Time budget of ``final`` in seconds, set after a preemption
            signal; None: no limit.
        last_step: The step of the newest checkpoint committed (or restored).
        last_prefix: Its prefix.
        last_error: Why the last save failed (``"<ErrorType>: <message>"``); None after a
            success.
        last_commit_time: When the newest checkpoint committed (the clock's monotonic
            seconds); None before the first commit of this driver.
        fastest_save_secs: The shortest time a save of this driver took from its snapshot
            to its commit, in seconds (what ``final`` expects a save to take at least);
            None before the first commit.

    Thread safety: see the module docstring.
    """

    def __init__(
        self,
        saver: SaverLike,
        save_path: str,
        global_step: GlobalStepLike | None = None,
        *,
        writer: EventSink | None = None,
        clock: Clock | None = None,
        on_error: Callable[[BaseException], Any] | None = None,
        stop_on_error: bool = False,
        last_step: int | None = None,
        last_prefix: str | None = None,
    ) -> None:
        self.saver = saver
        self.save_path = save_path
        self.global_step = global_step
        self.writer = writer
        self.clock = clock or REAL_CLOCK
        self.on_error = on_error
        self.stop_on_error = stop_on_error
        self.grace_budget_secs: float | None = None
        self.last_step = last_step
        self.last_prefix = last_prefix
        self.last_error: str | None = None
        self.last_commit_time: float | None = None
        self.fastest_save_secs: float | None = None
        self._began: float | None = None  # When the save in flight took its snapshot.
        self._since = self.clock.monotonic()  # Age of "no checkpoint yet" counts from here.
        self._lag_reported: float | None = None
        self._lock = threading.Lock()
        self._requested = False
        self._deferred = False
        self._idle = threading.Event()
        self._idle.set()
        self._stuck = False  # An abandoned save is stuck in a file-system call.
        self._halted = False  # A failed save stopped training: no more periodic saves.
        self._deferred_session: Any = None
        # The flush the save in flight waits for, when left for the next step boundary.
        self._flush_pending: _SummariesFlushed | None = None

    # ------------------------------------------------------------------------------ queries

    def current_step(self) -> int | None:
        """The global step now (None without one)."""
        return None if self.global_step is None else read_step(self.global_step)

    def unchanged(self, step: int | None) -> bool:
        """True if ``step`` is the step of the last checkpoint (saving it again is skipped)."""
        return step is not None and step == self.last_step

    @property
    def in_flight(self) -> bool:
        """True while a save this driver started is being written or reported."""
        return not self._idle.is_set()

    # ------------------------------------------------------------------- background saves

    def request(self, session: SessionLike) -> None:
        """Ask for a checkpoint at ``session``'s next step boundary (from any thread).

        At the boundary (the training thread) the checkpoint is skipped when the step did
        not move, and deferred while a save is in flight: it is then taken at the first
        boundary after that save ends. Requests made before it is served are one request.
        """
        with self._lock:
            self._ask(session)

    def _ask(self, session: SessionLike) -> None:
        # Under self._lock. The boundary's own lock is only ever taken inside this one.
        if not self._requested:
            self._requested = True
            session.boundary.call_soon(lambda: self._at_boundary(session))

    def _at_boundary(self, session: SessionLike) -> None:
        with self._lock:
            self._requested = False
            if self._halted:
                return
            if self.saver.in_flight or self.in_flight:
                self._deferred = True
                self._deferred_session = session
                return
        step = self.current_step()
        if not self.unchanged(step):
            self.start(session, step)

    def start(
        self, session: SessionLike, step: int | None, *, flush_at_next_boundary: bool = False
    ) -> concurrent.futures.Future | None:
        """Start a background save at ``step`` (the snapshot is taken now).

        A failure found before the copy (the directory vanished, ...) is reported like any
        failed save and None is returned. Otherwise the returned future resolves to the
        prefix (or the save's error) once written; ``wait`` returns once it is reported.

        The save writes once the summary writer has flushed what was logged up to the
        snapshot: asked for now, or with ``flush_at_next_boundary`` at ``session``'s next
        step boundary (``CheckpointSaverHook`` saves in ``after_run``, before the loop logs
        the step's summaries), or sooner if the training thread waits for the save.

        Raises:
            TypeError: For a state entry the format cannot hold (on the training thread, at
                the first save).
            LogdirLockedError: Another process writes to the directory.
        """
        logger.info("Saving checkpoint to path %s", self.save_path)
        self._idle.clear()
        self._began = self.clock.monotonic()
        flushed = self._flush_summaries()
        if flushed is not None:
            boundary = getattr(session, "boundary", None)
            if flush_at_next_boundary and boundary is not None:
                self._flush_pending = flushed
                boundary.call_soon(flushed.ask)
            else:
                flushed.ask()
        try:
            if flushed is None:
                future = self.saver.save_async(session, self.save_path, global_step=step)
            else:
                future = self.saver.save_async(
                    session, self.save_path, global_step=step, write_after=flushed
                )
        except (OSError, ValueError) as error:
            self._finished(step, None, error)
            return None
        except BaseException:
            self._idle.set()
            raise
        future.add_done_callback(lambda f: self._done(f, step))
        return future

    def _done(self, future: concurrent.futures.Future, step: int | None) -> None:
        error = future.exception()
        self._finished(step, None if error is not None else future.result(), error)

    def _finished(self, step: int | None, prefix: str | None, error: BaseException | None) -> None:
        """Report a save that ended and let the next one start (on the writer thread).

        A failure that stops training (``on_error``) is passed on before the driver is idle,
        and ends the periodic saves: a request deferred behind the failed save, or made
        while training winds down, never commits a checkpoint after the failure.
        """
        try:
            if error is None:
                self._committed(step, prefix)
            else:
                self._failed(step, error)
                if self.on_error is not None:
                    self._halted = True
                    self.on_error(error)
        finally:
            # One step under the lock: a boundary sees either a save in flight (and defers
            # again, to be re-asked here) or an idle driver whose deferred request is queued
            # already; and ``wait`` never returns between the two.
            with self._lock:
                deferred, self._deferred = self._deferred, False
                if deferred and not self._halted:
                    self._ask(self._deferred_session)
                self._idle.set()

    def _committed(self, step: int | None, prefix: str | None) -> None:
        if prefix is None:  # An empty state (allow_empty) saved nothing.
            return
        self.last_step = step
        self.last_prefix = prefix
        self.last_error = None
        self.last_commit_time = self.clock.monotonic()
        if self._began is not None:
            took = self.last_commit_time - self._began
            if self.fastest_save_secs is None or took < self.fastest_save_secs:
                self.fastest_save_secs = took
        writer = self.writer
        if writer is None or step is None:
            return
        writer.add_session_log(
            SessionLog(status=SessionLog.CHECKPOINT, checkpoint_path=self.save_path), step
        )

    def _flush_summaries(self) -> _SummariesFlushed | None:
        """The summary writer's flush that the save being started waits for (not asked yet).

        The save waits for it before it writes (``Saver.save_async``'s ``write_after``), so
        the summaries of the steps up to a checkpoint are on disk before the checkpoint is:
        a run killed after a commit resumes with every point that checkpoint stands behind
        (``summary/restarts.py``). None without a writer that can flush.
        """
        self._ask_pending_flush()
        flush = getattr(self.writer, "request_flush", None)
        return None if flush is None else _SummariesFlushed(flush)

    def _ask_pending_flush(self) -> None:
        """Ask now for a flush left for the next step boundary (the save in flight waits)."""
        pending, self._flush_pending = self._flush_pending, None
        if pending is not None:
            pending.ask()

    def _failed(self, step: int | None, error: BaseException) -> None:
        self.last_error = f"{type(error).__name__}: {error}"
        if self.stop_on_error:
            logger.error("Checkpoint at step %s failed: %s", step, error)
        else:
            logger.error("Checkpoint at step %s failed; training continues: %s", step, error)
        if self.writer is not None:
            event = Event(
                log_message=LogMessage(
                    level=LogMessage.ERROR, message=f"Checkpoint at step {step} failed: {error}"
                )
            )
            if step is not None:
                event.step = step
            self.writer.add_event(event)

    def keep_up(self, interval_secs: float) -> None:
        """Called by a schedule at each of its intervals (the Supervisor's timer thread).

        A save that falls behind its interval catches up: when the newest commit is older
        than ``interval_secs`` and a save is still being written, the writer is raised to the
        caller's CPU priority until that save ends (a busy machine leaves the idle-priority
        writer almost no CPU). When it is older than ``LAG_FACTOR`` intervals, that is
        reported: a warning (at most once per interval) and a scalar
        ``torchsupervisor/checkpoint_age_secs`` at the current step.

        Args:
            interval_secs: The schedule's interval in seconds (``save_model_secs``).

        Thread safety: may be called from any thread.
        """
        now = self.clock.monotonic()
        age = now - (self.last_commit_time if self.last_commit_time is not None else self._since)
        if age > interval_secs and (self.in_flight or self.saver.in_flight):
            threads.hurry()
        if age <= LAG_FACTOR * interval_secs:
            return
        if self._lag_reported is None or now - self._lag_reported >= interval_secs:
            self._lag_reported = now
            logger.warning(
                "The newest checkpoint is %s s old, more than %g times the interval of %g s: "
                "the machine leaves the checkpoint writer too little CPU (its saves now run at "
                "the priority of training)",
                f"{age:.0f}" if age >= 10 else f"{age:.2g}",  # Not "0 s" for short intervals.
                LAG_FACTOR,
                interval_secs,
            )
        step = self.current_step()
        add_scalar = getattr(self.writer, "add_scalar", None)
        if add_scalar is not None and step is not None:
            add_scalar(CHECKPOINT_AGE_TAG, age, step)

    # ------------------------------------------------------------------- synchronous saves

    def save(
        self, session: SessionLike, step: int | None, *, metrics: dict[str, float] | None = None
    ) -> str | None:
        """Save at ``step`` now and wait until it is committed (after the save in flight).

        Skipped (returns None) when ``step`` is the step of the last checkpoint, unless
        ``metrics`` are given: the checkpoint of that step is then written again with them
        (``Saver.save(metrics=)``, keep-best retention).

        Returns:
            The prefix, or None.

        Raises:
            CheckpointSaveError: If writing fails (after it was reported; ``on_error`` is
                not called: the caller gets the error).
        """
        self.wait()
        if metrics is None and self.unchanged(step):
            return None
        logger.info("Saving checkpoint to path %s", self.save_path)
        self._began = self.clock.monotonic()
        flushed = self._flush_summaries()
        if flushed is not None:
            flushed.ask()
            flushed.wait(WRITE_AFTER_WAIT_SECS)  # As a background save does (``start``).
        try:
            if metrics is None:
                prefix = self.saver.save(session, self.save_path, global_step=step)
            else:
                prefix = self.saver.save(session, self.save_path, global_step=step, metrics=metrics)
        except Exception as e:
            self._failed(step, e)
            raise
        self._committed(step, prefix)
        return prefix

    def final(
        self,
        session: SessionLike,
        step: int | None,
        before_save: Callable[[int | None], Any] | None = None,
        held_elsewhere: str | None = None,
    ) -> str | None:
        """Save the final checkpoint at ``step``, within ``grace_budget_secs`` if set.

        Without a budget this is ``save``. With one, the save in flight and this one share
        the budget: whatever does not commit in time is cancelled and None is returned, with
        ``last_error`` saying why (a failure is not raised either: the caller reports it).
        When another tier holds ``step`` already (``held_elsewhere``) and what is left of the
        budget is shorter than the fastest save so far (``fastest_save_secs``), the save is
        not started: the time goes to a clean exit instead (a warning says so).

        Args:
            session: The session whose state is saved.
            step: The step to save.
            before_save: Called with ``step`` just before the snapshot, if one is taken.
            held_elsewhere: What holds ``step`` already, in words (``"this node's memory
                tier"``), or None.

        Returns:
            The prefix, or None (skipped, failed or out of time).

        Raises:
            CheckpointSaveError: Without a budget, if writing fails.
        """
        if self.grace_budget_secs is None:
            self.wait()
            if self.unchanged(step):
                return None
            if before_save is not None:
                before_save(step)
            return self.save(session, step)
        budget = self.grace_budget_secs
        deadline = Deadline(self.clock, budget)
        if not self._wait(deadline):
            logger.warning("The checkpoint being written did not finish in time: abandoned")
            if not self._abandon(deadline):
                self._give_up(
                    f"a save stuck in a file-system call for {budget:g} s",
                    "The checkpoint being written is stuck in a file-system call; no final "
                    f"checkpoint within {budget:.1f} s",
                )
                return None
        if self.unchanged(step):
            return None
        expected, left = self.fastest_save_secs, deadline.remaining()
        if held_elsewhere and expected is not None and left is not None and expected > left:
            self.last_error = (
                f"not started: it takes about {expected:.1f} s and {left:.1f} s were left; "
                f"{held_elsewhere} holds step {step}"
            )
            logger.warning(
                "The final checkpoint at step %s would take about %.1f s to write (the fastest "
                "save so far) and %.1f s are left: not started; %s holds step %s",
                step,
                expected,
                left,
                held_elsewhere,
                step,
            )
            return None
        if before_save is not None:
            before_save(step)
        future = self.start(session, step)
        if future is None:
            return None
        if not self._wait(deadline):
            self._give_up(
                f"not written within the grace period: {budget:.2g} s were left",
                f"The final checkpoint at step {step} could not be written within the "
                f"{budget:.2g} s left of the grace period: abandoned",
            )
            self._abandon(deadline)
            return None
        return None if future.exception() is not None else future.result()

    def _give_up(self, error: str, message: str) -> None:
        """Record ``error`` as ``last_error`` and log ``message`` (no final checkpoint)."""
        self.last_error = error
        logger.error("%s (the last committed checkpoint is kept)", message)

    # ------------------------------------------------------------------------ waiting, ending

    def wait(self, timeout_secs: float | None = None) -> bool:
        """Wait for the save in flight, if any, and for its report.

        A save abandoned by ``final``/``abandon`` that is still stuck in a file-system call
        is not waited for.

        Args:
            timeout_secs: Longest wait, in seconds of the driver's clock; None: no limit.

        Returns:
            True if no save is in flight any more (or only an abandoned, stuck one).
        """
        return self._wait(Deadline(self.clock, timeout_secs))

    def _wait(self, deadline: Deadline) -> bool:
        self._ask_pending_flush()  # Its save would otherwise wait for the next boundary.
        if self._stuck:
            if self.in_flight:
                logger.warning("Not waiting for the abandoned checkpoint save (stuck)")
                return True
            self._stuck = False
        if self.in_flight:
            threads.hurry()  # Waited for: the save runs at this thread's CPU priority.
        return deadline.wait(self._idle)

    def abandon(self, timeout_secs: float) -> bool:
        """Cancel the save in flight (a second Ctrl-C): it commits nothing, leaves no file.

        Args:
            timeout_secs: Longest wait for the writer to stop, in seconds.

        Returns:
            True if it ended in time; otherwise later waits skip it.
        """
        return self._abandon(Deadline(self.clock, timeout_secs))

    def _abandon(self, deadline: Deadline) -> bool:
        self._ask_pending_flush()
        ended = self.saver.cancel(deadline.remaining()) and deadline.wait(self._idle)
        if not ended:
            self._stuck = True
        return ended

    def close(self) -> None:
        """Wait for the save in flight (unless stuck) and end the saver's writer thread."""
        self.wait()
        self.saver.close()


class _SummariesFlushed:
    """What a save waits for before it writes: the summary writer's flush of what was logged
    up to a step boundary (``Saver.save_async``'s ``write_after``).

    Args:
        request_flush: The writer's ``request_flush``; its result, if a ``threading.Event``,
            is what ``wait`` waits for (a writer of the user's may return nothing).

    Thread safety: ``ask`` on the training thread (once takes effect); ``wait`` on the
    saver's writer thread.
    """

    def __init__(self, request_flush: Callable[[], Any]) -> None:
        self._request_flush = request_flush
        self._lock = threading.Lock()
        self._asked = threading.Event()
        self._done: threading.Event | None = None

    def ask(self) -> None:
        """Ask the writer to flush what was logged so far (the first call only)."""
        with self._lock:
            if self._asked.is_set():
                return
            done = self._request_flush()
            self._done = done if isinstance(done, threading.Event) else None
            self._asked.set()

    def wait(self, timeout_secs: float | None = None) -> bool:
        """Wait until the flush was asked for and done; False if ``timeout_secs`` passed."""
        if not self._asked.wait(timeout_secs):
            return False
        return self._done is None or self._done.wait(timeout_secs)
