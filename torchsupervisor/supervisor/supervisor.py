"""``Supervisor``: a thin facade over Coordinator, Saver, SummaryWriter and SessionManager.

Typical use::

    sv = Supervisor(logdir="runs/exp", state={"model": model, "optimizer": opt,
                                              "global_step": step})
    with sv.managed_session() as sess:
        while not sv.should_stop():
            sess.run(train_step)

Inside ``managed_session`` the state was restored from the newest valid checkpoint of
``logdir`` (or initialized), and services run in the background: a checkpoint every
``save_model_secs``, summaries and ``global_step/sec`` every ``save_summaries_secs``.

Where this differs from TF on purpose (SPEC section 4):

* Checkpoints are taken at step boundaries only (``sess.run`` entry, ``should_stop()``,
  ``checkpoint()``) on the training thread, copied to host memory and written in the
  background, so a checkpoint never mixes two steps.
* On a clean exit from ``managed_session`` (normal end, ``OutOfRangeError``, ``StopIteration``)
  the chief saves a last checkpoint at the current step, so a graceful stop loses nothing.
* A checkpoint at the same step as the last one written or restored is skipped.
* There is no graph: ``graph`` is the collections registry, and nothing like ``graph.pbtxt``
  or graph/meta-graph events is written.

With replicas (a process group of several ranks, e.g. under ``torchrun``) what happens depends
on the state (``docs/distributed.md``):

* a replicated state (DDP): the chief restores or initializes and broadcasts its state; only
  the chief checkpoints (in the background) and writes summaries;
* a sharded state (DTensors, e.g. FSDP2's ``fully_shard``): every rank restores its shards of
  the same checkpoint (or initializes them) and every rank writes its shard of each checkpoint,
  in parallel, at a step the ranks agree on through the process group's store
  (``sharded_service.py``). Such a save is synchronous: the training threads are blocked while
  the shards are written.

In both cases a stop requested on one rank stops every rank at the same step
(``replicas.StopAgreement``), and no collective runs on every step.

TF name: ``tf.compat.v1.train.Supervisor``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from tensorboard.compat.proto.event_pb2 import SessionLog

from torchsupervisor.checkpoint.recovery import clean_checkpoint_dir, restore_candidates
from torchsupervisor.checkpoint.saver import Saver
from torchsupervisor.checkpoint.sharded.collective import is_sharded
from torchsupervisor.core.checks import (
    check_bool,
    check_int,
    check_number,
    check_path,
    check_signals,
    check_state,
    check_str,
)
from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.coordinator import Coordinator, LooperThread
from torchsupervisor.core.global_step import GlobalStep, read_step
from torchsupervisor.core.registry import (
    USE_DEFAULT,
    Graph,
    GraphKeys,
    first_from_collection,
    get_default_graph,
    resolve_default,
)
from torchsupervisor.core.rng import RNGState
from torchsupervisor.core.session import Session
from torchsupervisor.core.variables import (
    global_variables_initializer,
    local_variables_initializer,
    report_uninitialized_variables,
)
from torchsupervisor.distributed import env as distributed
from torchsupervisor.distributed.replicas import ReplicaGroup, StopAgreement
from torchsupervisor.distributed.sharded_checkpoints import ShardedCheckpointService
from torchsupervisor.driver.preemption import (
    ABORT_SIGNALS,
    DEFAULT_PREEMPTION_SIGNALS,
    PreemptionHandler,
    final_checkpoint_failed,
)
from torchsupervisor.errors import (
    AbortedError,
    FailedPreconditionError,
    InvalidArgumentError,
    LogdirLockedError,
)
from torchsupervisor.storage import DirectoryLock, storage_for
from torchsupervisor.summary.ops import merge_all
from torchsupervisor.summary.writer import SERVICE_MAX_QUEUE, SummaryWriter
from torchsupervisor.supervisor.services import (
    CheckpointService,
    SVStepCounterThread,
    SVSummaryThread,
    SVTimerCheckpointThread,
)
from torchsupervisor.supervisor.session_manager import SessionManager

__all__ = ["Supervisor", "basic_train_loop"]

logger = logging.getLogger("torchsupervisor")


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
        state: Mapping of names to stateful objects: the training state.
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
        save_rng_state: Add ``state["rng"] = RNGState()`` (Python, NumPy, torch CPU and CUDA
            generators), so that a resumed run draws the same random numbers as an
            uninterrupted one. A checkpoint without it restores with a warning. With
            replicas each rank gets its own streams: the chief (rank 0) continues the saved
            ones, rank ``r`` gets generators seeded from the saved (or, with DDP, the chief's
            broadcast) state and ``r`` (``rng.rank_rng_state``); the non-chiefs' streams are
            then a fixed function of the checkpoint and the rank, not the continuation of an
            uninterrupted run's.
        clock: Time source (tests pass a fake one).

    Distributed: with replicas (``managed_session("env://")`` under ``torchrun``), every rank
    runs the same program with the same arguments and the same ``logdir`` (a shared
    directory). With a replicated state the chief restores, broadcasts its state and saves
    alone. With a sharded state (DTensors: FSDP2) every rank restores the same checkpoint
    (``Saver.restore`` is a collective; a corrupt checkpoint fails on every rank and all fall
    back to the same older one) or initializes its own shards (``init_op``, ``init_fn``);
    every ``save_model_secs`` the chief asks, through the process group's store, for a
    checkpoint that every rank then writes in parallel at one agreed step (the save blocks
    the training threads until it is committed); at a clean stop every rank writes the final
    checkpoint together, or none does (a rank whose session failed vetoes; the others wait
    at most ``stop_grace_secs`` for the votes). This needs a global step that grows by one
    per step and a step boundary (``sess.run`` or ``should_stop()``) between two steps.
    ``checkpoint()`` is then a collective. See ``docs/distributed.md``.

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
        ready_op: Any = USE_DEFAULT,
        ready_for_local_init_op: Any = USE_DEFAULT,
        is_chief: bool | None = None,
        init_op: Any = USE_DEFAULT,
        init_feed_dict: Mapping[str, Any] | None = None,
        local_init_op: Any = USE_DEFAULT,
        logdir: str | None = None,
        summary_op: Any = USE_DEFAULT,
        saver: Any = USE_DEFAULT,
        global_step: Any = USE_DEFAULT,
        save_summaries_secs: float = 120,
        save_model_secs: float = 600,
        recovery_wait_secs: float = 30,
        stop_grace_secs: float = 120,
        checkpoint_basename: str = "model.ckpt",
        session_manager: SessionManager | None = None,
        summary_writer: Any = USE_DEFAULT,
        init_fn: Any = None,
        local_init_run_options: Any = None,
        *,
        state: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        stop_on_checkpoint_error: bool = False,
        preemption_signals: Iterable[int] | None = DEFAULT_PREEMPTION_SIGNALS,
        preemption_grace_secs: float = 30.0,
        preemption_exit_code: int | None = None,
        save_rng_state: bool = True,
        clock: Clock | None = None,
    ) -> None:
        if is_chief is not None:
            is_chief = check_bool("is_chief", is_chief)
        logdir = check_path("logdir", logdir)
        save_summaries_secs = check_number(
            "save_summaries_secs", save_summaries_secs, allow_none=True
        )
        save_model_secs = check_number("save_model_secs", save_model_secs, allow_none=True)
        recovery_wait_secs = check_number(
            "recovery_wait_secs", recovery_wait_secs, positive=True, allow_inf=False
        )
        stop_grace_secs = check_number("stop_grace_secs", stop_grace_secs)
        check_str("checkpoint_basename", checkpoint_basename, allow_empty=False)
        check_state("state", state)
        if init_feed_dict is not None and not isinstance(init_feed_dict, Mapping):
            raise TypeError(f"init_feed_dict must be a mapping or None, got {init_feed_dict!r}")
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"init_fn must be callable or None, got {init_fn!r}")
        stop_on_checkpoint_error = check_bool("stop_on_checkpoint_error", stop_on_checkpoint_error)
        preemption_signals = check_signals("preemption_signals", preemption_signals)
        preemption_grace_secs = check_number("preemption_grace_secs", preemption_grace_secs)
        preemption_exit_code = check_int(
            "preemption_exit_code", preemption_exit_code, allow_none=True
        )
        save_rng_state = check_bool("save_rng_state", save_rng_state)
        if logdir and not state and saver is USE_DEFAULT:
            logger.warning(
                "Supervisor(logdir=%r) has no state=: its checkpoints hold only the global "
                "step, if any. TF saved every variable implicitly; pass the training state, e.g. "
                "state={'model': model, 'optimizer': optimizer, 'global_step': step}",
                logdir,
            )
        graph = graph or get_default_graph()
        self._stop_on_checkpoint_error = stop_on_checkpoint_error
        self._preemption = PreemptionHandler(preemption_signals or ())
        self._preemption_grace_secs = preemption_grace_secs
        self._preemption_exit_code = preemption_exit_code
        self._preemption_seen = False
        self._graph = graph
        self._clock = clock or REAL_CLOCK
        self._state: dict[str, Any] = dict(state or {})
        add_rng = save_rng_state and bool(self._state) and "rng" not in self._state
        if add_rng:
            self._state["rng"] = RNGState()
        # USE_DEFAULT arguments come from the graph's collections, else TF's defaults.
        self._ready_op = resolve_default(
            graph, ready_op, GraphKeys.READY_OP, report_uninitialized_variables
        )
        self._ready_for_local_init_op = resolve_default(
            graph, ready_for_local_init_op, GraphKeys.READY_FOR_LOCAL_INIT_OP
        )
        self._init_op = resolve_default(
            graph, init_op, GraphKeys.INIT_OP, global_variables_initializer
        )
        self._init_feed_dict = init_feed_dict
        self._local_init_op = resolve_default(
            graph, local_init_op, GraphKeys.LOCAL_INIT_OP, local_variables_initializer
        )
        self._init_global_step(graph, global_step)
        make_saver = (lambda: Saver(clock=self._clock)) if self._state else None
        self._saver = resolve_default(graph, saver, GraphKeys.SAVERS, make_saver)
        if add_rng and hasattr(self._saver, "allow_missing"):
            self._saver.allow_missing("rng")
        self._summary_op = resolve_default(graph, summary_op, GraphKeys.SUMMARY_OP, merge_all)
        if is_chief is None:
            is_chief = distributed.rank() == 0
        self._is_chief = bool(is_chief)
        self._coord = Coordinator(clock=self._clock)
        self._recovery_wait_secs = recovery_wait_secs
        self._generation = 0
        self._stop_agreement: StopAgreement | None = None
        # With a sharded state every replica restores and saves, so every rank keeps these
        # (the public properties stay None on non-chiefs, as in TF).
        self._replica_logdir = logdir or None
        self._replica_save_path = os.path.join(logdir, checkpoint_basename) if logdir else None
        self._replica_save_model_secs = save_model_secs
        self._sharded_replicas = False
        self._sharded_service: ShardedCheckpointService | None = None
        self._stop_grace_secs = stop_grace_secs
        self._init_fn = init_fn
        self._logdir: str | None = None
        self._save_summaries_secs: float | None = None
        self._save_model_secs: float | None = None
        self._save_path: str | None = None
        self._summary_writer: Any = None
        if is_chief:
            self._logdir = logdir or None
            self._save_summaries_secs = save_summaries_secs
            self._save_model_secs = save_model_secs
            if self._logdir:
                self._save_path = os.path.join(self._logdir, checkpoint_basename)
            if summary_writer is Supervisor.USE_DEFAULT:
                if self._logdir:
                    self._summary_writer = SummaryWriter(
                        self._logdir, max_queue=SERVICE_MAX_QUEUE, clock=self._clock
                    )
            else:
                self._summary_writer = summary_writer
        if session_manager is None:
            session_manager = SessionManager(
                local_init_op=self._local_init_op,
                ready_op=self._ready_op,
                ready_for_local_init_op=self._ready_for_local_init_op,
                graph=graph,
                recovery_wait_secs=recovery_wait_secs,
                local_init_run_options=local_init_run_options,
                state=self._state,
                device=device,
                clock=self._clock,
            )
        self._session_manager = session_manager
        self._logdir_lock: DirectoryLock | None = None
        self._lock_refused = False
        self._in_managed_session = False
        self._sess: Session | None = None
        self._checkpoint_service: CheckpointService | None = None

    # ------------------------------------------------------------- USE_DEFAULT resolution

    def _init_global_step(self, graph: Graph, global_step: Any) -> None:
        if global_step is Supervisor.USE_DEFAULT:
            global_step = self._state.get("global_step")
            if global_step is not None and not _is_int_step(global_step):
                logger.warning("Found 'global_step' is not an int type: %s", global_step)
                global_step = None
            if global_step is None:
                global_step = first_from_collection(graph, GraphKeys.GLOBAL_STEP)
            elif not any(v is global_step for v in graph.get_collection(GraphKeys.GLOBAL_STEP)):
                graph.add_to_collection(GraphKeys.GLOBAL_STEP, global_step)
        if global_step is not None and not any(v is global_step for v in self._state.values()):
            if "global_step" in self._state:
                raise ValueError(
                    "state['global_step'] is not the Supervisor's global_step; pass the same "
                    "object or rename the state entry"
                )
            self._state["global_step"] = global_step
        self._global_step = global_step

    # ------------------------------------------------------------------------ properties

    @property
    def is_chief(self) -> bool:
        """True if this is the chief supervisor.

        TF name: ``tf.compat.v1.train.Supervisor.is_chief``.
        """
        return self._is_chief

    @property
    def session_manager(self) -> SessionManager:
        """The ``SessionManager`` creating the sessions.

        TF name: ``tf.compat.v1.train.Supervisor.session_manager``.
        """
        return self._session_manager

    @property
    def coord(self) -> Coordinator:
        """The ``Coordinator`` of the services and of ``loop()`` threads.

        TF name: ``tf.compat.v1.train.Supervisor.coord``.
        """
        return self._coord

    @property
    def init_op(self) -> Any:
        """The init op.

        TF name: ``tf.compat.v1.train.Supervisor.init_op``.
        """
        return self._init_op

    @property
    def init_feed_dict(self) -> Mapping[str, Any] | None:
        """The keyword arguments of the init op.

        TF name: ``tf.compat.v1.train.Supervisor.init_feed_dict``.
        """
        return self._init_feed_dict

    @property
    def ready_op(self) -> Any:
        """The ready op.

        TF name: ``tf.compat.v1.train.Supervisor.ready_op``.
        """
        return self._ready_op

    @property
    def ready_for_local_init_op(self) -> Any:
        """The ready-for-local-init op.

        TF name: ``tf.compat.v1.train.Supervisor.ready_for_local_init_op``.
        """
        return self._ready_for_local_init_op

    @property
    def local_init_op(self) -> Any:
        """The local init op.

        TF name: ``tf.compat.v1.train.Supervisor.local_init_op``.
        """
        return self._local_init_op

    @property
    def summary_writer(self) -> Any:
        """The ``SummaryWriter`` (None on non-chiefs and without a logdir).

        TF name: ``tf.compat.v1.train.Supervisor.summary_writer``.
        """
        return self._summary_writer

    @property
    def summary_op(self) -> Any:
        """The summary op of the summary service.

        TF name: ``tf.compat.v1.train.Supervisor.summary_op``.
        """
        return self._summary_op

    @property
    def save_summaries_secs(self) -> float | None:
        """Seconds between summaries (None on non-chiefs).

        TF name: ``tf.compat.v1.train.Supervisor.save_summaries_secs``.
        """
        return self._save_summaries_secs

    @property
    def global_step(self) -> Any:
        """The global step, or None.

        TF name: ``tf.compat.v1.train.Supervisor.global_step``.
        """
        return self._global_step

    @property
    def saver(self) -> Any:
        """The ``Saver``, or None.

        TF name: ``tf.compat.v1.train.Supervisor.saver``.
        """
        return self._saver

    @property
    def save_model_secs(self) -> float | None:
        """Seconds between checkpoints (None on non-chiefs).

        TF name: ``tf.compat.v1.train.Supervisor.save_model_secs``.
        """
        return self._save_model_secs

    @property
    def save_path(self) -> str | None:
        """The checkpoint prefix without step (None on non-chiefs and without a logdir).

        TF name: ``tf.compat.v1.train.Supervisor.save_path``.
        """
        return self._save_path

    @property
    def state(self) -> Mapping[str, Any]:
        """The state the sessions are created over (includes the global step).

        TF name: none (TF's variables lived in the graph).
        """
        return self._state

    # --------------------------------------------------------------------------- sessions

    def prepare_or_wait_for_session(
        self,
        master: str = "",
        config: Any = None,
        wait_for_checkpoint: bool = False,
        max_wait_secs: float = 7200,
        start_standard_services: bool = True,
    ) -> Session:
        """Create a session whose state is restored or initialized, and start the services.

        The chief restores the newest valid checkpoint of ``logdir`` (or runs ``init_op`` and
        ``init_fn``) and starts the standard services; a non-chief waits until the state is
        ready. Both start the queue runners when ``start_standard_services``.

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
                per log directory; the lock is released when that process ends).
            FailedPreconditionError: (Sharded state) if the ranks see different checkpoints
                or resumed from different ones, or another rank failed to prepare.

        TF name: ``Supervisor.prepare_or_wait_for_session``.
        """
        self._lock_refused = False
        if self._is_chief and self._logdir and self._logdir_lock is None:
            storage = storage_for(self._logdir)
            storage.makedirs(self._logdir)
            try:
                self._logdir_lock = storage.lock(self._logdir)  # One writer per logdir.
            except LogdirLockedError:
                self._lock_refused = True  # stop() then writes nothing into the logdir.
                raise
        self._coord.clear_stop()
        if self._summary_writer is not None:
            self._summary_writer.reopen()
        distributed.connect(master, timeout_secs=max_wait_secs)
        replicas = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if self._is_chief != (dist.get_rank() == 0):
                raise InvalidArgumentError(
                    f"With replicas the chief is rank 0; this is rank {dist.get_rank()} with "
                    f"is_chief={self._is_chief}"
                )
            self._generation += 1
            replicas = ReplicaGroup(self._generation)
        self._sharded_replicas = replicas is not None and is_sharded(self._state)
        if replicas is not None and self._sharded_replicas:
            sess = self._prepare_sharded(
                replicas, master, config, wait_for_checkpoint, max_wait_secs
            )
            self._sess = sess
            self._stop_agreement = StopAgreement(replicas, self._global_step)
            if (
                start_standard_services
                and self._saver is not None
                and self._replica_save_model_secs
                and self._replica_save_path
            ):
                self._sharded_service = ShardedCheckpointService(
                    sess,
                    self._saver,
                    self._replica_save_path,
                    self._global_step,
                    replicas,
                    writer=self._summary_writer,
                    on_error=self._stop_on_error if self._stop_on_checkpoint_error else None,
                )
                self._sharded_service.start()
            if self._is_chief and start_standard_services:
                logger.info("Starting standard services.")
                self.start_standard_services(sess)
        elif replicas is not None and not self._is_chief:
            info = replicas.wait_ready(self._recovery_wait_secs, max_wait_secs, clock=self._clock)
            sess = self._session_manager.wait_for_session(
                master, config=config, max_wait_secs=max_wait_secs
            )
            replicas.broadcast_state(sess.state)
            sess.restored_checkpoint = info.get("checkpoint")
            self._sess = sess
            self._stop_agreement = StopAgreement(replicas, self._global_step)
        elif self._is_chief:
            if self._logdir:
                clean_checkpoint_dir(self._logdir)
            sess = self._session_manager.prepare_session(
                master,
                init_op=self._init_op,
                saver=self._saver,
                checkpoint_dir=self._logdir,
                wait_for_checkpoint=wait_for_checkpoint,
                max_wait_secs=max_wait_secs,
                config=config,
                init_feed_dict=self._init_feed_dict,
                init_fn=self._init_fn,
            )
            self._sess = sess
            if replicas is not None:
                replicas.publish_ready(
                    {
                        "checkpoint": sess.restored_checkpoint,
                        "step": None if self._global_step is None else self._current_step(),
                    }
                )
                replicas.broadcast_state(sess.state)
                self._stop_agreement = StopAgreement(replicas, self._global_step)
            if start_standard_services:
                logger.info("Starting standard services.")
                self.start_standard_services(sess)
        else:
            sess = self._session_manager.wait_for_session(
                master, config=config, max_wait_secs=max_wait_secs
            )
            self._sess = sess
        if start_standard_services:
            logger.info("Starting queue runners.")
            self.start_queue_runners(sess)
        return sess

    def _prepare_sharded(
        self,
        replicas: ReplicaGroup,
        master: str,
        config: Any,
        wait_for_checkpoint: bool,
        max_wait_secs: float,
    ) -> Session:
        """Every rank restores its shards of the same checkpoint, or initializes them.

        The chief first cleans what a crash left in the logdir; the others wait for that
        (``recovery_wait_secs`` polling, ``max_wait_secs``). Every rank then lists the
        checkpoints it would try; the lists must be equal (a logdir that is not shared, or a
        save racing the start, is an error on every rank). Every rank then goes through the
        SessionManager: ``Saver.restore`` is a collective whose errors reach every rank, so a
        corrupt checkpoint makes every rank fall back to the same older one. With nothing to
        restore, each rank runs ``init_op`` and ``init_fn`` on its own shards. At the end the
        ranks check that they resumed from the same checkpoint at the same step.
        """
        logdir = self._replica_logdir
        if self._is_chief:
            if logdir:
                clean_checkpoint_dir(logdir)
            replicas.publish_ready({}, name="restore/open")
        else:
            replicas.wait_ready(
                self._recovery_wait_secs, max_wait_secs, name="restore/open", clock=self._clock
            )
        candidates = restore_candidates(logdir) if logdir and self._saver is not None else []
        _agree(
            replicas,
            "restore/candidates",
            {"logdir": bool(logdir), "candidates": [os.path.basename(c) for c in candidates]},
            max_wait_secs,
            what="the checkpoints to restore from (is the logdir shared by every replica?)",
        )
        try:
            sess = self._session_manager.prepare_session(
                master,
                init_op=self._init_op,
                saver=self._saver,
                checkpoint_dir=logdir,
                wait_for_checkpoint=wait_for_checkpoint,
                max_wait_secs=max_wait_secs,
                config=config,
                init_feed_dict=self._init_feed_dict,
                init_fn=self._init_fn,
            )
        except Exception as e:
            replicas.raise_flag("restore/failed", f"rank {replicas.rank}: {type(e).__name__}: {e}")
            raise
        restored = sess.restored_checkpoint
        _agree(
            replicas,
            "restore/result",
            {
                "checkpoint": os.path.basename(restored) if restored else None,
                "step": None if self._global_step is None else self._current_step(),
            },
            max_wait_secs,
            what="the resume point",
            abort="restore/failed",
        )
        return sess

    def start_standard_services(self, sess: Session) -> list[LooperThread] | None:
        """Start the summary, step-counter and checkpoint services for ``sess``.

        Writes a ``SessionLog.START`` event at the current step first (TensorBoard then drops
        the points a crashed run wrote after its last checkpoint).

        Returns:
            The started threads, or None (with a warning) when there is no logdir.

        Raises:
            RuntimeError: On a non-chief (TF's text).

        TF name: ``Supervisor.start_standard_services``.
        """
        if not self._is_chief:
            raise RuntimeError(
                "Only chief supervisor can start standard services. Because only chief "
                "supervisors can write events."
            )
        if not self._logdir:
            logger.warning("Standard services need a 'logdir' passed to the SessionManager")
            return None
        writer = self._summary_writer
        if self._global_step is not None and writer is not None:
            writer.add_session_log(SessionLog(status=SessionLog.START), self._current_step())
        threads: list[LooperThread] = []
        if self._save_summaries_secs and writer is not None:
            if self._summary_op is not None:
                threads.append(
                    SVSummaryThread(
                        self._coord,
                        self._save_summaries_secs,
                        sess,
                        self._summary_op,
                        self._global_step,
                        writer,
                    )
                )
            if self._global_step is not None:
                threads.append(
                    SVStepCounterThread(
                        self._coord, self._save_summaries_secs, self._global_step, writer
                    )
                )
        if self._sharded_replicas:
            # Every rank takes part in a sharded checkpoint: the chief's timer only asks.
            if self._sharded_service is not None and self._save_model_secs:
                threads.append(self._sharded_service.timer(self._coord, self._save_model_secs))
            elif self._saver is not None and self._save_model_secs and self._save_path:
                logger.warning(
                    "Sharded checkpoints need start_standard_services=True when the session "
                    "is prepared on every replica; no periodic checkpoints"
                )
        elif self._saver is not None and self._save_model_secs and self._save_path:
            self._checkpoint_service = CheckpointService(
                sess,
                self._saver,
                self._save_path,
                self._global_step,
                writer,
                on_error=self._stop_on_error if self._stop_on_checkpoint_error else None,
            )
            threads.append(
                SVTimerCheckpointThread(
                    self._coord, self._save_model_secs, self._checkpoint_service
                )
            )
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
            queue_runners = self._graph.get_collection(GraphKeys.QUEUE_RUNNERS)
        threads = []
        for runner in queue_runners:
            threads.extend(runner.create_threads(sess, coord=self._coord, daemon=True, start=True))
        return threads

    @contextlib.contextmanager
    def managed_session(
        self,
        master: str = "",
        config: Any = None,
        start_standard_services: bool = True,
        close_summary_writer: bool = True,
    ) -> Iterator[Session]:
        """A context manager giving a ready session, stopping everything cleanly at exit.

        Exceptions raised in the block or by a service are re-raised when the block exits,
        after the services stopped; ``OutOfRangeError`` and ``StopIteration`` end training
        cleanly and are not re-raised. On a clean exit the chief first saves a final
        checkpoint at the current step (when the checkpoint service runs).

        Distributed: a stop on one rank stops every rank at the same step; a rank that leaves
        the block with an error records ``"<ErrorType>: <message>"`` in the store and the
        other ranks log it (``"Every rank stops: rank R: ..."``), so the root cause appears
        next to their own errors. With a sharded state every rank saves the final checkpoint,
        together or not at all: a rank that leaves the block with an error vetoes at once, and
        the others wait at most ``stop_grace_secs`` (or what is left of
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
        self._preemption_seen = False
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
            if self._stop_agreement is not None:
                if not clean_exit:
                    # The other ranks log this reason: the root cause of their own errors.
                    self._stop_agreement.request(
                        "error" if failure is None else f"{type(failure).__name__}: {failure}"
                    )
                self._stop_agreement.close()
                self._stop_agreement = None
            try:
                final_error: BaseException | None = None
                try:
                    if self._sharded_service is not None:
                        final_error = self._final_sharded_checkpoint(clean_exit)
                    elif clean_exit:
                        final_error = self._final_checkpoint()
                    if final_error is None and clean_exit:
                        final_error = self._preemption_outcome()
                finally:
                    self.stop(close_summary_writer=close_summary_writer)
                if final_error is not None:
                    raise final_error
            finally:
                self._checkpoint_service = None
                self._sharded_service = None
                self._sharded_replicas = False
                self._sess = None
                self._in_managed_session = False
                self._preemption.uninstall()
                if sess is not None:
                    try:
                        sess.close()
                    except Exception:
                        pass
        if self._preemption.received is not None and self._preemption_exit_code is not None:
            raise SystemExit(self._preemption_exit_code)

    def _stop_on_error(self, error: BaseException) -> None:
        self._coord.request_stop((type(error), error, error.__traceback__))

    def _final_checkpoint(self) -> Exception | None:
        """Save the last checkpoint after the block ended cleanly; return (not raise) a failure.

        Nothing is saved when a service or thread reported an error: the state may then be
        the half-updated state of an interrupted step.
        """
        service = self._checkpoint_service
        if service is None:
            return None
        try:
            self._coord.raise_requested_exception()
        except BaseException:
            return None  # Not a clean exit: the state may be in the middle of a step.
        budget = self._preemption_grace_secs if self._preemption.received is not None else None
        try:
            service.save_now(timeout_secs=budget)
        except Exception as e:
            logger.error("The final checkpoint failed: %s", e)
            return e
        return None

    def _preemption_outcome(self) -> SystemExit | None:
        """After a preemption stop: the exit to raise if its final checkpoint is missing.

        The final checkpoint must be at the step training stopped at; if it is not (the
        save failed, or did not finish within ``preemption_grace_secs``), one line says so,
        naming the last committed checkpoint, and the process must exit non-zero.
        """
        signal_name = self._preemption.describe()
        service = self._checkpoint_service or self._sharded_service
        if not signal_name or service is None or self._global_step is None:
            return None
        try:
            self._coord.raise_requested_exception()
        except BaseException:
            return None  # An error is raised instead.
        step = self._current_step()
        if service.last_step == step:
            return None
        reason = getattr(service, "last_error", None) or "it was not written"
        return final_checkpoint_failed(
            signal_name,
            step,
            service.last_step,
            getattr(service, "last_prefix", None),
            reason,
            self._preemption_exit_code,
        )

    def _final_sharded_checkpoint(self, clean_exit: bool) -> Exception | None:
        """Every rank saves the last checkpoint together, or none does; never hangs.

        A rank whose block failed, or whose threads reported an error, vetoes (its state may
        be in the middle of a step); the others then skip at once. Otherwise every rank votes
        and waits at most ``stop_grace_secs`` (or what is left of a preemption's grace period)
        for the others.
        """
        service = self._sharded_service
        assert service is not None
        reason = None if clean_exit else "its session ended with an error"
        if reason is None:
            try:
                self._coord.raise_requested_exception()
            except BaseException as e:
                reason = f"a thread failed: {type(e).__name__}: {e}"
        if reason is not None:
            service.veto(reason)
            return None
        budget = self._preemption_grace_secs if self._preemption.received is not None else None
        try:
            service.final(self._stop_grace_secs, budget)
        except Exception as e:
            logger.error("The final checkpoint failed: %s", e)
            return e
        return None

    def checkpoint(self) -> str | None:
        """Save a checkpoint now, at the current step, and wait until it is committed.

        Call it from the training thread between steps. Skipped (returns None) when the
        step did not move since the last checkpoint.

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
        if self._sharded_service is not None:
            if self._sess is not None and threading.get_ident() != self._sess.boundary.owner_ident:
                raise RuntimeError(
                    "checkpoint() must be called from the training thread (the thread that "
                    "created the session), between steps"
                )
            return self._sharded_service.save_now()
        if self._checkpoint_service is None:
            raise RuntimeError("checkpoint() needs a running checkpoint service on the chief")
        if self._sess is not None and threading.get_ident() != self._sess.boundary.owner_ident:
            raise RuntimeError(
                "checkpoint() must be called from the training thread (the thread that created "
                "the session), between steps"
            )
        return self._checkpoint_service.save_now()

    def stop(
        self,
        threads: list[Any] | None = None,
        close_summary_writer: bool = True,
        ignore_live_threads: bool = False,
    ) -> None:
        """Stop the services and join their threads; does not close the session.

        Args:
            threads: Extra threads to join besides the registered ones.
            close_summary_writer: Write ``SessionLog.STOP`` and close the writer.
            ignore_live_threads: Log, instead of raising, threads still alive after the
                grace period.

        Raises:
            Exception: The first exception reported to the coordinator, or RuntimeError
                naming the threads that would not stop.

        TF name: ``Supervisor.stop``.
        """
        self._coord.request_stop()
        try:
            self._coord.join(
                threads,
                stop_grace_period_secs=self._stop_grace_secs,
                ignore_live_threads=ignore_live_threads,
            )
        finally:
            if self._checkpoint_service is not None:
                if self._preemption.aborted:  # A second Ctrl-C: abandon, do not wait.
                    self._checkpoint_service.abandon(timeout_secs=5.0)
                self._checkpoint_service.wait()
                self._saver.close()  # No idle writer thread outlives the session.
            if self._sharded_service is not None:
                self._sharded_service.close()
                self._sharded_service = None
            if close_summary_writer and self._summary_writer is not None:
                if not self._lock_refused:  # Another process's logdir: not a word in it.
                    self._summary_writer.add_session_log(SessionLog(status=SessionLog.STOP))
                self._summary_writer.close()
            if self._logdir_lock is not None:
                self._logdir_lock.release()
                self._logdir_lock = None

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
        if sess is not None and sess.boundary.pending:
            sess.boundary.run_pending()
        if self._preemption.received is not None and not self._preemption_seen:
            self._on_preemption()
        agreement = self._stop_agreement
        if agreement is None:
            return self._coord.should_stop()
        return self._agreed_stop(agreement)

    def _agreed_stop(self, agreement: StopAgreement) -> bool:
        """With replicas: stop when every rank has completed the agreed number of steps."""
        if self._coord.should_stop():
            agreement.request(self._preemption.describe() or "stop requested")
        if not agreement.pending:
            return False
        stop_at = agreement.stop_step()
        if stop_at is None or self._global_step is None or self._current_step() >= stop_at:
            self._coord.request_stop()
            return True
        return False

    def _on_preemption(self) -> None:
        self._preemption_seen = True
        step = self._current_step() if self._global_step is not None else None
        logger.warning(
            "Received %s: stopping at step %s%s%s",
            self._preemption.describe(),
            step,
            " with a final checkpoint"
            if self._checkpoint_service is not None or self._sharded_service is not None
            else "",
            " (press Ctrl-C again to abort at once)"
            if self._preemption.received in ABORT_SIGNALS
            else "",
        )
        self._coord.request_stop()

    @property
    def preempted(self) -> str | None:
        """The name of the preemption signal that stopped the last session (or None).

        TF name: none (TF did not handle preemption signals).
        """
        return self._preemption.describe() or None

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
        target: Any,
        args: Any = None,
        kwargs: Any = None,
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

    def summary_computed(self, sess: Any, summary: Any, global_step: Any = None) -> None:
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
        if self._summary_writer is None:
            raise RuntimeError("Writing a summary requires a summary writer.")
        if global_step is None and self._global_step is not None:
            global_step = self._current_step()
        self._summary_writer.add_summary(summary, global_step)

    def _current_step(self) -> int:
        return read_step(self._global_step)

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


def _is_int_step(value: Any) -> bool:
    if isinstance(value, GlobalStep):
        return True
    return isinstance(value, torch.Tensor) and not (
        value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool
    )


def _agree(
    replicas: ReplicaGroup,
    name: str,
    value: Any,
    timeout_secs: float,
    *,
    what: str,
    abort: str | None = None,
) -> None:
    """Post ``value`` and check that every rank posted the same; raise on every rank if not.

    Raises:
        FailedPreconditionError: If the ranks posted different values (all of them listed),
            or (``ReplicaAbort``) if a rank raised the ``abort`` flag.
        DeadlineExceededError: If a rank did not post within ``timeout_secs``.
    """
    replicas.post(name, value)
    values = replicas.gather(name, timeout_secs, what=f"Agreeing on {what}", abort=abort)
    if any(v != values[0] for v in values):
        listed = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise FailedPreconditionError(None, None, f"The replicas disagree on {what}: {listed}")


def basic_train_loop(
    supervisor: Supervisor,
    train_step_fn: Any,
    args: Any = None,
    kwargs: Any = None,
    master: str = "",
) -> None:
    """Run ``train_step_fn(sess, *args, **kwargs)`` until the supervisor stops.

    An ``AbortedError`` restarts the managed session (restoring the last checkpoint) and the
    loop continues.

    TF name: ``tf.compat.v1.train.basic_train_loop``.
    """
    args = args or []
    kwargs = kwargs or {}
    should_retry = True
    while should_retry:
        try:
            should_retry = False
            with supervisor.managed_session(master) as sess:
                while not supervisor.should_stop():
                    train_step_fn(sess, *args, **kwargs)
        except AbortedError:
            should_retry = True
