"""A Supervisor session's life: the chief takes its logdir, the stop is decided, the final
checkpoint saved, how the session ended recorded, the logdir released.

``managed_session`` and ``prepare_or_wait_for_session`` + ``stop()`` share one path:

1. The chief takes the logdir's writer lock (one writer per logdir) and removes the record of
   the last session's end: until this one ends there is none, so a kill leaves none
   (``open_logdir``).
2. A preemption signal only records itself (``driver/preemption.py``) and pokes the step
   boundary. ``should_stop()`` (``stop_decision``) turns True at the next step, with replicas
   at the step every rank agreed on; every rank then logs that step once. A loop that never
   asks ``should_stop()`` is stopped at its next ``sess.run`` instead (``stop_at_run``, the
   boundary's watcher).
3. The final checkpoint: ``managed_session`` saves it when its block ends cleanly; a session
   prepared outside it saves it where ``should_stop()`` decided a preemption stop, or in
   ``stop()`` for a clean stop (``finish``, ``end_unmanaged``).
4. ``stop()`` (``release_session``): the chief records how the session ended (the STOP
   event's message and ``<logdir>/last_stop.json``, ``driver/stop_record.py``, which a
   requeue script reads), closes the writer and releases the lock.
5. Every rank's goodput ledger (``driver/goodput.py``) records the start, the session's
   restore and the stop (``begin_goodput``, ``goodput_ready``, ``release_session``).

These are the Supervisor's own steps, kept out of the facade; they read its private state.

TF name: none (TF's Supervisor handled no signal and saved no final checkpoint).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tensorboard.compat.proto.event_pb2 import SessionLog

from torchsupervisor import errors
from torchsupervisor.core.clock import Deadline
from torchsupervisor.distributed import env as distributed
from torchsupervisor.driver.goodput import open_recorder
from torchsupervisor.driver.stop_record import (
    END,
    ERROR,
    PREEMPTION,
    clear_stop_record,
    write_stop_record,
)
from torchsupervisor.errors import LogdirLockedError, OutOfRangeError
from torchsupervisor.storage import storage_for
from torchsupervisor.summary.writer import SummaryWriter
from torchsupervisor.supervisor.modes import Mode, agreed_stop

if TYPE_CHECKING:
    from torchsupervisor.core.session import Session
    from torchsupervisor.supervisor.supervisor import Supervisor

__all__ = [
    "begin_goodput",
    "end_unmanaged",
    "finish",
    "goodput_ready",
    "open_logdir",
    "record_end",
    "release_session",
    "stop_at_run",
    "stop_decision",
]

logger = logging.getLogger("torchsupervisor")


def open_logdir(sv: Supervisor) -> None:
    """The chief takes its logdir's writer lock and removes the last session's stop record.

    Raises:
        LogdirLockedError: Another process writes to the logdir (``stop()`` then writes
            nothing into it).
    """
    logdir = sv._settings.logdir
    if not sv._settings.is_chief or not logdir or sv._logdir_lock is not None:
        return
    storage = storage_for(logdir)
    storage.makedirs(logdir)
    try:
        sv._logdir_lock = storage.lock(logdir)  # One writer per logdir.
    except LogdirLockedError:
        sv._lock_refused = True
        raise
    # Another writer took it over (an object store's lease): stop training with its error.
    sv._logdir_lock.on_lost(lambda e: sv._coord.request_stop((type(e), e, e.__traceback__)))
    try:  # Until this session ends there is no record: a kill leaves none.
        clear_stop_record(storage, logdir)
    except (OSError, errors.OpError) as e:
        logger.warning("Could not remove %s's stop record: %s", logdir, e)


def begin_goodput(sv: Supervisor) -> float:
    """The ledger's start record (the first session of this process); return the time
    preparing the session begins (wall seconds)."""
    st = sv._settings
    logdir = st.logdir or st.replica_logdir
    # The chief, and the other ranks of a distributed run; not a process that only reads the
    # run (an evaluator: not the chief, alone), whose rank 0 would be the chief's.
    writes = st.is_chief or distributed.world_size() > 1
    if sv._goodput is None and st.goodput_ledger and logdir and writes:
        sv._goodput = open_recorder(logdir, clock=st.clock)
    return st.clock.time()


def goodput_ready(sv: Supervisor, sess: Session, started: float) -> None:
    """The ledger's record of the session just prepared (its restore, the step it resumed at)."""
    recorder = sv._goodput
    if recorder is None:
        return
    st = sv._settings
    if st.is_chief and st.summary_writer is not None:
        recorder.summary_writer = st.summary_writer
    recorder.session_ready(started, sess, sv._context.current_step(), st.global_step)


def _finish_goodput(sv: Supervisor, end: str, deadline: Deadline) -> None:
    """The ledger's end, within ``deadline`` (an object store that does not answer is left
    behind: the ledger never holds up a stop)."""
    recorder, sv._goodput = sv._goodput, None
    since, sv._stopping_since = sv._stopping_since, None
    if recorder is None:
        return
    reason = end.split(":", 1)[0]  # "preemption", "end" or "error".
    step = sv._context.current_step()
    if not deadline.call(
        lambda: recorder.finish(step, reason, since), "torchsupervisor-goodput-finish"
    ):
        recorder.abandon()
        logger.warning("The goodput ledger's last records were not written within the grace period")


def stop_decision(sv: Supervisor) -> bool:
    """Whether to stop now (``should_stop`` without its step boundary).

    After a preemption signal, once the stop is decided (with replicas, at the step every
    rank agreed on): the signal and the step are logged once, and a session prepared
    outside ``managed_session`` saves its final checkpoint here, at this step boundary.
    """
    preemption = sv._preemption
    if preemption.requested and preemption.notice():
        sv._coord.request_stop()
    mode = sv._mode
    if mode is None or mode.agreement is None:
        stop = sv._coord.should_stop()
    else:
        stop = agreed_stop(sv._context, mode.agreement)
        if stop and mode.agreement.agreed_step is not None:
            mode.at_agreed_stop()  # Every rank, at the same step: for the final checkpoint.
    if stop and preemption.requested:
        preemption.report(
            sv._context.current_step(), saving=mode is not None and mode.driver is not None
        )
        if sv._unmanaged:
            finish(sv, clean=True)
    return stop


def stop_at_run(sv: Supervisor) -> None:
    """The step boundary's watcher: after a preemption signal, a loop that never asks
    ``should_stop()`` stops at its ``sess.run`` (with replicas, at the agreed step).

    In ``managed_session`` it raises ``OutOfRangeError``, which ends the block as a clean
    stop (the final checkpoint follows); outside, the session is stopped (the final
    checkpoint, the services) and ``SystemExit`` raised.
    """
    sess = sv._sess
    if not sv._preemption.requested or sess is None or sv._asked:
        return
    if not stop_decision(sv):
        sess.boundary.poke()  # The agreed step is not reached yet: look again.
        return
    message = (
        f"Stopped by {sv._preemption.describe()} at step {sv._context.current_step()} (the loop "
        "does not call should_stop())"
    )
    if not sv._unmanaged:
        raise OutOfRangeError(None, None, message)
    sv.stop()  # Raises SystemExit after a failed final checkpoint, or with an exit code.
    raise SystemExit(0)


def record_end(
    sv: Supervisor, ending: tuple[bool, BaseException | None] | None, deadline: Deadline
) -> str:
    """Record how the session ended (the chief, in its logdir: ``driver/stop_record.py``),
    before ``deadline``; return it as the STOP event's message (``"preemption: SIGTERM"``,
    ``"end"``, ``"error: <ErrorType>: <message>"``)."""
    clean, failure = ending if ending is not None else (True, None)
    if failure is None:
        try:
            sv._coord.raise_requested_exception()
        except BaseException as e:  # A thread's error: the session failed.
            clean, failure = isinstance(e, sv._coord.clean_stop_exception_types), e
    error = None
    if not clean:
        error = "unknown" if failure is None else f"{type(failure).__name__}: {failure}"
        reason, message = ERROR, f"error: {error}"
    elif sv._preemption.requested:
        reason, message = PREEMPTION, f"preemption: {sv._preemption.describe()}"
    else:
        reason, message = END, "end"
    logdir = sv._settings.logdir
    if not sv._settings.is_chief or not logdir or sv._lock_refused:
        return message
    step, checkpoint = sv._context.current_step(), _newest_checkpoint(sv._mode)

    def write() -> None:
        try:
            write_stop_record(
                storage_for(logdir),
                logdir,
                reason=reason,
                signal=sv._preemption.describe() or None,
                step=step,
                checkpoint=checkpoint,
                error=error,
                wall_time=sv._settings.clock.time(),
            )
        except (OSError, errors.OpError) as e:
            logger.warning("Could not record how the session ended in %s: %s", logdir, e)

    if not deadline.call(write, "torchsupervisor-stop-record"):
        logger.warning(
            "How the session ended was not recorded in %s within the grace period", logdir
        )
    return message


def _newest_checkpoint(mode: Mode | None) -> str | None:
    """The prefix of the newest checkpoint the session committed or restored, if any."""
    driver = None if mode is None else mode.driver  # A sharded mode's is its service's.
    return None if driver is None else driver.last_prefix


def finish(sv: Supervisor, clean: bool) -> None:
    """End a session prepared outside ``managed_session``, once: tell the replicas, save
    the final checkpoint of a clean stop; keep the error ``stop`` raises at the end."""
    if sv._finished or sv._mode is None:
        return
    sv._finished = True
    sv._mode.end_agreement(clean, None)
    sv._final_error = sv._mode.finish(clean)


def end_unmanaged(
    sv: Supervisor, propagating: BaseException | None
) -> tuple[tuple[bool, BaseException | None], BaseException | None]:
    """``stop()`` of a session prepared outside ``managed_session``: its final checkpoint,
    unless ``stop`` is called while an exception propagates (``propagating``: the state may
    be in the middle of a step).

    Returns:
        ``(clean, failure)`` of the session, and the error ``stop`` raises at its end.
    """
    clean = propagating is None or isinstance(propagating, sv._coord.clean_stop_exception_types)
    finish(sv, clean)
    final_error, sv._final_error = sv._final_error, None
    return (clean, None if clean else propagating), final_error


def release_session(
    sv: Supervisor,
    ending: tuple[bool, BaseException | None] | None,
    unmanaged: bool,
    close_summary_writer: bool,
) -> None:
    """The end of ``stop()``: the handlers and checkpoints of the session, the record of how
    it ended and the STOP event, the writer, the logdir's lock.

    After a preemption signal each of these gets what is left of the grace period (the
    final checkpoint had its share before): what cannot finish in time (a store that does not
    answer) is abandoned with a line naming it, so the process exits within the period."""
    if unmanaged:
        sv._unmanaged = False
        sv._preemption.uninstall()
    if sv._mode is not None:
        sv._mode.stop(aborted=sv._preemption.aborted, clean=ending is None or ending[0])
    deadline = sv._preemption.deadline or Deadline(sv._settings.clock, None)
    end = record_end(sv, ending, deadline)
    _finish_goodput(sv, end, deadline)
    writer = sv._settings.summary_writer
    if close_summary_writer and writer is not None:
        if not sv._lock_refused:  # Another process's logdir: not a word in it.
            writer.add_session_log(SessionLog(status=SessionLog.STOP, msg=end))
        if isinstance(writer, SummaryWriter):
            writer.close(timeout_secs=deadline.remaining())
        else:  # A writer of the user's, with TF's close().
            writer.close()
    lock, sv._logdir_lock = sv._logdir_lock, None
    if lock is not None:
        if sv._settings.saver is not None and not sv._settings.saver.in_flight:
            sv._settings.saver.close()  # Its handles on the lock.
        if not deadline.call(lock.release, "torchsupervisor-release-lock"):
            logger.warning(
                "The writer lock of %s was not released within the grace period: it expires "
                "by itself",
                sv._settings.logdir,
            )
