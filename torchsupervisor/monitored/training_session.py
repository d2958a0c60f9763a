"""``MonitoredTrainingSession``: TF's one-call MonitoredSession with the standard hooks.

It creates the session creator (chief or worker), adds the standard hooks by its arguments
(``StepCounterHook``, ``SummarySaverHook``, ``CheckpointSaverHook``) and the RNG state to the
state, and returns a ``MonitoredSession``.

TF name: ``tf.compat.v1.train.MonitoredTrainingSession``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchsupervisor.checkpoint.sharded.plan import is_sharded
from torchsupervisor.core import checks
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.registry import USE_DEFAULT
from torchsupervisor.core.rng import RNGState
from torchsupervisor.core.training_state import TrainingState
from torchsupervisor.distributed import env as distributed
from torchsupervisor.driver.preemption import DEFAULT_PREEMPTION_SIGNALS
from torchsupervisor.driver.preemption_sources import PreemptionSource, check_sources
from torchsupervisor.driver.requeue import SlurmRequeue, check_requeue
from torchsupervisor.errors import InvalidArgumentError
from torchsupervisor.hooks.checkpoint_saver import CheckpointSaverHook
from torchsupervisor.hooks.session_run_hook import SessionRunHook
from torchsupervisor.hooks.sharded_checkpoint_saver import ShardedCheckpointSaverHook
from torchsupervisor.hooks.step_counter import StepCounterHook
from torchsupervisor.hooks.summary_saver import SummarySaverHook
from torchsupervisor.hooks.system_metrics import SystemMetricsHook
from torchsupervisor.monitored.creators import ChiefSessionCreator, WorkerSessionCreator
from torchsupervisor.monitored.scaffold import Scaffold, check_scaffold
from torchsupervisor.monitored.session import MonitoredSession
from torchsupervisor.monitored.sharded_creator import ShardedSessionCreator
from torchsupervisor.tiers.memory import MemoryTierConfig

__all__ = ["USE_DEFAULT", "MonitoredTrainingSession"]

logger = logging.getLogger("torchsupervisor")


def MonitoredTrainingSession(
    master: str = "",
    is_chief: bool | None = None,
    checkpoint_dir: str | None = None,
    scaffold: Scaffold | None = None,
    hooks: Iterable[SessionRunHook] | None = None,
    chief_only_hooks: Iterable[SessionRunHook] | None = None,
    save_checkpoint_secs: Any = USE_DEFAULT,
    save_summaries_steps: Any = USE_DEFAULT,
    save_summaries_secs: Any = USE_DEFAULT,
    config: object = None,
    stop_grace_period_secs: float = 120,
    log_step_count_steps: int | None = 100,
    max_wait_secs: float = 7200,
    save_checkpoint_steps: Any = USE_DEFAULT,
    summary_dir: str | None = None,
    save_graph_def: bool = True,
    *,
    state: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
    clock: Clock | None = None,
    save_rng_state: bool = True,
    preemption_signals: Iterable[int] | None = DEFAULT_PREEMPTION_SIGNALS,
    preemption_grace_secs: float = 30.0,
    preemption_exit_code: int | None = None,
    preemption_sources: Iterable[PreemptionSource] | str | None = "auto",
    preemption_requeue: SlurmRequeue | str | None = "auto",
    system_metrics_secs: float | None = None,
    stop_on_checkpoint_error: bool = False,
    memory_tier: MemoryTierConfig | None = None,
) -> MonitoredSession:
    """Create a ``MonitoredSession`` for training, with the standard hooks on the chief.

    The chief restores the newest valid checkpoint of ``checkpoint_dir`` (or initializes) and
    runs, in this order: ``chief_only_hooks``; if ``summary_dir`` (default ``checkpoint_dir``)
    is set, ``StepCounterHook(every_n_steps=log_step_count_steps)`` when that is > 0 and
    ``SummarySaverHook`` when summaries are enabled; ``CheckpointSaverHook`` when
    ``checkpoint_dir`` is set and checkpoints are enabled; then ``hooks``. A non-chief waits
    for a ready state and runs ``hooks`` only. With a sharded state (FSDP2, under a process
    group) every rank restores its shards of one checkpoint and saves them with the others
    (``ShardedSessionCreator``, a ``ShardedCheckpointSaverHook`` on every rank); the other
    standard hooks stay the chief's. The session is created here: the restore (or
    initialization) happens before this function returns.

    For an exact continuation after a restart, the state gets an ``RNGState`` under ``"rng"``
    (the Python, NumPy, torch CPU and CUDA generators), as the Supervisor's does; a
    preemption signal stops training with a final checkpoint (see ``MonitoredSession``).

    Args:
        master: ``""`` for an in-process session; ``"env://"`` (under ``torchrun``) or a
            ``Server.target`` to join a process group.
        is_chief: The chief initializes/restores and saves; others wait, then start from the
            chief's state (broadcast). None (TF's default is True): the replica of rank 0 is
            the chief (rank from the process group, else ``$RANK`` as set by ``torchrun``,
            else 0), as for the Supervisor.
        checkpoint_dir: Directory to restore from and save checkpoints to; also where every
            rank of a process group (the chief alone otherwise) keeps its goodput ledger
            (``goodput/``: ``torchsupervisor goodput``).
        scaffold: The ``Scaffold``; None: a default one.
        hooks: Hooks of every replica, after the standard ones.
        chief_only_hooks: Hooks of the chief only, before the standard ones.
        save_checkpoint_secs: Seconds between checkpoints; when neither this nor
            ``save_checkpoint_steps`` is given: 600. 0 or None (with no steps): none.
        save_summaries_steps: Steps between summaries; when neither this nor
            ``save_summaries_secs`` is given: 100. 0 or None (with no secs): none.
        save_summaries_secs: Seconds between summaries.
        config: Passed to the session.
        stop_grace_period_secs: Seconds the threads get to stop at ``close()``.
        log_step_count_steps: Steps between ``global_step/sec`` summaries (0 or None: none).
        max_wait_secs: The longest wait of a non-chief for a ready state, in seconds.
        save_checkpoint_steps: Steps between checkpoints.
        summary_dir: Directory of the summaries; None: ``checkpoint_dir``.
        save_graph_def: Accepted for TF compatibility; there is no graph to write.
        state: The training state (a mapping of names to stateful objects: modules,
            optimizers, a ``GlobalStep``, ...), as ``Supervisor(state=...)``.
        device: Where the init op materializes meta-device modules.
        clock: Time source of the standard hooks' timers and of waits.
        save_rng_state: Save an ``RNGState()`` as ``"rng"`` (beside the given state, or the
            scaffold's) when the state is not empty and has no ``"rng"`` entry, so that a
            resumed run draws the same random numbers as an uninterrupted one. A checkpoint
            without it (from an older run) restores with a warning. False: leave the state
            as given.
        preemption_signals: Signals that stop training cleanly with a final checkpoint
            (default SIGTERM, SIGUSR1 and SIGINT for Ctrl-C; empty or None:
            none); see ``MonitoredSession``.
        preemption_grace_secs: Time budget of the final checkpoint after a preemption signal,
            in seconds; a save that cannot finish in time is cancelled cleanly.
        preemption_exit_code: If set, leaving the session's ``with`` block after a preemption
            signal raises ``SystemExit`` with this code, once everything is saved and closed;
            None: exit normally (status 0).
        preemption_sources: What else announces a stop (SLURM's time limit, a cloud's spot
            or preemption notice): ``"auto"`` (those that apply to this machine), a list of
            sources, or None (signals only); see ``Supervisor``.
        preemption_requeue: Requeue the SLURM job after a stop by SIGUSR1/SIGUSR2 or its time
            limit (``"auto"``: inside a SLURM job; None: never); see ``Supervisor``.
        system_metrics_secs: On the chief with a ``summary_dir``, write the ``system/*``
            metrics (CPU, memory, disk, network, GPUs) every this many seconds
            (``SystemMetricsHook``); None (the default): none.
        stop_on_checkpoint_error: TF's behaviour: a checkpoint that cannot be written stops
            training with its ``CheckpointSaveError`` (from the step that sees it). False
            (the default, for days-long runs): it is logged and reported in the events file,
            and training goes on to the next save (``CheckpointSaverHook``).
        memory_tier: Keep the newest snapshots in host memory as well, every
            ``memory_tier.every_n_steps`` steps (the chief; ``checkpoint_dir`` needed): see
            ``Supervisor``'s argument of the same name. Under DDP the other ranks then send
            their random streams to the chief at every step, so that its snapshots resume
            every rank bitwise (``distributed/replica_streams``). With a sharded state every
            rank keeps its own shards (``ShardedSessionCreator``). None: off.

    Returns:
        A ``MonitoredSession`` (recovering from preemption errors).

    Raises:
        ValueError: If ``state`` differs from a state the scaffold already has; for an
            argument out of range (naming it and the value).
        TypeError: For an argument of the wrong type (naming it and the value).
        LogdirLockedError: (Chief) another process is writing to ``checkpoint_dir``.
        RuntimeError: From the hooks' ``begin()`` when there is no global step (``"Global
            step should be created to use StepCounterHook."``, ... ``SummarySaverHook``,
            ... ``CheckpointSaverHook``); from ``Scaffold.finalize`` when a collection holds
            more than one item for a field; when the init op does not make the state ready
            (``SessionManager``'s texts).
        DataLossError: If ``checkpoint_dir`` holds checkpoints and none is valid.
        NotFoundError: If an entry of the state is missing from the checkpoint restored
            (other than the ``"rng"`` entry added here).
        InvalidArgumentError: If a value of the checkpoint does not fit its state entry;
            with a sharded state, if ``is_chief`` is given and is not ``rank == 0``.
        DeadlineExceededError: On a non-chief, if the state is not ready after
            ``max_wait_secs`` (``"Session was not ready after waiting %d secs."``).
        Exception: What the given hooks' ``begin`` and ``after_create_session`` raise.

    Thread safety: use the session from one (training) thread.

    TF name: ``tf.compat.v1.train.MonitoredTrainingSession``.
    """
    del save_graph_def
    built = _Build(**locals())  # Exactly the arguments: nothing else is defined yet.
    if built.sharded():
        return built.sharded_session()
    return built.chief_session() if built.is_chief else built.worker_session()


@dataclass
class _Build:
    """``MonitoredTrainingSession``'s arguments, checked, with TF's defaults resolved."""

    master: str
    is_chief: bool | None
    checkpoint_dir: str | None
    scaffold: Scaffold | None
    hooks: Iterable[SessionRunHook] | None
    chief_only_hooks: Iterable[SessionRunHook] | None
    save_checkpoint_secs: float | None
    save_summaries_steps: int | None
    save_summaries_secs: float | None
    config: object
    stop_grace_period_secs: float
    log_step_count_steps: int | None
    max_wait_secs: float
    save_checkpoint_steps: int | None
    summary_dir: str | None
    state: Mapping[str, Any] | None
    device: torch.device | str | None
    clock: Clock | None
    save_rng_state: bool
    preemption_signals: Iterable[int] | None
    preemption_grace_secs: float
    preemption_exit_code: int | None
    preemption_sources: Iterable[PreemptionSource] | str | None
    preemption_requeue: SlurmRequeue | str | None
    system_metrics_secs: float | None
    stop_on_checkpoint_error: bool
    memory_tier: MemoryTierConfig | None

    def __post_init__(self) -> None:
        self._check()
        self._resolve_intervals()
        self.scaffold = self.scaffold or Scaffold(clock=self.clock)
        self.rng_added = False
        if self.save_rng_state:
            self.state, self.rng_added = _with_rng_state(self.scaffold, self.state)

    def _check(self) -> None:
        """Raise ``TypeError``/``ValueError`` naming an argument of the wrong type or range."""
        is_chief = self.is_chief
        self.is_chief = (
            distributed.rank() == 0 if is_chief is None else checks.check_bool("is_chief", is_chief)
        )
        self.checkpoint_dir = checks.check_path("checkpoint_dir", self.checkpoint_dir)
        self.summary_dir = checks.check_path("summary_dir", self.summary_dir)
        check_scaffold(
            self.scaffold,
            ": the positional order is TF's (master, is_chief, checkpoint_dir, scaffold, hooks, "
            "chief_only_hooks, save_checkpoint_secs, ...)",
        )
        self.hooks = checks.check_hooks("hooks", self.hooks)
        self.chief_only_hooks = checks.check_hooks("chief_only_hooks", self.chief_only_hooks)
        for name in ("save_checkpoint_secs", "save_summaries_secs"):
            if getattr(self, name) is not USE_DEFAULT:
                checks.check_number(name, getattr(self, name), allow_none=True)
        for name in ("save_checkpoint_steps", "save_summaries_steps"):
            if getattr(self, name) is not USE_DEFAULT:
                checks.check_int(name, getattr(self, name), allow_none=True)
        checks.check_int(
            "log_step_count_steps", self.log_step_count_steps, minimum=None, allow_none=True
        )
        checks.check_number("stop_grace_period_secs", self.stop_grace_period_secs)
        checks.check_number("max_wait_secs", self.max_wait_secs)
        checks.check_state("state", self.state)
        self.save_rng_state = checks.check_bool("save_rng_state", self.save_rng_state)
        checks.check_signals("preemption_signals", self.preemption_signals)
        checks.check_number("preemption_grace_secs", self.preemption_grace_secs)
        checks.check_int("preemption_exit_code", self.preemption_exit_code, allow_none=True)
        self.preemption_sources = check_sources("preemption_sources", self.preemption_sources)
        self.preemption_requeue = check_requeue("preemption_requeue", self.preemption_requeue)
        checks.check_number(
            "system_metrics_secs", self.system_metrics_secs, positive=True, allow_none=True
        )
        self.stop_on_checkpoint_error = checks.check_bool(
            "stop_on_checkpoint_error", self.stop_on_checkpoint_error
        )

    def _resolve_intervals(self) -> None:
        """TF's defaults: summaries every 100 steps and checkpoints every 600 s when neither
        interval of each is given; one given turns the other off."""
        steps, secs = self.save_summaries_steps, self.save_summaries_secs
        if steps is USE_DEFAULT and secs is USE_DEFAULT:
            steps, secs = 100, None
        self.save_summaries_steps = None if steps is USE_DEFAULT else steps
        self.save_summaries_secs = None if secs is USE_DEFAULT else secs
        steps, secs = self.save_checkpoint_steps, self.save_checkpoint_secs
        if steps is USE_DEFAULT and secs is USE_DEFAULT:
            steps, secs = None, 600
        self.save_checkpoint_steps = None if steps is USE_DEFAULT else steps
        self.save_checkpoint_secs = None if secs is USE_DEFAULT else secs

    def _session(
        self, creator: ChiefSessionCreator | WorkerSessionCreator, hooks: list[SessionRunHook]
    ) -> MonitoredSession:
        return MonitoredSession(
            session_creator=creator,
            hooks=hooks,
            stop_grace_period_secs=self.stop_grace_period_secs,
            preemption_signals=self.preemption_signals,
            preemption_grace_secs=self.preemption_grace_secs,
            preemption_exit_code=self.preemption_exit_code,
            preemption_sources=self.preemption_sources,
            preemption_requeue=self.preemption_requeue,
        )

    def worker_session(self) -> MonitoredSession:
        """A non-chief's: waits for a ready state; runs ``hooks`` only."""
        creator = WorkerSessionCreator(
            self.scaffold,
            self.master,
            self.config,
            self.max_wait_secs,
            state=self.state,
            device=self.device,
            clock=self.clock,
            # Every rank of a process group keeps its ledger in the run's directory; an
            # evaluator alone only reads the run.
            goodput_dir=self.checkpoint_dir if distributed.world_size() > 1 else None,
        )
        return self._session(creator, list(self.hooks or []))

    def chief_session(self) -> MonitoredSession:
        """The chief's: ``chief_only_hooks``, the standard hooks, then ``hooks``."""
        creator = ChiefSessionCreator(
            self.scaffold,
            self.master,
            self.config,
            self.checkpoint_dir,
            state=self.state,
            device=self.device,
            clock=self.clock,
            memory_tier=self.memory_tier,
        )
        if self.rng_added:
            creator.allow_missing("rng")  # Checkpoints of runs that did not save it.
        hooks = [*(self.chief_only_hooks or []), *self._standard_hooks(), *(self.hooks or [])]
        return self._session(creator, hooks)

    def sharded(self) -> bool:
        """Whether the state is sharded (its modules hold DTensors: FSDP2), with a process
        group: every rank restores and saves its own shards, together."""
        state = self.state if self.state is not None else self.scaffold.state
        return bool(state) and dist.is_available() and dist.is_initialized() and is_sharded(state)

    def sharded_session(self) -> MonitoredSession:
        """Every rank's, for a sharded state: the rank restores its shards with the others
        (``ShardedSessionCreator``) and saves them with the others
        (``ShardedCheckpointSaverHook``); rank 0, the chief, runs the other standard hooks,
        ``chief_only_hooks`` first; every rank runs ``hooks``."""
        rank = distributed.rank()
        if self.is_chief != (rank == 0):
            raise InvalidArgumentError(
                f"With a sharded state the chief is rank 0; this is rank {rank} with "
                f"is_chief={self.is_chief}"
            )
        creator = ShardedSessionCreator(
            self.scaffold,
            self.master,
            self.config,
            self.checkpoint_dir,
            max_wait_secs=self.max_wait_secs,
            state=self.state,
            device=self.device,
            clock=self.clock,
            memory_tier=self.memory_tier,
        )
        if self.rng_added:
            creator.allow_missing("rng")
        checkpoints = self._checkpoint_hooks(sharded=True)
        if self.is_chief:
            chief = [*(self.chief_only_hooks or []), *self._summary_hooks()]
            hooks = [*chief, *checkpoints, *(self.hooks or [])]
        else:
            hooks = [*checkpoints, *(self.hooks or [])]
        return self._session(creator, hooks)

    def _standard_hooks(self) -> list[SessionRunHook]:
        return [*self._summary_hooks(), *self._checkpoint_hooks(sharded=False)]

    def _summary_hooks(self) -> list[SessionRunHook]:
        hooks: list[SessionRunHook] = []
        summary_dir = self.summary_dir or self.checkpoint_dir
        clock = self.clock
        if summary_dir and self.log_step_count_steps and self.log_step_count_steps > 0:
            hooks.append(
                StepCounterHook(
                    output_dir=summary_dir, every_n_steps=self.log_step_count_steps, clock=clock
                )
            )
        steps, secs = self.save_summaries_steps, self.save_summaries_secs
        if summary_dir and ((steps and steps > 0) or (secs and secs > 0)):
            hooks.append(
                SummarySaverHook(
                    scaffold=self.scaffold,
                    save_steps=steps,
                    save_secs=secs,
                    output_dir=summary_dir,
                    clock=clock,
                )
            )
        if summary_dir and self.system_metrics_secs:
            hooks.append(SystemMetricsHook(self.system_metrics_secs, output_dir=summary_dir))
        return hooks

    def _checkpoint_hooks(self, sharded: bool) -> list[SessionRunHook]:
        """The ``CheckpointSaverHook`` (``sharded``: every rank's
        ``ShardedCheckpointSaverHook``), when checkpoints are on."""
        steps, secs = self.save_checkpoint_steps, self.save_checkpoint_secs
        if not self.checkpoint_dir or not ((secs and secs > 0) or (steps and steps > 0)):
            return []
        hook = ShardedCheckpointSaverHook if sharded else CheckpointSaverHook
        return [
            hook(
                self.checkpoint_dir,
                save_steps=steps,
                save_secs=secs,
                scaffold=self.scaffold,
                clock=self.clock,
                stop_on_checkpoint_error=self.stop_on_checkpoint_error,
            )
        ]


def _with_rng_state(
    scaffold: Scaffold, state: Mapping[str, Any] | None
) -> tuple[Mapping[str, Any] | None, bool]:
    """Add an ``RNGState`` under ``"rng"`` to the state of the session to create.

    The state is ``state`` when given (a ``TrainingState`` holding it is returned; the
    caller's mapping is not changed), else the scaffold's (changed in place). Nothing is added
    to an empty state or one that has an ``"rng"`` entry.

    Returns:
        The state to pass on, and whether an entry was added.
    """
    own = scaffold.state
    base = state if state is not None else own
    if not base or "rng" in base or (own is not None and "rng" in own):
        return state, False
    rng = RNGState()
    if own is not None:
        own.add("rng", rng)  # Beside the mapping the scaffold was given.
    if state is not None:
        state = TrainingState.of(state)
        state.add("rng", rng)
    return state, True
