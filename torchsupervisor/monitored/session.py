"""``MonitoredSession`` and ``MonitoredTrainingSession``: a session with hooks and recovery.

The successor of the Supervisor in TF 1. Typical use::

    with MonitoredTrainingSession(checkpoint_dir="runs/exp",
                                  state={"model": model, "optimizer": opt, "global_step": step},
                                  hooks=[StopAtStepHook(last_step=10_000),
                                         NanTensorHook("loss")]) as sess:
        while not sess.should_stop():
            sess.run(train_step)          # train_step returns {"loss": loss}

What a ``MonitoredSession`` does, in order:

1. Install the preemption signal handlers (SIGTERM, SIGUSR1 by default; main thread only).
2. ``begin()`` of every hook.
3. Create the session (``session_creator.create_session()``: restore the newest valid
   checkpoint, or initialize), a new ``Coordinator`` for it, start the queue runners of the
   ``QUEUE_RUNNERS`` collection, then ``after_create_session(session, coord)`` of every hook.
4. ``run(fetches, feed_dict)``: every hook's ``before_run``, the run (the caller's fetches,
   then the hooks'), every hook's ``after_run``; the caller's results are returned. An
   ``AbortedError`` or ``UnavailableError`` closes the session, waits for the checkpoint
   being written, creates a new one (step 3 without ``begin``: the newest checkpoint is
   restored) and retries the same run.
5. ``should_stop()``: True once a hook or ``request_stop()`` asked for it, a thread reported
   an error, or a preemption signal was received.
6. ``close()`` or leaving the ``with`` block normally, or by ``OutOfRangeError`` or
   ``StopIteration`` (end of input; suppressed): ``end(session)`` of every hook (the final
   checkpoint), then stop the coordinator, join its threads, close the session, restore the
   signal handlers. Leaving by any other exception skips ``end()``; the exception propagates
   (or one raised by a thread, which replaces it).

Where it differs from TF: there is no graph to finalize (``graph`` is the collections registry);
``request_stop()`` is added as the seam for stop requests from outside the loop; preemption
signals stop training cleanly (SPEC section 4); a recovery keeps the in-memory state when there
is no checkpoint to restore (see ``MonitoredSession``).

TF names: ``tf.compat.v1.train.MonitoredSession``, ``SingularMonitoredSession``,
``MonitoredTrainingSession``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from torchsupervisor.core.checks import (
    check_duck,
    check_int,
    check_iterable,
    check_number,
    check_signals,
)
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.global_step import get_global_step, read_step
from torchsupervisor.core.registry import Graph, get_default_graph
from torchsupervisor.core.session import Session
from torchsupervisor.driver.goodput import GoodputRecorder, badput_interval, open_recorder
from torchsupervisor.driver.preemption import DEFAULT_PREEMPTION_SIGNALS, Preemption
from torchsupervisor.driver.preemption_sources import PreemptionSource, check_sources
from torchsupervisor.driver.requeue import SlurmRequeue, check_requeue
from torchsupervisor.errors import OutOfRangeError
from torchsupervisor.hooks._global_step import session_global_step
from torchsupervisor.hooks.session_run_hook import SessionRunHook, checkpoint_drivers
from torchsupervisor.monitored.coordinated_creator import CoordinatedSessionCreator
from torchsupervisor.monitored.creators import ChiefSessionCreator, SessionCreator
from torchsupervisor.monitored.scaffold import Scaffold
from torchsupervisor.monitored.wrappers import (
    StepContext,
    _RecoverableSession,
)
from torchsupervisor.tiers.memory import HELD_IN_MEMORY

if TYPE_CHECKING:
    import torch

    from torchsupervisor.monitored.replica_stop import ReplicaStop

__all__ = [
    "MonitoredSession",
    "SingularMonitoredSession",
    "StepContext",
]

logger = logging.getLogger("torchsupervisor")


_STEP_FN_ERROR = (
    "`step_fn` may either have one `step_context` argument, or `self` and `step_context` "
    "arguments if it's an instance method. Got {} instead."
)


def _step_fn_params(step_fn: Callable[..., Any]) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(step_fn).parameters.values())
    except (TypeError, ValueError):
        return []


class _MonitoredSession:
    """The common part of ``MonitoredSession`` and ``SingularMonitoredSession``."""

    StepContext = StepContext  # TF's ``MonitoredSession.StepContext``.

    def __init__(
        self,
        session_creator: SessionCreator | None,
        hooks: Iterable[SessionRunHook] | None,
        should_recover: bool,
        stop_grace_period_secs: float = 120,
        *,
        preemption_signals: Iterable[int] | None = DEFAULT_PREEMPTION_SIGNALS,
        preemption_grace_secs: float = 30.0,
        preemption_exit_code: int | None = None,
        preemption_sources: Iterable[PreemptionSource] | str | None = "auto",
        preemption_requeue: SlurmRequeue | str | None = "auto",
    ) -> None:
        stop_grace_period_secs = check_number("stop_grace_period_secs", stop_grace_period_secs)
        preemption_signals = check_signals("preemption_signals", preemption_signals)
        preemption_grace_secs = check_number("preemption_grace_secs", preemption_grace_secs)
        preemption_exit_code = check_int(
            "preemption_exit_code", preemption_exit_code, allow_none=True
        )
        check_duck("session_creator", session_creator, ("create_session",), "a SessionCreator")
        check_iterable("hooks", hooks)
        self._graph = get_default_graph()
        self._hooks = list(hooks or [])
        for hook in self._hooks:
            if not isinstance(hook, SessionRunHook) and not callable(getattr(hook, "begin", None)):
                raise TypeError(f"hooks must be SessionRunHook objects, got {hook!r}")
        self._stop_requested = False
        self._checked_step_fn: Any = None
        self._sess: Any = None
        self._goodput: GoodputRecorder | None = None  # This rank's ledger.
        self._preemption = Preemption(
            preemption_signals or (),
            preemption_grace_secs,
            preemption_exit_code,
            sources=check_sources("preemption_sources", preemption_sources),
            requeue=check_requeue("preemption_requeue", preemption_requeue),
        )
        # Installed first, so that a signal during start-up (a long restore) is recorded too.
        self._preemption.install()
        try:
            for hook in self._hooks:
                hook.begin()
            self._coordinated_creator = CoordinatedSessionCreator(
                session_creator or ChiefSessionCreator(),
                self._hooks,
                stop_grace_period_secs,
                self._graph,
            )
            # A chief's checkpoint directory; another rank's, given to its creator.
            logdir = getattr(session_creator, "checkpoint_dir", None) or getattr(
                session_creator, "goodput_dir", None
            )
            if isinstance(logdir, str) and logdir:
                self._goodput = open_recorder(logdir)
            started = time.time()
            if should_recover:
                self._sess = _RecoverableSession(self._coordinated_creator)
            else:
                self._sess = self._coordinated_creator.create_session()
            self._goodput_ready(started)
        except BaseException:
            self._preemption.uninstall()
            if self._goodput is not None:
                self._goodput.close()
            raise

    @property
    def graph(self) -> Graph | None:
        """The collections registry the session was created with (None once closed).

        TF name: ``MonitoredSession.graph``.
        """
        return None if self._sess is None else self._graph

    def run(
        self,
        fetches: object,
        feed_dict: Mapping[str, Any] | None = None,
        options: object = None,
        run_metadata: object = None,
    ) -> Any:
        """Run fetches with the hooks, recovering from preemption errors.

        Args:
            fetches: As ``Session.run``: a callable (the training step), a tensor, a
                ``GlobalStep``, or nested lists/tuples/dicts of them.
            feed_dict: Keyword arguments for the fetched callables.
            options: Accepted for TF compatibility (no counterpart); passed to the hooks.
            run_metadata: Accepted for TF compatibility; passed to the hooks.

        Returns:
            The values of ``fetches``, shaped like them.

        Raises:
            RuntimeError: ``"Run called even after should_stop requested."`` after a hook
                requested a stop; ``"Same tensor is fed by two hooks. Conflict(s): [...]"`` or
                ``"Same tensor is fed by a SessionRunHook and user. Conflict(s): [...]"``;
                ``"Attempted to use a closed Session."`` after ``close()``.
            Exception: Whatever the fetches or the hooks raise (an ``AbortedError`` or
                ``UnavailableError`` only from a ``SingularMonitoredSession``).

        TF name: ``MonitoredSession.run``.
        """
        sess = self._sess
        if sess is None:
            raise RuntimeError("Attempted to use a closed Session.")
        return sess.run(fetches, feed_dict=feed_dict, options=options, run_metadata=run_metadata)

    def run_step_fn(self, step_fn: Callable[[StepContext], Any]) -> Any:
        """Run ``step_fn(step_context)``: it may run the raw session and the hooked one.

        ``step_context.session`` runs without hooks; ``step_context.run_with_hooks(...)`` runs
        like ``run``; ``step_context.request_stop()`` raises ``StopIteration``. On a preemption
        error the whole ``step_fn`` is run again on a new session (``MonitoredSession`` only).

        Args:
            step_fn: A function of one argument, or a method of one argument after ``self``.

        Returns:
            What ``step_fn`` returns.

        Raises:
            ValueError: For a ``step_fn`` of another arity (TF's text; the argument's name is
                not checked).
            StopIteration: From ``step_context.request_stop()``.

        TF name: ``MonitoredSession.run_step_fn``.
        """
        key = getattr(step_fn, "__func__", step_fn)
        if key is not self._checked_step_fn:
            params = _step_fn_params(step_fn)
            positional = (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            )
            if len(params) != 1 or params[0].kind not in positional:
                raise ValueError(_STEP_FN_ERROR.format(tuple(p.name for p in params)))
            self._checked_step_fn = key
        sess = self._sess
        if sess is None:
            raise RuntimeError("Attempted to use a closed Session.")
        return sess.run_step_fn(step_fn, self._coordinated_creator.tf_sess, None)

    def should_stop(self) -> bool:
        """Return True when training should stop.

        True once a hook asked for it, a thread reported an error (raised by ``close()``),
        ``request_stop()`` was called, or a preemption signal was received (checked here:
        the handler only records it). A preemption error reported by a thread makes a
        ``MonitoredSession`` create a new session here (and return False).

        Distributed: with replicas (DDP under ``master="env://"``), a preemption or
        ``request_stop()`` on any rank stops every rank after the same number of steps
        (``replica_stop``: True on each once it completed them); the hooks' stops stay each
        rank's own.

        TF name: ``MonitoredSession.should_stop``.
        """
        if self._preemption.requested and self._preemption.notice():
            self._stop_requested = True
        replicas = self._replica_stop()
        if replicas is None:
            stop = self._stop_requested
        else:
            requested = self._stop_requested  # Its reason only then: nothing made a step.
            reason = (self._preemption.describe() or "stop requested") if requested else ""
            stop = replicas.should_stop(requested, reason)
        if stop and self._preemption.requested:  # Logged once, at the step it stops at.
            self._preemption.report(
                self._current_step(), saving=bool(checkpoint_drivers(self._hooks))
            )
        if stop:
            return True
        sess = self._sess
        return sess is None or sess.should_stop()

    def _replica_stop(self) -> ReplicaStop | None:
        """The agreed stop of a replicated run (its session creator's), or None."""
        return getattr(self._coordinated_creator._session_creator, "replica_stop", None)

    def badput(self, cause: str) -> contextlib.AbstractContextManager[None]:
        """Count the time of the block as badput ``cause`` in the goodput ledger
        (``torchsupervisor goodput``): an evaluation, a data reload, anything that is not
        training (``Supervisor.badput``). Without a ledger (no ``checkpoint_dir``; a rank
        alone that is not the chief) it only runs the block.

        Raises:
            TypeError: ``cause`` is not a non-empty string.

        TF name: none.
        """
        return badput_interval(self._goodput, cause)

    def _memory_first(self, drivers: list[Any], step: int | None) -> int | None:
        """After a preemption, with the memory tier on: the stop's step into it first
        (``MemoryTier.hold_stop``); the step it holds."""
        memory = getattr(self._coordinated_creator._session_creator, "memory_tier", None)
        if memory is None or not self._preemption.requested:
            return None
        if memory.hold_stop(step, self._preemption.budget()):
            for hook in self._hooks:
                if hasattr(hook, "final_held_elsewhere"):
                    hook.final_held_elsewhere = HELD_IN_MEMORY
        return memory.committed_step

    def _goodput_ready(self, started: float) -> None:
        """The ledger's record of the session just created (its restore, its step)."""
        recorder, sess = self._goodput, self._tf_sess()
        if recorder is not None and sess is not None:
            step = session_global_step(sess, get_global_step())
            recorder.session_ready(started, sess, self._current_step(), step)

    def _current_step(self) -> int | None:
        global_step = session_global_step(self._tf_sess(), get_global_step())
        return None if global_step is None else read_step(global_step)

    @property
    def preempted(self) -> str | None:
        """The name of the preemption signal received (``"SIGTERM"``), or None.

        Not in TF.
        """
        return self._preemption.describe() or None

    def request_stop(self) -> None:
        """Make ``should_stop()`` return True from now on; the session stays usable.

        The seam for stop requests from outside the training loop (another thread): the loop
        then ends normally, and leaving the ``with`` block runs the hooks' ``end()`` (the final
        checkpoint). Not in TF.

        Thread safety: may be called from any thread or a signal handler (sets a flag).
        """
        self._stop_requested = True

    def close(self) -> None:
        """Run the hooks' ``end()``, then stop the threads and close the session.

        The signal handlers installed by the session are restored.

        Raises:
            RuntimeError: ``'Session is already closed.'`` when called twice.
            SystemExit: With ``preemption_exit_code``, after a preemption signal, once
                everything is closed.
            Exception: An error a thread reported to the coordinator, or one of a hook's
                ``end()``.

        TF name: ``MonitoredSession.close``.
        """
        self._close_internal(None)

    def _close_internal(self, failure: BaseException | None) -> None:
        """Close after a clean end (``failure`` None) or the error the session ended with."""
        stopping_since = time.time()
        replicas = self._replica_stop()
        if replicas is not None and failure is not None:
            replicas.end(failure)  # The other ranks stop at once, naming it.
        try:
            step = self._current_step()
        except Exception:  # Already closed: ``close`` says so below.
            step = None
        lost: SystemExit | None = None
        drivers = checkpoint_drivers(self._hooks)
        try:
            try:
                if failure is None:
                    memory_step = self._memory_first(drivers, step)
                    budget = self._preemption.budget()
                    if budget is not None:
                        # The scheduler's SIGKILL follows: the final checkpoint gets a budget.
                        for driver in drivers:
                            driver.grace_budget_secs = budget
                    for hook in self._hooks:
                        hook.end(self._coordinated_creator.tf_sess)
                    if drivers:
                        lost = self._preemption.outcome(
                            self._current_step(), drivers[0], memory_step
                        )
                elif self._preemption.aborted:  # A second Ctrl-C: abandon, do not wait.
                    for driver in drivers:
                        if driver.saver is not None and driver.abandon(5.0):
                            driver.close()
            finally:
                try:
                    if self._sess is None:
                        raise RuntimeError("Session is already closed.")
                    self._sess.close()
                finally:
                    self._sess = None
                    self._coordinated_creator.tf_sess = None
                    self._coordinated_creator.coord = None
                    self._coordinated_creator.close()
        finally:
            self._preemption.uninstall()
            self._finish_goodput(failure is not None, step, stopping_since)
        if lost is not None:
            raise lost
        if failure is None:
            self._preemption.exit()

    def _finish_goodput(self, failed: bool, step: int | None, since: float) -> None:
        recorder, self._goodput = self._goodput, None
        if recorder is None:
            return
        if failed:
            reason = "error"
        else:
            reason = "preemption" if self._preemption.requested else "end"
        recorder.finish(step, reason, since)

    def _tf_sess(self) -> Session | None:
        return self._coordinated_creator.tf_sess

    def __enter__(self) -> _MonitoredSession:
        return self

    def __exit__(self, exception_type: Any, exception_value: Any, traceback: object) -> bool:
        # The end of the input ends training cleanly (TF's OutOfRangeError).
        clean = exception_type is None or exception_type in (OutOfRangeError, StopIteration)
        self._close_internal(None if clean else exception_value)
        return clean


class MonitoredSession(_MonitoredSession):
    """A session that runs hooks, and recovers from ``AbortedError``/``UnavailableError``.

    See the module docstring for the order of what it does.

    Recovery: on a preemption error (from a run, a step function or a thread) the session is
    closed (without the hooks' ``end()``), the checkpoint a ``CheckpointSaverHook`` is still
    writing is waited for, and the session creator makes a new session, restoring the newest
    checkpoint of its ``checkpoint_dir``; then the failed run (or the whole step function) is
    run again. With ``MonitoredTrainingSession(checkpoint_dir=...)`` there is always a
    checkpoint to restore: ``CheckpointSaverHook`` commits one at the step of every new
    session (step 0 for a fresh run). When there is none (no ``checkpoint_dir``, or no valid
    checkpoint in it yet), the state is kept as it is in memory, including what the failed
    run changed before it raised. TF re-initialized every variable there; the state here lives
    in Python objects that cannot be re-initialized, so the init op and ``init_fn``, which ran
    for the first session, are not run again (the local init op and the ready check are).

    Args:
        session_creator: Creates the sessions; None: ``ChiefSessionCreator()``.
        hooks: ``SessionRunHook``s, called in order.
        stop_grace_period_secs: Seconds the session's threads get to stop at ``close()``.
        preemption_signals: Signals that mean "stop and save" (default SIGTERM, SIGUSR1 and
            SIGINT: Ctrl-C is a graceful stop, a second Ctrl-C aborts at once with
            ``KeyboardInterrupt``; empty or None: keep the current handlers).
            Installed when the session is constructed (so a signal during start-up counts),
            on the main thread only (elsewhere a warning is logged), and restored when it
            closes. A handler only records the signal; ``should_stop()`` then returns True, so
            the loop ends normally, and leaving the ``with`` block runs the hooks' ``end()``:
            ``CheckpointSaverHook`` writes the final checkpoint at the current step. Further
            signals change nothing.
        preemption_grace_secs: Time budget of the ``CheckpointSaverHook``s' ``end()`` after a
            preemption signal, in seconds (schedulers send SIGKILL after a grace period:
            leave a margin). A save that cannot finish in time is cancelled cleanly (nothing
            half-written; the last committed checkpoint is kept).
        preemption_exit_code: If set, ``close()`` (so also leaving the ``with`` block
            cleanly) raises ``SystemExit`` with this code after a preemption signal, once
            everything is saved and closed (for schedulers that requeue on a given exit
            status). None: return normally (the program then ends with status 0).
        preemption_sources: What else announces a stop (SLURM's time limit, a cloud's
            spot or preemption notice), polled on a thread of its own while the session is
            open: ``"auto"`` (the default: those that apply to this machine), a list of
            sources, or None (signals only); see ``Supervisor``. ``should_stop()`` then
            returns True as after a signal.
        preemption_requeue: After a stop by SIGUSR1/SIGUSR2 (SLURM's ``--signal``) or by
            SLURM's time limit, ``close()`` has rank 0 requeue the SLURM job once everything
            is saved (``"auto"``: inside a SLURM job; None: never); see ``Supervisor``.

    Raises:
        Exception: What session creation or a hook's ``begin``/``after_create_session``
            raises.

    Thread safety: use from one (training) thread; ``request_stop`` from any thread.

    TF name: ``tf.compat.v1.train.MonitoredSession``.
    """

    def __init__(
        self,
        session_creator: SessionCreator | None = None,
        hooks: Iterable[SessionRunHook] | None = None,
        stop_grace_period_secs: float = 120,
        *,
        preemption_signals: Iterable[int] | None = DEFAULT_PREEMPTION_SIGNALS,
        preemption_grace_secs: float = 30.0,
        preemption_exit_code: int | None = None,
        preemption_sources: Iterable[PreemptionSource] | str | None = "auto",
        preemption_requeue: SlurmRequeue | str | None = "auto",
    ) -> None:
        super().__init__(
            session_creator,
            hooks,
            should_recover=True,
            stop_grace_period_secs=stop_grace_period_secs,
            preemption_signals=preemption_signals,
            preemption_grace_secs=preemption_grace_secs,
            preemption_exit_code=preemption_exit_code,
            preemption_sources=preemption_sources,
            preemption_requeue=preemption_requeue,
        )


class SingularMonitoredSession(_MonitoredSession):
    """A chief ``MonitoredSession`` without recovery that exposes its raw session.

    Args:
        hooks: ``SessionRunHook``s, called in order.
        scaffold: The ``Scaffold``; None: a default one.
        master: ``""`` for an in-process session.
        config: Passed to the session.
        checkpoint_dir: Directory to restore the newest valid checkpoint from.
        stop_grace_period_secs: Seconds the session's threads get to stop at ``close()``.
        checkpoint_filename_with_path: A specific checkpoint prefix to restore instead.
        state: The training state (a mapping of names to stateful objects).
        device: Where the init op materializes meta-device modules.
        clock: Time source for waits.
        preemption_signals: As ``MonitoredSession``: signals that stop training cleanly
            (default SIGTERM, SIGUSR1 and SIGINT; empty or None: none).
        preemption_grace_secs: As ``MonitoredSession``: the time budget of the final
            checkpoint after a preemption signal, in seconds.
        preemption_exit_code: As ``MonitoredSession``: the ``SystemExit`` code of ``close()``
            after a preemption signal; None: return normally.
        preemption_sources: As ``MonitoredSession``: what else announces a stop.
        preemption_requeue: As ``MonitoredSession``: requeue the SLURM job after a stop by
            its time running out.

    Raises:
        Exception: What session creation or a hook's ``begin``/``after_create_session``
            raises.

    Thread safety: use from one (training) thread.

    TF name: ``tf.compat.v1.train.SingularMonitoredSession``.
    """

    def __init__(
        self,
        hooks: Iterable[SessionRunHook] | None = None,
        scaffold: Scaffold | None = None,
        master: str = "",
        config: object = None,
        checkpoint_dir: str | None = None,
        stop_grace_period_secs: float = 120,
        checkpoint_filename_with_path: str | None = None,
        *,
        state: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        clock: Clock | None = None,
        preemption_signals: Iterable[int] | None = DEFAULT_PREEMPTION_SIGNALS,
        preemption_grace_secs: float = 30.0,
        preemption_exit_code: int | None = None,
        preemption_sources: Iterable[PreemptionSource] | str | None = "auto",
        preemption_requeue: SlurmRequeue | str | None = "auto",
    ) -> None:
        where = (checkpoint_dir, checkpoint_filename_with_path)
        session_creator = ChiefSessionCreator(
            scaffold, master, config, *where, state=state, device=device, clock=clock
        )
        super().__init__(
            session_creator,
            hooks,
            should_recover=False,
            stop_grace_period_secs=stop_grace_period_secs,
            preemption_signals=preemption_signals,
            preemption_grace_secs=preemption_grace_secs,
            preemption_exit_code=preemption_exit_code,
            preemption_sources=preemption_sources,
            preemption_requeue=preemption_requeue,
        )

    def raw_session(self) -> Session | None:
        """Return the session without hooks (None once closed).

        TF name: ``SingularMonitoredSession.raw_session``.
        """
        return self._tf_sess()
