"""How the Supervisor prepares a session and checkpoints it, by the shape of the run.

One mode is chosen at each ``prepare_or_wait_for_session``, from the process group and the
state (``choose_mode``):

* ``ChiefMode``: one process, or the chief of replicas with a replicated state (DDP). It
  cleans what a crash left, restores the newest valid checkpoint or initializes, and with
  replicas publishes the resume point and broadcasts its state. Its checkpoints are taken by a
  ``CheckpointDriver`` asked by a timer thread (``SVTimerCheckpointThread``).
* ``WorkerMode``: a non-chief. It waits until the chief made the state ready and, with
  replicas, receives the chief's state. It never checkpoints.
* ``ShardedMode``: every rank of a sharded state (FSDP2 / DTensor). Every rank restores its
  shards of the same checkpoint, and saves them together with the other ranks at steps they
  agree on (``driver/sharded_checkpoints.py``).

A mode sees the Supervisor through a ``ModeContext`` (its settings, coordinator, preemption
controller, and how to stop on an error) and holds what one session needs: the driver of its
checkpoints, the stop agreement between replicas, the sharded checkpoint service. The
Supervisor facade calls it; the mode never touches the facade itself.

Thread safety: used on the training thread, as the Supervisor.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from torchsupervisor.checkpoint.recovery import clean_checkpoint_dir
from torchsupervisor.checkpoint.run_id import ensure_run_id
from torchsupervisor.checkpoint.sharded.plan import is_sharded
from torchsupervisor.core.coordinator import Coordinator, LooperThread
from torchsupervisor.core.global_step import read_step
from torchsupervisor.core.session import Session
from torchsupervisor.distributed import env as distributed
from torchsupervisor.distributed.replica_streams import ReplicaStreams, start_streams
from torchsupervisor.distributed.replicas import ReplicaGroup
from torchsupervisor.distributed.stop_agreement import StopAgreement
from torchsupervisor.driver.checkpoint_driver import CheckpointDriver
from torchsupervisor.driver.preemption import Preemption
from torchsupervisor.driver.sharded_checkpoints import ShardedCheckpointService
from torchsupervisor.errors import AbortedError, InvalidArgumentError
from torchsupervisor.supervisor.mode_tiers import ModeTiers, TierSettings
from torchsupervisor.supervisor.services import SVTimerCheckpointThread
from torchsupervisor.supervisor.session_manager import DIRECTORY_TIERS
from torchsupervisor.supervisor.settings import Settings
from torchsupervisor.supervisor.sharded_restore import prepare_sharded
from torchsupervisor.tiers.memory import HELD_IN_MEMORY

__all__ = [
    "ChiefMode",
    "Mode",
    "ModeContext",
    "ShardedMode",
    "WorkerMode",
    "agreed_stop",
    "choose_mode",
    "start_mode",
]

logger = logging.getLogger("torchsupervisor")

OPEN_POLL_SECS = 0.05
"""How often a non-chief looks at the store for the chief's word (seconds): a sharded rank
for the logdir cleaned, a replica for the state ready (at most ``recovery_wait_secs``).

A look is one store check. TF's ``recovery_wait_secs`` (30 s by default) paced whole session
runs; here it would only make a rank that looked too early sleep up to half a minute at every
restart (measured: 0.5 s of every DDP recovery with ``recovery_wait_secs=1``)."""


@dataclass(frozen=True)
class ModeContext:
    """What a mode takes from the Supervisor (no reference to the Supervisor itself: one
    dropped without ``stop()`` is still freed at once, its threads with it).

    Attributes:
        settings: The Supervisor's resolved arguments.
        coord: Its coordinator (stop requests, thread errors).
        preemption: Its preemption controller (signals, grace budget, exit).
    """

    settings: Settings
    coord: Coordinator
    preemption: Preemption

    def stop_on_error(self, error: BaseException) -> None:
        """Stop training with ``error`` (a failed checkpoint, with ``stop_on_checkpoint_error``)."""
        self.coord.request_stop((type(error), error, error.__traceback__))

    def current_step(self) -> int | None:
        """The global step now (None without one)."""
        step = self.settings.global_step
        return None if step is None else read_step(step)

    def thread_failed(self) -> bool:
        """Whether a thread reported an error to the coordinator."""
        try:
            self.coord.raise_requested_exception()
        except BaseException:
            return True
        return False


class Mode:
    """What differs between the shapes of a run; the defaults are a non-checkpointing rank.

    Attributes:
        driver: The ``CheckpointDriver`` of this session's checkpoints (None: none here).
        agreement: The stop agreement between replicas (None without replicas).
    """

    def __init__(self, context: ModeContext, replicas: ReplicaGroup | None) -> None:
        self.context = context
        self.settings = context.settings
        self.replicas = replicas
        self.driver: CheckpointDriver | None = None
        self.agreement: StopAgreement | None = None
        self.peer_failure: str | None = None
        self.sess: Session | None = None
        self.tiers = ModeTiers(TierSettings.of(self.settings), replicas)
        self.streams: ReplicaStreams | None = None
        """Every rank's random streams gathered to the chief for its checkpoints."""

    def prepare(
        self, master: str, config: object, wait_for_checkpoint: bool, max_wait_secs: float
    ) -> Session:
        """Create this rank's session, its state restored, initialized or received."""
        raise NotImplementedError

    def start_services(self, sess: Session) -> None:
        """Start what every rank of this mode runs (before the chief's standard services)."""

    def checkpoint_threads(self, sess: Session) -> list[LooperThread]:
        """The chief's checkpoint timer threads (not started); none here."""
        return []

    def final_checkpoint(self, clean_exit: bool) -> BaseException | None:
        """Save the final checkpoint of a stop; return (not raise) a failure."""
        return None

    def finish(self, clean_exit: bool) -> BaseException | None:
        """The final checkpoint; after a preemption, the exit to raise if it is missing."""
        error = self.final_checkpoint(clean_exit)
        if error is not None or not clean_exit or self.context.thread_failed():
            return error  # A thread's error is raised instead.
        if self.peer_failure is not None:
            return AbortedError(
                None, None, f"Stopped because another rank failed: {self.peer_failure}"
            )
        memory = self.tiers.memory
        memory_step = None
        if memory is not None and memory.wait(1.0):  # The snapshot of the stop, if any.
            memory_step = memory.committed_step
        return self.context.preemption.outcome(
            self.context.current_step(), self.driver, memory_step
        )

    def checkpoint(self, metrics: dict[str, float] | None = None) -> str | None:
        """Save now (``Supervisor.checkpoint``), from the training thread."""
        save = self._save_now()
        if save is None:
            raise RuntimeError("checkpoint() needs a running checkpoint service on the chief")
        self._check_training_thread()
        if metrics is None:
            return save()
        return self._save_with_metrics(metrics)

    def _save_now(self) -> Callable[[], str | None] | None:
        """What saves a checkpoint now; None without checkpoints in this session."""
        return None

    def _save_with_metrics(self, metrics: dict[str, float]) -> str | None:
        """Save now with ``metrics`` in the checkpoint (``Saver.save(metrics=)``)."""
        raise ValueError("metrics are not supported yet for a state of DTensors (FSDP2)")

    @staticmethod
    def _final(save: Callable[[], Any]) -> BaseException | None:
        """Run ``save`` (the final checkpoint); log and return (not raise) its failure."""
        try:
            save()
        except Exception as e:
            logger.error("The final checkpoint failed: %s", e)
            return e
        return None

    def stop(self, aborted: bool, clean: bool = True) -> None:
        """End the checkpoints of the session (a second Ctrl-C ``aborted``: abandon; not
        ``clean``: the session ended with an error, another rank may be gone)."""

    def _close_tiers(self) -> None:
        """Stop the memory tier; free it when the newest checkpoint holds the current step."""
        driver = self.driver
        saved = (
            driver is not None
            and driver.last_error is None
            and (driver.last_step is not None and driver.last_step == self.context.current_step())
        )
        self.tiers.close(saved)

    def end_agreement(self, clean_exit: bool, failure: BaseException | None) -> None:
        """At the end of the session: tell the other replicas why it ended, stop polling.

        A rank that leaves with an error records it; the other ranks log it, so the root
        cause appears next to their own errors, and end with ``AbortedError`` (``finish``).
        """
        if self.agreement is None:
            return
        if not clean_exit:
            self.agreement.request(
                "error" if failure is None else f"{type(failure).__name__}: {failure}",
                failed=True,
            )
        self.peer_failure = self.agreement.peer_failure()
        self.agreement.close()
        self.agreement = None

    def _stop_agreement(self) -> None:
        if self.replicas is not None:
            self.agreement = StopAgreement(self.replicas, self.settings.global_step)

    def _start_streams(self, sess: Session, every_boundary: bool) -> None:
        """Every rank, at the same point (a replicated run's chief before its broadcast,
        the others after it): ``replica_streams.start_streams``."""
        step = self.settings.global_step
        self.streams = start_streams(sess, self.replicas, step, every_boundary=every_boundary)

    def at_agreed_stop(self) -> None:
        """At the step every rank stops at (an agreed stop, on every rank): gather the
        random streams for the final checkpoint."""
        if self.streams is not None:
            self.streams.gather()

    def _close_streams(self) -> None:
        streams, self.streams = self.streams, None
        if streams is not None:
            streams.close()

    def _check_training_thread(self) -> None:
        if self.sess is not None and threading.get_ident() != self.sess.boundary.owner_ident:
            raise RuntimeError(
                "checkpoint() must be called from the training thread (the thread that created "
                "the session), between steps"
            )


class ChiefMode(Mode):
    """One process, or the chief of replicas with a replicated state (module docstring)."""

    def prepare(
        self, master: str, config: object, wait_for_checkpoint: bool, max_wait_secs: float
    ) -> Session:
        st = self.settings
        if st.logdir:
            clean_checkpoint_dir(st.logdir)
            ensure_run_id(st.logdir)  # The run's identity, kept across restarts and requeues.
        tiers = self.tiers.open() if st.is_chief else []
        self.tiers.exchange_peers()
        sess = _prepare_session(st, master, config, wait_for_checkpoint, max_wait_secs, tiers=tiers)
        self.sess = sess
        self.tiers.start(sess)
        # Before the broadcast, which carries the others' streams; at every boundary with the
        # memory tier (the chief's snapshots hold every rank's streams).
        self._start_streams(sess, every_boundary=st.memory_tier is not None)
        if self.replicas is not None:
            self.replicas.publish_ready(
                {"checkpoint": sess.restored_checkpoint, "step": self.context.current_step()}
            )
            self.replicas.broadcast_state(sess.state)
            self._stop_agreement()
        return sess

    def checkpoint_threads(self, sess: Session) -> list[LooperThread]:
        st = self.settings
        if st.saver is None or not st.save_model_secs or not st.save_path:
            return []
        restored = sess.restored_checkpoint
        on_disk = restored is not None and sess.restored_tier in DIRECTORY_TIERS
        self.sess = sess
        self.driver = CheckpointDriver(
            st.saver,
            st.save_path,
            st.global_step,
            writer=st.summary_writer,
            clock=st.clock,
            on_error=self.context.stop_on_error if st.stop_on_checkpoint_error else None,
            stop_on_error=st.stop_on_checkpoint_error,
            last_step=self.context.current_step() if on_disk else None,
            last_prefix=restored if on_disk else None,
        )
        return [SVTimerCheckpointThread(self.context.coord, st.save_model_secs, self.driver, sess)]

    def final_checkpoint(self, clean_exit: bool) -> BaseException | None:
        """The chief saves the last step after a clean end (within a preemption's budget).

        Nothing is saved when a service or thread reported an error: the state may then be
        the half-updated state of an interrupted step.
        """
        driver = self.driver
        if driver is None or not clean_exit or self.context.thread_failed():
            return None
        memory, preemption = self.tiers.memory, self.context.preemption
        step = driver.current_step()
        # What a short notice leaves time for first: the last step in memory; then the
        # persistent checkpoint if the time left fits it (``CheckpointDriver.final``).
        held = None
        if (
            memory is not None
            and preemption.requested
            and memory.hold_stop(step, preemption.budget())
        ):
            held = HELD_IN_MEMORY
        driver.grace_budget_secs = preemption.budget()
        return self._final(lambda: driver.final(self.sess, step, held_elsewhere=held))

    def _save_now(self) -> Callable[[], str | None] | None:
        driver = self.driver
        if driver is None:
            return None
        return lambda: driver.save(self.sess, driver.current_step())

    def _save_with_metrics(self, metrics: dict[str, float]) -> str | None:
        assert self.driver is not None  # checkpoint() found a save.
        return self.driver.save(self.sess, self.driver.current_step(), metrics=metrics)

    def stop(self, aborted: bool, clean: bool = True) -> None:
        if self.driver is not None:
            if aborted:  # A second Ctrl-C: abandon, do not wait.
                self.driver.abandon(timeout_secs=5.0)
            self.driver.close()  # No idle writer thread outlives the session.
        self._close_tiers()
        self._close_streams()


class WorkerMode(Mode):
    """A non-chief: waits for the chief's state; never checkpoints (module docstring)."""

    def prepare(
        self, master: str, config: object, wait_for_checkpoint: bool, max_wait_secs: float
    ) -> Session:
        st = self.settings
        info: dict[str, Any] = {}
        self.tiers.exchange_peers()
        if self.replicas is not None:
            interval = min(st.recovery_wait_secs, OPEN_POLL_SECS)
            info = self.replicas.wait_ready(interval, max_wait_secs, clock=st.clock)
            # The chief restored its step and sends nothing before the state's broadcast.
            self.tiers.drop_abandoned(info.get("step"))
        sess = st.session_manager.wait_for_session(
            master, config=config, max_wait_secs=max_wait_secs
        )
        if self.replicas is not None:
            self.replicas.broadcast_state(sess.state)
            sess.restored_checkpoint = info.get("checkpoint")
            self._stop_agreement()
            self._start_streams(sess, every_boundary=st.memory_tier is not None)
        self.sess = sess
        return sess

    def stop(self, aborted: bool, clean: bool = True) -> None:
        # After an error the chief may be dead: its word on the copies never comes.
        self.tiers.stop_serving(aborted or not clean or self.peer_failure is not None)
        self._close_streams()


class ShardedMode(Mode):
    """Every rank of a sharded state restores and saves together (module docstring)."""

    def __init__(self, context: ModeContext, replicas: ReplicaGroup) -> None:
        super().__init__(context, replicas)
        self.service: ShardedCheckpointService | None = None

    def prepare(
        self, master: str, config: object, wait_for_checkpoint: bool, max_wait_secs: float
    ) -> Session:
        """Every rank restores its shards of the same checkpoint or snapshot, or
        initializes them (``sharded_restore.prepare_sharded``; the chief's wait polls every
        ``recovery_wait_secs`` at most)."""
        replicas = self.replicas
        st = self.settings
        assert replicas is not None
        sess = prepare_sharded(
            replicas,
            self.tiers,
            lambda tiers: _prepare_session(
                st,
                master,
                config,
                wait_for_checkpoint,
                max_wait_secs,
                checkpoint_dir=st.replica_logdir,
                tiers=list(tiers),
            ),
            poll_secs=min(st.recovery_wait_secs, OPEN_POLL_SECS),
            max_wait_secs=max_wait_secs,
            clock=st.clock,
        )
        self.sess = sess
        self._stop_agreement()
        # Each rank's memory tier keeps its own streams; the final checkpoint of an agreed
        # stop gets every rank's (a restart from it continues them).
        self._start_streams(sess, every_boundary=False)
        return sess

    def start_services(self, sess: Session) -> None:
        """Every rank takes part in each sharded checkpoint: start this rank's service."""
        st = self.settings
        if st.saver is None or not st.replica_save_model_secs or not st.replica_save_path:
            return
        assert self.replicas is not None
        if st.global_step is None:
            raise ValueError("Sharded checkpoints of replicas need a global step to agree on")
        restored = sess.restored_checkpoint
        on_error = self.context.stop_on_error if st.stop_on_checkpoint_error else None
        driver = CheckpointDriver(
            st.saver,
            st.replica_save_path,
            st.global_step,
            writer=st.summary_writer if self.replicas.rank == self.replicas.chief_rank else None,
            clock=st.clock,
            on_error=on_error,
            stop_on_error=on_error is not None,
            last_step=read_step(st.global_step) if restored else None,
            last_prefix=restored,
        )
        self.service = ShardedCheckpointService(sess, driver, self.replicas, clock=st.clock)
        self.driver = self.service.driver
        self.service.start()

    def checkpoint_threads(self, sess: Session) -> list[LooperThread]:
        """The chief's timer only asks, through the store; every rank then saves."""
        st = self.settings
        if self.service is not None and st.save_model_secs:
            return [self.service.timer(self.context.coord, st.save_model_secs)]
        if st.saver is not None and st.save_model_secs and st.save_path:
            logger.warning(
                "Sharded checkpoints need start_standard_services=True when the session "
                "is prepared on every replica; no periodic checkpoints"
            )
        return []

    def final_checkpoint(self, clean_exit: bool) -> BaseException | None:
        """Every rank saves the last checkpoint together, or none does; never hangs.

        A rank whose block failed, or whose threads reported an error, vetoes (its state may
        be in the middle of a step); the others then skip at once. Otherwise every rank votes
        and waits at most ``stop_grace_secs`` (or what is left of a preemption's grace period)
        for the others.
        """
        service = self.service
        if service is None:
            return None
        reason = None if clean_exit else "its session ended with an error"
        if reason is None:
            try:
                self.context.coord.raise_requested_exception()
            except BaseException as e:
                reason = f"a thread failed: {type(e).__name__}: {e}"
        if reason is not None:
            service.veto(reason)
            return None
        budget = self.context.preemption.budget()
        return self._final(lambda: service.final(self.settings.stop_grace_secs, budget))

    def _save_now(self) -> Callable[[], str | None] | None:
        return None if self.service is None else self.service.save_now

    def stop(self, aborted: bool, clean: bool = True) -> None:
        if self.service is not None:
            self.service.close(wait=not aborted)
        self._close_tiers()
        self._close_streams()


def start_mode(context: ModeContext, master: str, max_wait_secs: float, generation: int) -> Mode:
    """Join the process group ``master`` names (if any) and choose the session's mode.

    Args:
        context: What the mode takes from the Supervisor.
        master: The master string (``""``: this process alone).
        max_wait_secs: Longest wait for the other replicas to join, in seconds.
        generation: The number of this session of the Supervisor (the same on every rank).

    Raises:
        InvalidArgumentError: With replicas, if the chief is not rank 0.
        DeadlineExceededError: If the other replicas did not join in time.
    """
    distributed.connect(master, timeout_secs=max_wait_secs)
    replicas = None
    settings = context.settings
    # A sharded state at world size 1 (FSDP2 on one rank) is saved and restored as at any
    # other: every rank (this one) together, its memory tier of its local shards.
    if (
        dist.is_available()
        and dist.is_initialized()
        and (dist.get_world_size() > 1 or is_sharded(settings.state))
    ):
        if settings.is_chief != (dist.get_rank() == 0):
            raise InvalidArgumentError(
                f"With replicas the chief is rank 0; this is rank {dist.get_rank()} with "
                f"is_chief={settings.is_chief}"
            )
        replicas = ReplicaGroup(generation, clock=settings.clock)
    return choose_mode(context, replicas)


def agreed_stop(context: ModeContext, agreement: StopAgreement) -> bool:
    """With replicas: stop when every rank has completed the agreed number of steps."""
    if context.coord.should_stop():
        agreement.request(context.preemption.describe() or "stop requested")
    if agreement.pending and agreement.reached(context.current_step()):
        context.coord.request_stop()
        return True
    return False


def choose_mode(context: ModeContext, replicas: ReplicaGroup | None) -> Mode:
    """The mode of a session: sharded replicas, the chief, or a worker."""
    settings = context.settings
    if replicas is not None and is_sharded(settings.state):
        return ShardedMode(context, replicas)
    if settings.is_chief:
        return ChiefMode(context, replicas)
    return WorkerMode(context, replicas)


def _prepare_session(
    st: Settings,
    master: str,
    config: object,
    wait_for_checkpoint: bool,
    max_wait_secs: float,
    *,
    checkpoint_dir: str | None = None,
    tiers: list[Any] | None = None,
) -> Session:
    return st.session_manager.prepare_session(
        master,
        init_op=st.init_op,
        saver=st.saver,
        checkpoint_dir=checkpoint_dir if checkpoint_dir is not None else st.logdir,
        wait_for_checkpoint=wait_for_checkpoint,
        max_wait_secs=max_wait_secs,
        config=config,
        init_feed_dict=st.init_feed_dict,
        init_fn=st.init_fn,
        tiers=tiers or (),
    )
