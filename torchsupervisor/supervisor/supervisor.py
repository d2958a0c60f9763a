"""``Supervisor``: a thin facade over Coordinator, Saver, SummaryWriter and SessionManager.

Typical use::

    sv = Supervisor(logdir="runs/exp", state={"model": model, "optimizer": opt,
                                              "global_step": step})
    with sv.managed_session() as sess:
        while not sv.should_stop():
            sess.run(train_step)

Inside ``managed_session`` the state was restored from the newest valid checkpoint of
``logdir`` (or initialized), and services run in the background: a checkpoint every
``save_model_secs``, summaries and ``global_step/sec`` every ``save_summaries_secs``. On purpose
unlike TF: the class docstring and SPEC section 4. The modes (one process, replicas, sharded
state): ``supervisor/modes.py``; the arguments: ``supervisor/settings.py``; when to
checkpoint: ``driver/checkpoint_driver.py``.

TF name: ``tf.compat.v1.train.Supervisor``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from torchsupervisor.checkpoint.best import check_metrics
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.coordinator import Coordinator, LooperThread
from torchsupervisor.core.registry import USE_DEFAULT, Graph, GraphKeys
from torchsupervisor.core.session import Session
from torchsupervisor.driver.goodput import GoodputRecorder, badput_interval
from torchsupervisor.driver.preemption import DEFAULT_PREEMPTION_SIGNALS, Preemption
from torchsupervisor.driver.preemption_sources import PreemptionSource
from torchsupervisor.driver.requeue import SlurmRequeue
from torchsupervisor.storage import DirectoryLock
from torchsupervisor.summary.null_writer import NullSummaryWriter
from torchsupervisor.summary.writer import write_start
from torchsupervisor.supervisor.lifecycle import (
    begin_goodput,
    end_unmanaged,
    goodput_ready,
    open_logdir,
    release_session,
    stop_at_run,
    stop_decision,
)
from torchsupervisor.supervisor.modes import ChiefMode, Mode, ModeContext, start_mode
from torchsupervisor.supervisor.services import standard_threads
from torchsupervisor.supervisor.session_manager import SessionManager
from torchsupervisor.supervisor.settings import resolve_settings
from torchsupervisor.tiers.memory import MemoryTierConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchsupervisor.core.global_step import GlobalStepLike
    from torchsupervisor.core.registry import UseDefault
    from torchsupervisor.core.session import Op, SessionLike
    from torchsupervisor.driver.checkpoint_driver import EventSink, SaverLike

__all__ = ["Supervisor"]

logger = logging.getLogger("torchsupervisor")


def _setting(name: str, doc: str) -> property:
    """A read-only property of the ``Supervisor``: ``self._settings.<name>``."""
    return property(lambda self: getattr(self._settings, name), doc=doc)


class Supervisor:
    """A training helper that restores or initializes the state, checkpoints, and summarizes.

    Args:
        graph: The collections registry to resolve ``USE_DEFAULT`` from (default graph).
        ready_op: Callable (taking the session or nothing) returning the names of what is not
            initialized; ``USE_DEFAULT``: ``report_uninitialized_variables()``; None: no check.
        ready_for_local_init_op: Like ``ready_op``, checked before ``local_init_op``.
        is_chief: The chief restores or initializes, checkpoints and writes summaries; the
            others wait until the state is ready, then receive the chief's state. None (TF's
            default is True): the replica of rank 0 is the chief (rank from the process group,
            else ``$RANK`` as set by ``torchrun``, else 0).
        init_op: Run by the chief when nothing can be restored; ``USE_DEFAULT``:
            ``global_variables_initializer()`` (materializes meta-device modules).
        init_feed_dict: Keyword arguments for ``init_op``.
        local_init_op: Run in every new session; ``USE_DEFAULT``: a no-op.
        logdir: Directory for checkpoints and event files (created if missing); None or ""
            disables checkpoints, restores and summaries.
        summary_op: Callable returning a ``Summary`` for the summary service;
            ``USE_DEFAULT``: ``summary.merge_all()``; None: no summary service.
        saver: ``Saver`` for checkpoints; ``USE_DEFAULT``: a ``Saver()`` when the state is not
            empty; None: no checkpoints.
        global_step: ``GlobalStep`` (or integer scalar tensor); ``USE_DEFAULT``:
            ``state["global_step"]`` (added to the ``GLOBAL_STEP`` collection), else the
            collection's first item. TF looks at the collection first; here the state, which
            belongs to this run, wins over a process-wide collection that an earlier run may
            have filled. A global step missing from the state is added to it, so it is
            checkpointed.
        save_summaries_secs: Seconds between summaries (0: no summary service).
        save_model_secs: Seconds between checkpoints (0: no checkpoints).
        recovery_wait_secs: Seconds between readiness checks of a non-chief.
        stop_grace_secs: Grace period for threads to stop in ``stop()``, in seconds.
        checkpoint_basename: Checkpoint file name prefix inside ``logdir``.
        session_manager: ``SessionManager`` to use (it creates sessions over its own state).
        summary_writer: ``SummaryWriter``; ``USE_DEFAULT``: one on ``logdir``; None: none.
        init_fn: ``init_fn(sess)``, called after ``init_op`` when nothing was restored.
        local_init_run_options: Accepted for TF compatibility (RunOptions have no
            counterpart).
        state: Mapping of names to stateful objects (or tensors, arrays, plain values):
            the training state. The mapping itself is kept, not copied: a plain value the
            loop sets in it (``state["best"] = loss``) is what the next checkpoint saves, and
            a restore sets it back there. A mapping that cannot be changed
            (``MappingProxyType``) may not hold plain values (``TypeError``).
        device: Where ``init_op`` materializes meta-device modules.
        stop_on_checkpoint_error: By default a checkpoint that cannot be written (disk full,
            permission denied, ...) is logged and reported in the event file, and training
            continues (the next checkpoint is tried on schedule; older ones are untouched).
            With True, training stops and ``managed_session`` re-raises the error.
        preemption_signals: Signals that mean "stop and save" (default SIGTERM, SIGUSR1
            and SIGINT, so Ctrl-C is a graceful stop; empty to keep the default handlers).
            Inside ``managed_session`` (on the main thread) a handler only records the signal;
            ``should_stop()`` then returns True (one line is logged: ``"Received SIGINT:
            stopping at step N with a final checkpoint"``), the chief writes a final
            checkpoint at the current step, and ``managed_session`` returns normally. A second
            Ctrl-C aborts at once: one line on stderr, the save in flight is abandoned and
            ``KeyboardInterrupt`` is raised. The previous handlers are restored when the
            session ends.
        preemption_grace_secs: Time budget for the final checkpoint after a signal, in
            seconds (schedulers send SIGKILL after a grace period: leave a margin). A save
            that cannot finish in time is abandoned cleanly (nothing half-written; the last
            committed checkpoint is kept). A final checkpoint that fails or runs out of time
            is reported on one line naming the last committed checkpoint, and
            ``managed_session`` raises ``SystemExit`` with ``preemption_exit_code`` if it is
            non-zero, else 1: a stop that loses work never exits with status 0.
        preemption_exit_code: If set, ``managed_session`` raises ``SystemExit`` with this code
            after a preemption stop, once everything is saved and closed (for schedulers that
            requeue on a given exit status). None: return normally (exit status 0 when the
            program then ends).
        preemption_sources: What else announces a stop, polled on a thread of its own while
            a session runs (``driver/preemption_sources.py``): ``"auto"`` (the default) takes
            SLURM's time limit inside a SLURM job (the run stops ``preemption_grace_secs``
            before the job's end time, which a job without ``--signal`` is not warned of) and
            the spot or preemption notice of the cloud the machine is on (AWS, GCE, Azure,
            told by its DMI tables; the run stops at once, the final checkpoint getting the
            time left until the announced stop less 2 s); a list of sources
            (``SlurmTimeLimit``, ``AwsSpotNotice``, ``GcePreemptedNotice``,
            ``AzureScheduledEvents``, or your own with ``name``, ``poll_every_secs`` and
            ``poll()``); None or empty: signals only. The stop is then the same as after a
            signal, and its line names the source and the seconds left.
        preemption_requeue: After a stop by SIGUSR1 or SIGUSR2 (what SLURM's ``--signal``
            sends) or by SLURM's time limit, once the final checkpoint is committed and
            everything closed, rank 0 runs ``scontrol requeue $SLURM_JOB_ID``: the job comes
            back under the same id and resumes in the same log directory
            (``driver/requeue.py``; never after SIGTERM, which ``scancel`` sends, nor Ctrl-C).
            ``"auto"`` (the default): in a SLURM job with ``scontrol`` on the ``PATH``; a
            ``SlurmRequeue`` to choose the signals; None: never.
        system_metrics_secs: Write the machine's and this process tree's CPU, memory, disk
            and network use (and each GPU's, through NVML) as ``system/*`` scalars every this
            many seconds, on the chief (``summary/system_metrics.py``; needs psutil). None
            (the default): none.
        goodput_ledger: Every rank appends where its time went to ``<logdir>/goodput/``
            (start-up, restore, checkpoint stalls, the final stop, steps lost to a failure:
            ``driver/goodput.py``); ``torchsupervisor goodput LOGDIR`` reports goodput and
            badput by cause. The training thread pays one store per step. False: none.
        save_rng_state: Save an ``RNGState()`` as ``"rng"`` (Python, NumPy, torch CPU and
            CUDA generators; kept beside ``state``, which is not changed), so that a resumed
            run draws the same random numbers as an uninterrupted one. A checkpoint without
            it restores with a warning. With replicas each rank gets its own streams: the
            chief (rank 0) continues the saved ones; the chief also saves every rank's in
            an agreed stop's final checkpoint, and with DDP in each memory-tier snapshot
            (``distributed/replica_streams``: a gather at those steps; a sharded run's
            memory tier holds each rank's own), and each rank continues its own; any other
            rank ``r`` gets generators seeded from the saved
            (or the chief's broadcast) state and ``r`` (``rng.rank_rng_state``), a fixed
            function of the checkpoint and the rank, not an uninterrupted run's streams.
        memory_tier: Keep the newest snapshots of the state in host memory that outlives
            the process (a tmpfs, ``/dev/shm`` by default), every
            ``memory_tier.every_n_steps`` steps, besides the checkpoints of ``logdir``
            (``save_model_secs``): after a hard failure (``kill -9``, an OOM kill) a restart
            restores the newest snapshot of any tier that passes its checks, losing at most
            ``every_n_steps`` steps (``tiers/memory.py``, ``docs/checkpoints.md``). Needs a
            ``logdir`` and a global step. The tmpfs must hold ``slots`` x the state's bytes
            (``MemoryTierFullError`` at the start otherwise). The snapshots are freed at a
            clean end whose final checkpoint holds the last step. With replicas the chief
            keeps it (with every rank's random streams, gathered at each step) and, on
            several nodes, copies it to a rank of another node (paced by
            ``peer_every_secs``); with a state of DTensors (FSDP2) every rank keeps its own
            shards, copied to the next node's memory (``tiers/ring.py``), and a restart
            restores a step every rank holds somewhere. None: off.
        clock: Time source (tests pass a fake one).

    Distributed: with replicas (``managed_session("env://")`` under ``torchrun``), every rank
    runs the same program with the same arguments and the same ``logdir`` (a shared
    directory). With a replicated state the chief restores, broadcasts its state and saves
    alone; with a sharded state (FSDP2) every rank restores the same checkpoint and writes its
    shards of each checkpoint at a step the ranks agree on, and ``checkpoint()`` is a
    collective (``supervisor/modes.py``, ``docs/distributed.md``). A stop on one rank stops
    every rank at the same step.

    Raises:
        TypeError: For an argument of the wrong type (``save_model_secs="x"``,
            ``logdir=123``, ``state=[model]``), naming the argument and the value.
        ValueError: For a value out of range (``save_model_secs=-1``,
            ``preemption_grace_secs=-1``), naming the argument and the value.

    Thread safety: create it, run sessions and call ``should_stop``/``checkpoint`` on one
    (training) thread; ``request_stop`` may be called from any thread.

    TF name: ``tf.compat.v1.train.Supervisor``.
    """

    USE_DEFAULT = USE_DEFAULT

    def __init__(
        self,
        graph: Graph | None = None,
        ready_op: Op | UseDefault = USE_DEFAULT,
        ready_for_local_init_op: Op | UseDefault = USE_DEFAULT,
        is_chief: bool | None = None,
        init_op: Op | UseDefault = USE_DEFAULT,
        init_feed_dict: Mapping[str, Any] | None = None,
        local_init_op: Op | UseDefault = USE_DEFAULT,
        logdir: str | None = None,
        summary_op: Op | UseDefault = USE_DEFAULT,
        saver: SaverLike | UseDefault = USE_DEFAULT,
        global_step: GlobalStepLike | UseDefault = USE_DEFAULT,
        save_summaries_secs: float = 120,
        save_model_secs: float = 600,
        recovery_wait_secs: float = 30,
        stop_grace_secs: float = 120,
        checkpoint_basename: str = "model.ckpt",
        session_manager: SessionManager | None = None,
        summary_writer: EventSink | UseDefault = USE_DEFAULT,
        init_fn: Callable[..., object] | None = None,
        local_init_run_options: object = None,
        *,
        state: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        stop_on_checkpoint_error: bool = False,
        preemption_signals: Iterable[int] | None = DEFAULT_PREEMPTION_SIGNALS,
        preemption_grace_secs: float = 30.0,
        preemption_exit_code: int | None = None,
        preemption_sources: Iterable[PreemptionSource] | str | None = "auto",
        preemption_requeue: SlurmRequeue | str | None = "auto",
        system_metrics_secs: float | None = None,
        goodput_ledger: bool = True,
        save_rng_state: bool = True,
        memory_tier: MemoryTierConfig | None = None,
        clock: Clock | None = None,
    ) -> None:
        arguments = dict(locals())  # Exactly the arguments: nothing else is defined yet.
        del arguments["self"]
        self._settings = resolve_settings(**arguments)
        settings = self._settings
        self._preemption = Preemption(
            settings.preemption_signals,
            settings.preemption_grace_secs,
            settings.preemption_exit_code,
            sources=settings.preemption_sources,
            requeue=settings.preemption_requeue,
            clock=settings.clock,
        )
        self._coord = Coordinator(clock=settings.clock)
        self._context = ModeContext(settings, self._coord, self._preemption)
        self._generation = 0  # Sessions so far: keys of earlier sessions are not reused.
        self._mode: Mode | None = None
        self._logdir_lock: DirectoryLock | None = None
        self._lock_refused = False
        self._in_managed_session = False
        self._sess: Session | None = None
        self._null_writer = NullSummaryWriter()
        self._ending: tuple[bool, BaseException | None] | None = None  # For stop().
        self._goodput: GoodputRecorder | None = None  # This process's ledger (lifecycle.py).
        self._stopping_since: float | None = None  # When the session began to stop.
        self._unmanaged = False  # The session was prepared outside managed_session.
        self._finished = False  # Its end (the final checkpoint) is done.
        self._final_error: BaseException | None = None
        self._asked = False

    # -------------------------------------------------------------------------- accessors
    # What it was built with; each is TF's ``Supervisor.<name>`` (``state`` is ours).

    is_chief = _setting("is_chief", "True if this is the chief supervisor.")
    session_manager = _setting("session_manager", "The ``SessionManager`` creating sessions.")
    init_op = _setting("init_op", "The init op.")
    init_feed_dict = _setting("init_feed_dict", "The keyword arguments of the init op.")
    ready_op = _setting("ready_op", "The ready op.")
    ready_for_local_init_op = _setting("ready_for_local_init_op", "The ready-for-local-init op.")
    local_init_op = _setting("local_init_op", "The local init op.")

    @property
    def summary_writer(self) -> Any:
        """The ``SummaryWriter`` of the chief (None without a logdir); on a non-chief, a
        ``NullSummaryWriter``, which accepts every call and writes nothing (TF: None), so that
        a loop written for one process runs on every rank.

        TF name: ``tf.compat.v1.train.Supervisor.summary_writer``.
        """
        if not self._settings.is_chief:
            return self._null_writer
        return self._settings.summary_writer

    summary_op = _setting("summary_op", "The summary op of the summary service.")
    save_summaries_secs = _setting(
        "save_summaries_secs", "Seconds between summaries (None on non-chiefs)."
    )
    global_step = _setting("global_step", "The global step, or None.")
    saver = _setting("saver", "The ``Saver``, or None.")
    save_model_secs = _setting(
        "save_model_secs", "Seconds between checkpoints (None on non-chiefs)."
    )
    save_path = _setting(
        "save_path", "The checkpoint prefix without step (None on non-chiefs, without a logdir)."
    )
    state = _setting("state", "The state the sessions are created over (with the global step).")

    coord = property(lambda self: self._coord, doc="The ``Coordinator`` of the services.")
    checkpoint_driver = property(
        lambda self: None if self._mode is None else self._mode.driver,
        doc="The session's CheckpointDriver.",
    )

    # --------------------------------------------------------------------------- sessions

    def prepare_or_wait_for_session(
        self,
        master: str = "",
        config: object = None,
        wait_for_checkpoint: bool = False,
        max_wait_secs: float = 7200,
        start_standard_services: bool = True,
    ) -> Session:
        """Create a session whose state is restored or initialized, and start the services.

        The chief restores the newest valid checkpoint of ``logdir`` (or runs ``init_op`` and
        ``init_fn``) and starts the standard services; a non-chief waits until the state is
        ready. Both start the queue runners when ``start_standard_services``. How depends on
        the run (``supervisor/modes.py``).

        Outside ``managed_session`` the stop path is the same: the preemption signals are
        handled from here on (a signal makes ``should_stop()`` True at the next step, with
        replicas at the step every rank agreed on, and the final checkpoint is written
        there); ``stop()`` writes the final checkpoint of a clean stop. A loop that never
        asks ``should_stop()`` stops at its next ``sess.run`` after a signal: the final
        checkpoint is written, the services stopped, and ``SystemExit`` raised (status
        ``preemption_exit_code``, or 0).

        Distributed: with replicas and a replicated state, non-chiefs wait for the chief
        (polling every ``recovery_wait_secs``, at most ``max_wait_secs``) and receive its
        state. With a sharded state every rank restores through the SessionManager, after
        checking through the store that all ranks see the same checkpoints, and every rank
        starts its part of the sharded checkpoint service (pass the same
        ``start_standard_services`` on every rank).

        Args:
            master: ``""`` for in-process.
            config: Passed to the session.
            wait_for_checkpoint: The chief waits for a checkpoint to appear in ``logdir``.
            max_wait_secs: Longest wait for a checkpoint or a ready state, in seconds.
            start_standard_services: Start the services and the queue runners.

        Returns:
            The session.

        Raises:
            RuntimeError: If the state cannot be made ready.
            DataLossError: If ``logdir`` has checkpoints and none of them is valid.
            DeadlineExceededError: If a non-chief waited ``max_wait_secs`` in vain.
            LogdirLockedError: (Chief) another process is writing to ``logdir`` (one writer
                per log directory; released by ``stop`` or when that process ends).
            FailedPreconditionError: (Sharded state) if the ranks see different checkpoints
                or resumed from different ones, or another rank failed to prepare.

        TF name: ``Supervisor.prepare_or_wait_for_session``.
        """
        self._lock_refused = False
        self._unmanaged = not self._in_managed_session
        self._finished = False
        if not self._unmanaged:  # managed_session installed the preemption handlers.
            return self._prepare(
                master, config, wait_for_checkpoint, max_wait_secs, start_standard_services
            )
        self._preemption.install()
        try:
            return self._prepare(
                master, config, wait_for_checkpoint, max_wait_secs, start_standard_services
            )
        except BaseException:
            self._unmanaged = False
            self._preemption.uninstall()
            raise

    def _prepare(
        self,
        master: str,
        config: object,
        wait_for_checkpoint: bool,
        max_wait_secs: float,
        start_standard_services: bool,
    ) -> Session:
        open_logdir(self)
        started = begin_goodput(self)
        self._coord.clear_stop()
        if self._settings.summary_writer is not None:
            self._settings.summary_writer.reopen()
        self._generation += 1
        mode = self._mode = start_mode(self._context, master, max_wait_secs, self._generation)
        sess = mode.prepare(master, config, wait_for_checkpoint, max_wait_secs)
        self._sess = sess
        goodput_ready(self, sess, started)
        # A signal pokes the boundary: a loop that never asks should_stop() stops at its
        # next sess.run (``_stop_at_run``).
        sess.boundary.watcher = self._stop_at_run
        self._preemption.handler.on_signal = sess.boundary.poke
        self._asked = False  # Whether this session's loop ever asked should_stop().
        if start_standard_services:
            mode.start_services(sess)
            if self._settings.is_chief and not self._settings.logdir:
                # A session without a logdir (an evaluation) has nothing to write to.
                logger.warning("Standard services need a 'logdir' passed to the SessionManager")
            elif self._settings.is_chief:
                logger.info("Starting standard services.")
                self.start_standard_services(sess)
            logger.info("Starting queue runners.")
            self.start_queue_runners(sess)
        return sess

    def start_standard_services(self, sess: Session) -> list[LooperThread]:
        """Start the summary, step-counter and checkpoint services for ``sess``.

        Writes a ``SessionLog.START`` event first, at the first step this session produces
        (the current step + 1; TF: the current step), naming the current step as the one the
        session resumed at: the writer then removes the points a crashed run logged after its
        last checkpoint, and TensorBoard's purge at START keeps the points that checkpoint
        stands behind (``summary/restarts.py``).

        Returns:
            The started threads.

        Raises:
            RuntimeError: On a non-chief (TF's text).
            ValueError: Without a logdir, as the seed documents it (TF's code only warned
                and returned None; ``prepare_or_wait_for_session`` still only warns and
                starts none: a session without a logdir has nothing to write to).

        TF name: ``Supervisor.start_standard_services``.
        """
        if not self._settings.is_chief:
            raise RuntimeError(
                "Only chief supervisor can start standard services. Because only chief "
                "supervisors can write events."
            )
        if not self._settings.logdir:
            raise ValueError(
                "Standard services need a 'logdir' passed to the Supervisor: it has none "
                f"(logdir={self._settings.logdir!r})"
            )
        writer = self._settings.summary_writer
        if self._settings.global_step is not None and writer is not None:
            write_start(writer, self._context.current_step())
        threads = standard_threads(self._settings, self._coord, sess)
        if self._mode is None:  # Services started on a session prepared elsewhere.
            self._mode = ChiefMode(self._context, None)
        threads.extend(self._mode.checkpoint_threads(sess))
        for thread in threads:
            thread.start()
        return threads

    def start_queue_runners(self, sess: Session, queue_runners: list[Any] | None = None) -> list:
        """Start the threads of the queue runners (default: the ``QUEUE_RUNNERS`` collection).

        Each runner's ``create_threads(sess, coord=..., daemon=True, start=True)`` is called.

        Returns:
            The started threads.

        TF name: ``Supervisor.start_queue_runners``.
        """
        if queue_runners is None:
            queue_runners = self._settings.graph.get_collection(GraphKeys.QUEUE_RUNNERS)
        threads = []
        for runner in queue_runners:
            threads.extend(runner.create_threads(sess, coord=self._coord, daemon=True, start=True))
        return threads

    @contextlib.contextmanager
    def managed_session(
        self,
        master: str = "",
        config: object = None,
        start_standard_services: bool = True,
        close_summary_writer: bool = True,
    ) -> Iterator[Session]:
        """A context manager giving a ready session, stopping everything cleanly at exit.

        Exceptions raised in the block or by a service are re-raised when the block exits,
        after the services stopped; ``OutOfRangeError`` and ``StopIteration`` end training
        cleanly and are not re-raised. On a clean exit the chief first saves a final
        checkpoint at the current step (when the checkpoint service runs).

        Distributed: a stop on one rank stops every rank at the same step. A rank leaving the
        block with an error records ``"<ErrorType>: <message>"``; the others log it (``"Every
        rank stops: rank R: ..."``) and, after their final checkpoint, raise ``AbortedError``
        naming it. Sharded: every rank saves the final checkpoint or none does (a rank leaving
        with an error vetoes; the others wait at most ``stop_grace_secs``, or what is left of
        ``preemption_grace_secs``).

        Args:
            master: ``""`` for in-process.
            config: Passed to the session.
            start_standard_services: Start the services and queue runners.
            close_summary_writer: Close the writer at exit (writing ``SessionLog.STOP``).

        Yields:
            The session.

        Raises:
            RuntimeError: If this Supervisor's ``managed_session`` is already open.
            AbortedError: With replicas, at exit, if another rank left with an error.

        TF name: ``Supervisor.managed_session``.
        """
        if self._in_managed_session:
            raise RuntimeError(
                "This Supervisor's managed_session() is already open: one session at a time "
                "(leave the first block before opening another)"
            )
        self._in_managed_session = True
        sess = None
        clean_exit = False
        failure: BaseException | None = None
        self._preemption.install()
        try:
            sess = self.prepare_or_wait_for_session(
                master=master, config=config, start_standard_services=start_standard_services
            )
            yield sess
            clean_exit = True
        except Exception as e:
            clean_exit = isinstance(e, self._coord.clean_stop_exception_types)
            failure = e
            self.request_stop(e)
        finally:
            self._stopping_since = self._settings.clock.time()
            mode = self._mode
            try:
                final_error: BaseException | None = None
                try:
                    if mode is not None:
                        mode.end_agreement(clean_exit, failure)
                        final_error = mode.finish(clean_exit)
                finally:
                    self._ending = (clean_exit, failure)
                    self.stop(close_summary_writer=close_summary_writer)
                if final_error is not None:
                    raise final_error
            finally:
                self._mode = None
                self._sess = None
                self._in_managed_session = False
                self._preemption.uninstall()
                if sess is not None:
                    try:
                        sess.close()
                    except Exception:
                        pass
        self._preemption.exit()

    def checkpoint(self, metrics: Mapping[str, float] | None = None) -> str | None:
        """Save a checkpoint now, at the current step, and wait until it is committed.

        Call it from the training thread between steps. Skipped (returns None) when the
        step did not move since the last checkpoint, unless ``metrics`` are given.

        Args:
            metrics: What the run measured now (``{"accuracy": 0.98}``), stored with the
                checkpoint: a saver with ``keep_best`` keeps the best by them
                (``Supervisor(saver=ts.Saver(keep_best=1, best_fn="accuracy"))``). The
                checkpoint of the current step is written again if it exists. Not with a
                sharded state.

        Returns:
            The checkpoint prefix, or None.

        Raises:
            RuntimeError: If there is no running checkpoint service (non-chief, no logdir,
                ``save_model_secs=0``, or outside ``managed_session``), or when called from
                another thread than the training thread.
            CheckpointSaveError: If writing fails.
            DeadlineExceededError: (Sharded state) if not every rank called it at the same
                step within 300 s.

        Distributed: with a replicated state only the chief can call it. With a sharded
        state it is a collective: every rank calls it at the same step, and all save.

        TF name: none (TF only saved on the timer; ``sv.saver.save(sess, sv.save_path)`` by hand).
        """
        if self._mode is None:
            raise RuntimeError("checkpoint() needs a running checkpoint service on the chief")
        return self._mode.checkpoint(check_metrics(metrics))

    def stop(
        self,
        threads: list[Any] | None = None,
        close_summary_writer: bool = True,
        ignore_live_threads: bool = False,
    ) -> None:
        """Stop the services and join their threads; does not close the session.

        The chief releases the logdir's writer lock (its saver's too: a later save retakes it).
        For a session prepared outside ``managed_session`` (``prepare_or_wait_for_session``),
        a stop that is not called while an exception propagates first saves the final
        checkpoint, as ``managed_session`` does at a clean exit; after a preemption signal,
        ``SystemExit`` is raised at the end as there (``preemption_exit_code``, or 1 when the
        final checkpoint failed).

        Args:
            threads: Extra threads to join besides the registered ones.
            close_summary_writer: Write ``SessionLog.STOP`` and close the writer.
            ignore_live_threads: Log, instead of raising, threads still alive after the
                grace period.

        Raises:
            Exception: The first exception reported to the coordinator, or RuntimeError
                naming the threads that would not stop.
            SystemExit: After a preemption signal, for a session prepared outside
                ``managed_session`` (see above).

        TF name: ``Supervisor.stop``.
        """
        unmanaged = self._unmanaged and self._mode is not None
        ending, self._ending = self._ending, None
        final_error = None
        if unmanaged:  # managed_session does this itself, knowing how its block ended.
            ending, final_error = end_unmanaged(self, sys.exc_info()[1])
        self._coord.request_stop()
        try:
            self._coord.join(
                threads,
                stop_grace_period_secs=self._settings.stop_grace_secs,
                ignore_live_threads=ignore_live_threads,
            )
        finally:
            release_session(self, ending, unmanaged, close_summary_writer)
        if unmanaged:
            self._mode = None
            if final_error is not None:
                raise final_error
            self._preemption.exit()

    def request_stop(self, ex: Any = None) -> None:
        """Request the coordinator to stop; ``ex`` is recorded if it is the first error.

        TF name: ``Supervisor.request_stop``.
        """
        self._coord.request_stop(ex=ex)

    def should_stop(self) -> bool:
        """Return True if training should stop. A step boundary on the training thread.

        TF name: ``Supervisor.should_stop``.
        """
        sess = self._sess
        if sess is not None:
            boundary = sess.boundary
            boundary.asked = True  # The boundary of this step: not the next sess.run.
            self._asked = True
            if boundary.pending:
                boundary.run_pending()
        return self._stop_decision()

    def _stop_decision(self) -> bool:
        return stop_decision(self)

    def _stop_at_run(self) -> None:
        stop_at_run(self)

    @property
    def preempted(self) -> str | None:
        """The name of the preemption signal that stopped the last session (or None)."""
        return self._preemption.describe() or None

    def badput(self, cause: str) -> contextlib.AbstractContextManager[None]:
        """Count the time of the block as badput ``cause`` in the goodput ledger
        (``torchsupervisor goodput``): an evaluation, a data reload, anything that is not
        training. Without a ledger (``goodput_ledger=False``, no logdir) it only runs the block.

        Raises:
            TypeError: ``cause`` is not a non-empty string.

        TF name: none.
        """
        return badput_interval(self._goodput, cause)

    def stop_on_exception(self) -> Any:
        """Context manager that requests a stop when its block raises (and swallows it).

        TF name: ``Supervisor.stop_on_exception``.
        """
        return self._coord.stop_on_exception()

    def wait_for_stop(self) -> None:
        """Block until a stop is requested.

        TF name: ``Supervisor.wait_for_stop``.
        """
        self._coord.wait_for_stop()

    def loop(
        self,
        timer_interval_secs: float | None,
        target: object,
        args: object = None,
        kwargs: object = None,
    ) -> LooperThread:
        """Start a thread calling ``target(*args, **kwargs)`` every ``timer_interval_secs``.

        The first call is immediate; None means back to back. The thread stops with the
        supervisor and is joined by ``stop()``.

        Returns:
            The started thread.

        TF name: ``Supervisor.loop``.
        """
        thread = LooperThread(
            self._coord, timer_interval_secs, target=target, args=args, kwargs=kwargs
        )
        thread.start()
        return thread

    def summary_computed(
        self, sess: SessionLike, summary: object, global_step: GlobalStepLike | None = None
    ) -> None:
        """Write a computed summary (a ``Summary`` proto or its bytes) at the current step.

        Args:
            sess: The session (unused).
            summary: A ``Summary`` proto or its serialization.
            global_step: The step; None: the current global step (if any).

        Raises:
            RuntimeError: ``"Writing a summary requires a summary writer."``.
            TypeError: If ``summary`` is neither a Summary nor bytes.

        TF name: ``Supervisor.summary_computed``.
        """
        del sess
        if self._settings.summary_writer is None:
            raise RuntimeError("Writing a summary requires a summary writer.")
        if global_step is None and self._settings.global_step is not None:
            global_step = self._context.current_step()
        self._settings.summary_writer.add_summary(summary, global_step)

    # TF's CamelCase aliases.
    PrepareSession = prepare_or_wait_for_session
    StartQueueRunners = start_queue_runners
    StartStandardServices = start_standard_services
    Stop = stop
    RequestStop = request_stop
    Loop = loop
    ShouldStop = should_stop
    StopOnException = stop_on_exception
    WaitForStop = wait_for_stop
    SummaryComputed = summary_computed
