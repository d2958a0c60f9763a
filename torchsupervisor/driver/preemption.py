"""Preemption signals: a scheduler's "please stop" turned into a clean stop at the next step.

Schedulers (SLURM, Kubernetes, spot instances) stop a job with a signal (SIGTERM, SIGUSR1)
and a short grace period before SIGKILL. ``PreemptionHandler`` installs handlers that only
record the signal: a Python signal handler runs between two bytecodes of the main thread,
possibly in the middle of the training step or while a lock is held, so it must not take locks,
log, or touch the state. The training loop notices the request at its next
``should_stop()``; the Supervisor then stops cleanly and writes a final checkpoint.

Data-loading worker processes must ignore these signals. Schedulers signal the whole process
group (SLURM, ``kill -TERM -<pgid>``; Ctrl-C signals the terminal's foreground group), and a
``DataLoader`` worker dies of SIGTERM by default: the main process then fails with "DataLoader
worker (pid ...) exited unexpectedly" instead of stopping cleanly, or hangs for ever when a
worker dies holding the lock of the DataLoader's shared "workers done" event. The main process
owns the shutdown: it stops at the next step, writes the final checkpoint, and ends its workers
itself (and a worker whose main process died exits by itself, through the DataLoader's
watchdog). ``ResumableDataLoader`` makes its workers ignore them; for a plain ``DataLoader`` or
a ``torchdata`` ``StatefulDataLoader``, pass ``worker_init_fn=IgnorePreemptionSignals()`` (or
``IgnorePreemptionSignals(your_worker_init_fn)``). The workers ignore SIGTERM, SIGUSR1 and
SIGINT (``WORKER_IGNORED_SIGNALS``) whatever the main process's ``preemption_signals``: a signal
that is not a preemption signal there (Ctrl-C by default) interrupts the main process, which
then shuts its workers down itself, so ignoring it in the workers loses nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torchsupervisor.core.checks import check_signals
from torchsupervisor.core.clock import REAL_CLOCK, Clock, Deadline
from torchsupervisor.driver.preemption_sources import (
    PreemptionNotice,
    PreemptionSource,
    PreemptionWatcher,
)
from torchsupervisor.driver.requeue import SlurmRequeue

__all__ = [
    "ABORT_SIGNALS",
    "DEFAULT_PREEMPTION_SIGNALS",
    "EXIT_MARGIN_SECS",
    "WORKER_IGNORED_SIGNALS",
    "IgnorePreemptionSignals",
    "Preemption",
    "PreemptionHandler",
    "final_checkpoint_failed",
]

logger = logging.getLogger("torchsupervisor")

DEFAULT_PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = tuple(
    s
    for s in (
        getattr(signal, "SIGTERM", None),
        getattr(signal, "SIGUSR1", None),
        getattr(signal, "SIGINT", None),
    )
    if s
)
"""SIGTERM and SIGUSR1 (schedulers) and SIGINT (Ctrl-C): each asks for a graceful stop."""

ABORT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT,)
"""Signals whose second delivery aborts at once (a second Ctrl-C): ``KeyboardInterrupt``."""

# The default preemption signals, Ctrl-C's SIGINT among them (see the module docstring).
WORKER_IGNORED_SIGNALS: tuple[signal.Signals, ...] = tuple(
    dict.fromkeys((*DEFAULT_PREEMPTION_SIGNALS, signal.SIGINT))
)

EXIT_MARGIN_SECS = 2.0
"""What a notice with a deadline leaves the process to exit after its final checkpoint."""

_ABORT_LINE = (
    b"\nSecond interrupt: aborting now. A checkpoint being written is abandoned; the last "
    b"committed one is kept.\n"
)


class PreemptionHandler:
    """Records the first preemption signal received while installed.

    Args:
        signals: The signals to catch (e.g. ``(signal.SIGTERM, signal.SIGUSR1)``; add
            ``signal.SIGINT`` to treat Ctrl-C the same way). Empty: catch nothing.

    Attributes:
        received: The first signal number received, or None.
        count: How many signals were received (a second SIGTERM changes nothing: the stop and
            the final checkpoint are already under way).
        aborted: True once a second abort signal (``ABORT_SIGNALS``: a second Ctrl-C) was
            received: the handler then wrote one line to stderr and raised
            ``KeyboardInterrupt`` on the main thread, to abort at once.
        on_signal: Called by the handler at the first signal, after ``received`` is set;
            it runs inside the signal handler, so it may only assign (``StepBoundary.poke``).
            None: nothing.

    Thread safety: ``install``/``uninstall`` only work on the main thread (Python delivers
    signals there); elsewhere they log and do nothing. ``received`` may be read anywhere.

    TF name: none (TF did not handle preemption signals).
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_PREEMPTION_SIGNALS) -> None:
        self._signals = check_signals("signals", signals)
        self._previous: dict[signal.Signals, Any] = {}
        self.received: int | None = None
        self.count = 0
        self.aborted = False
        self.on_signal: Callable[[], None] | None = None

    @property
    def signals(self) -> tuple[signal.Signals, ...]:
        """The signals this handler catches."""
        return self._signals

    def _handle(self, signum: int, frame: Any) -> None:
        # Only plain assignments: no locks, no logging, no allocation-heavy work. A second
        # Ctrl-C aborts: one line straight to stderr (os.write takes no lock), then the
        # KeyboardInterrupt Python would have raised at the first.
        if self.received is not None and signum in ABORT_SIGNALS:
            self.aborted = True
            try:
                os.write(2, _ABORT_LINE)
            except OSError:
                pass
            raise KeyboardInterrupt
        if self.received is None:
            self.received = signum
            on_signal = self.on_signal
            if on_signal is not None:
                on_signal()
        self.count += 1

    def install(self) -> None:
        """Install the handlers (remembering the previous ones); clears ``received``."""
        self.received = None
        self.count = 0
        self.aborted = False
        if not self._signals or self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "Preemption signals %s are not handled: the session was not started on the "
                "main thread",
                [s.name for s in self._signals],
            )
            return
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Restore the handlers that were there before ``install``."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def describe(self) -> str:
        """Return the name of the signal received (``"SIGTERM"``), or ``""``."""
        if self.received is None:
            return ""
        try:
            return signal.Signals(self.received).name
        except ValueError:
            return str(self.received)


class Preemption:
    """What a front end does about preemptions; the Supervisor and MonitoredSession each
    hold one.

    While a session runs (``install``/``uninstall``) the handler records the first signal,
    and a ``PreemptionWatcher`` polls the ``sources`` (``preemption_sources.py``: SLURM's
    time limit, a cloud's notice) on its own thread, recording the first notice due. The
    front end's ``should_stop()`` calls ``notice``, which tells it to stop the first time,
    and ``report`` once it stops (with replicas, at the step every rank agreed on), which
    logs one line naming the source and the seconds left; the final checkpoint then gets
    ``budget()`` seconds (``CheckpointDriver.grace_budget_secs``): ``grace_secs`` after a
    signal or a notice without a deadline, else the time until the notice's deadline less
    ``EXIT_MARGIN_SECS``. After the stop, ``outcome`` says whether work was lost (the exit
    to raise: a stop that loses work never exits with status 0), and ``exit`` requeues a
    SLURM job whose time ran out (``requeue.py``; rank 0) and raises ``SystemExit(exit_code)``
    for schedulers that requeue on a status.

    Args:
        signals: The signals that mean "stop and save"; empty: keep the current handlers.
        grace_secs: Time budget of the final checkpoint after a signal, in seconds; also how
            long before a scheduled end (a time limit) the run stops.
        exit_code: ``SystemExit`` code after a preemption stop; None: return normally.
        sources: What else may announce a stop (``check_sources``); empty: signals only.
        requeue: Requeues the job after a stop it wants (``SlurmRequeue``); None: never.

    Thread safety: as ``PreemptionHandler``; ``notice`` on the training thread.

    TF name: none (TF did not handle preemption signals).
    """

    def __init__(
        self,
        signals: Iterable[int],
        grace_secs: float,
        exit_code: int | None = None,
        *,
        sources: Sequence[PreemptionSource] = (),
        requeue: SlurmRequeue | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.handler = PreemptionHandler(signals)
        self.grace_secs = grace_secs
        self.exit_code = exit_code
        self.sources = tuple(sources)
        self.requeue = requeue
        self.requeued = False
        """Whether ``exit`` requeued the job."""
        self._clock = clock or REAL_CLOCK
        self._noticed = False
        self._reported = False
        self._deadline: Deadline | None = None
        self._notice: PreemptionNotice | None = None
        self._watcher: PreemptionWatcher | None = None

    @property
    def received(self) -> int | None:
        """The first signal received while installed, or None."""
        return self.handler.received

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for while installed: a signal, or a notice due."""
        return self.handler.received is not None or self._notice is not None

    @property
    def announced(self) -> PreemptionNotice | None:
        """The notice that asked for the stop (when no signal came first), or None."""
        return self._notice if self.handler.received is None else None

    @property
    def aborted(self) -> bool:
        """True once a second Ctrl-C aborted (``KeyboardInterrupt`` was raised)."""
        return self.handler.aborted

    def describe(self) -> str:
        """What asked for the stop: the signal's name (``"SIGTERM"``), a notice's source
        (``"SLURM time limit"``), or ``""``."""
        notice = self.announced
        return notice.source if notice is not None else self.handler.describe()

    def install(self) -> None:
        """Install the handlers (main thread only), start polling the sources, and forget an
        earlier signal or notice."""
        self.handler.install()
        self._noticed = False
        self._reported = False
        self._deadline = None
        self._notice = None
        if self.sources and self._watcher is None:
            self._watcher = PreemptionWatcher(
                self.sources, self.grace_secs, self._announce, self._clock
            )
            self._watcher.start()

    def uninstall(self) -> None:
        """Restore the handlers that were there before ``install``; stop polling."""
        self.handler.uninstall()
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()

    def _announce(self, notice: PreemptionNotice) -> None:
        # On the watcher's thread: record, then wake the step boundary as a signal does.
        self._notice = notice
        on_signal = self.handler.on_signal
        if on_signal is not None:
            on_signal()

    def _seconds_left(self) -> float | None:
        """Seconds until the announcing notice's deadline; None: no deadline (or a signal)."""
        notice = self.announced
        if notice is None or notice.deadline is None:
            return None
        return notice.deadline - self._clock.time()

    def notice(self) -> bool:
        """Return True the first time a signal or a notice is seen (the front end stops)."""
        if not self.requested or self._noticed:
            return False
        self._noticed = True
        left = self._seconds_left()
        budget = self.grace_secs if left is None else max(0.0, left - EXIT_MARGIN_SECS)
        self._deadline = Deadline(self._clock, budget)
        return True

    @property
    def deadline(self) -> Deadline | None:
        """The end of the grace period, counted from when training noticed the signal: every
        part of the stop (the final checkpoint, the last events, the logdir's lock) shares it.
        None before a signal was noticed."""
        return self._deadline

    def report(self, step: int | None, *, saving: bool) -> None:
        """Log, once, the signal and the step training stops at.

        Args:
            step: The step training stops at (None without a global step): with replicas,
                the one every rank agreed on, so every rank logs the same.
            saving: Whether a final checkpoint will be written (said in the line).
        """
        if not self.requested or self._reported:
            return
        self._reported = True
        notice = self.announced
        if notice is not None:
            left = self._seconds_left()
            logger.warning(
                "Preemption notice from %s (%s; %s): stopping at step %s%s",
                notice.source,
                notice.detail or "no detail",
                "time left unknown" if left is None else f"{left:.0f} s left",
                step,
                " with a final checkpoint" if saving else "",
            )
            return
        logger.warning(
            "Received %s: stopping at step %s%s%s",
            self.describe(),
            step,
            " with a final checkpoint" if saving else "",
            " (press Ctrl-C again to abort at once)"
            if self.handler.received in ABORT_SIGNALS
            else "",
        )

    def budget(self) -> float | None:
        """The final checkpoint's time budget in seconds after a signal: what is left of the
        grace period (``grace_secs`` until training noticed the signal); None without one."""
        if not self.requested:
            return None
        if self._deadline is None:
            left = self._seconds_left()
            return self.grace_secs if left is None else max(0.0, left - EXIT_MARGIN_SECS)
        return self._deadline.remaining()

    def outcome(
        self, step: int | None, driver: Any, memory_step: int | None = None
    ) -> SystemExit | None:
        """After a clean stop by a signal: the exit to raise if the final checkpoint is missing.

        Args:
            step: The step training stopped at.
            driver: The ``CheckpointDriver`` that wrote the final checkpoint (its
                ``last_step``, ``last_prefix``, ``last_error``); None: no checkpoints.
            memory_step: The step of the memory tier's newest snapshot on this node, if any
                (said in the line: a restart here resumes from it).

        Returns:
            None when no signal stopped the run, there are no checkpoints, or the newest
            checkpoint is at ``step``; else the ``SystemExit`` of ``final_checkpoint_failed``
            (its line is logged).
        """
        name = self.describe()
        if not name or driver is None or step is None or driver.last_step == step:
            return None
        reason = driver.last_error or "it was not written"
        return final_checkpoint_failed(
            name, step, driver.last_step, driver.last_prefix, reason, self.exit_code, memory_step
        )

    def exit(self) -> None:
        """After a preemption stop, once everything is saved and closed: requeue the job if
        ``requeue`` wants this stop (on rank 0 only), then raise ``SystemExit(exit_code)`` if
        an exit code is set.

        Raises:
            SystemExit: ``exit_code``, after a preemption stop.
        """
        if not self.requested:
            return
        if self.requeue is not None and self.requeue.wants(self.received, self.announced):
            from torchsupervisor.distributed.env import rank

            if rank() == 0:
                self.requeued = self.requeue.requeue()
        if self.exit_code is not None:
            raise SystemExit(self.exit_code)


class IgnorePreemptionSignals:
    """Make a data-loading worker ignore the preemption signals, then run ``worker_init_fn``.

    A ``worker_init_fn`` for ``torch.utils.data.DataLoader`` (and torchdata's
    ``StatefulDataLoader``), so that a signal sent to the whole process group stops the
    training cleanly instead of killing the workers (see the module docstring)::

        DataLoader(dataset, num_workers=4, worker_init_fn=IgnorePreemptionSignals())
        DataLoader(dataset, num_workers=4, worker_init_fn=IgnorePreemptionSignals(my_init))

    ``ResumableDataLoader`` does this by itself. The signals are ignored (``SIG_IGN``, which
    processes the worker starts inherit) and unblocked (``ResumableDataLoader`` starts its
    workers with them blocked, so that none is lost or fatal before this runs), before
    ``worker_init_fn`` is called, which may install other handlers. Picklable when
    ``worker_init_fn`` is (the "spawn" and "forkserver" start methods need that).

    A worker ignoring SIGTERM is not ended by the ``terminate()`` a DataLoader uses as a last
    resort for a worker that did not exit within 5 s of being told to; it exits when its
    main process has ended (the DataLoader's watchdog), or with SIGKILL.

    Args:
        worker_init_fn: Called with the worker id afterwards; None: nothing else to do.
        signals: The signals to ignore (default ``WORKER_IGNORED_SIGNALS``: SIGTERM, SIGUSR1,
            SIGINT). Add any other signal given to ``preemption_signals``.

    Thread safety: called by the DataLoader in the worker process, on its main thread.

    TF name: none (TF's input pipelines ran as threads of the training process).
    """

    def __init__(
        self,
        worker_init_fn: Callable[[int], Any] | None = None,
        signals: Iterable[int] = WORKER_IGNORED_SIGNALS,
    ) -> None:
        if worker_init_fn is not None and not callable(worker_init_fn):
            raise TypeError(f"worker_init_fn must be callable or None, got {worker_init_fn!r}")
        self.worker_init_fn = worker_init_fn
        self.signals = check_signals("signals", signals)

    def __call__(self, worker_id: int) -> None:
        """Ignore and unblock the signals, then call ``worker_init_fn(worker_id)``."""
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        if self.signals and hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self.signals)
        return f"IgnorePreemptionSignals({self.worker_init_fn!r}, signals=({names}))"


def final_checkpoint_failed(
    signal_name: str,
    step: int | None,
    committed_step: int | None,
    committed_prefix: str | None,
    reason: str,
    exit_code: int | None,
    memory_step: int | None = None,
) -> SystemExit:
    """Log, on one line, that a preemption's final checkpoint failed; return the exit to raise.

    A stop asked for by a signal must not end with status 0 when work is lost: the
    scheduler (or the user) must see it. The line names the step the run stopped at, why the
    final checkpoint failed, and the last committed checkpoint a restart resumes from.

    Args:
        signal_name: ``"SIGTERM"``, ``"SIGINT"``, ...
        step: The step training stopped at (None: no global step).
        committed_step: The step of the last committed (or restored) checkpoint; None: none.
        committed_prefix: Its prefix, if known.
        reason: Why the final checkpoint failed (the save's error, or the budget exceeded).
        exit_code: The run's ``preemption_exit_code``; the status is that code when it is
            non-zero, else 1.
        memory_step: The step the memory tier of this node holds, if any: a restart on this
            node resumes there (said in the line); another node does not have it.

    Returns:
        The ``SystemExit`` for the caller to raise once everything is closed.

    TF name: none (TF did not handle preemption signals).
    """
    if committed_step is None and committed_prefix is None:
        last = "no checkpoint was committed: a restart starts from the beginning"
    else:
        where = f" ({committed_prefix})" if committed_prefix else ""
        last = f"the last committed checkpoint is step {committed_step}{where}"
        if step is not None and committed_step is not None and step > committed_step:
            lost = step - committed_step
            last += f"; {lost} step{'' if lost == 1 else 's'} will be redone"
    if memory_step is not None:
        last += (
            f" (this node's memory tier holds step {memory_step}: a restart on this node "
            "resumes there)"
        )
    logger.error(
        "Stopped by %s at step %s but the final checkpoint failed (%s); %s",
        signal_name,
        step,
        reason,
        last,
    )
    return SystemExit(exit_code or 1)
