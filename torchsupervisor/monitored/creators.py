"""Session creators: how a ``MonitoredSession`` gets a session that is ready to train.

* ``ChiefSessionCreator`` restores the newest valid checkpoint of ``checkpoint_dir`` (or a
  given one), else runs the scaffold's ``init_op`` and ``init_fn`` (for its first session
  only: a later one, after a recoverable error, keeps the state in memory); then the local
  init op and the ready check (``SessionManager.prepare_session``). It first waits for the
  scaffold saver's checkpoint still being written, so that it restores the newest one. Its
  first session also removes what a crash left in ``checkpoint_dir`` (temporary files,
  checkpoints without an index), as the Supervisor does.
* ``WorkerSessionCreator`` waits until the state is ready (``SessionManager.wait_for_session``).

Both take the state the way the Supervisor does (``state=``), or from the scaffold.

TF names: ``tf.compat.v1.train.SessionCreator``, ``ChiefSessionCreator``,
``WorkerSessionCreator``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from torchsupervisor.checkpoint.files import checkpoint_step
from torchsupervisor.checkpoint.recovery import clean_checkpoint_dir
from torchsupervisor.checkpoint.run_id import ensure_run_id
from torchsupervisor.checkpoint.sharded.plan import is_sharded
from torchsupervisor.checkpoint.state_file import latest_checkpoint
from torchsupervisor.core.checks import (
    check_clock,
    check_number,
    check_path,
    check_state,
    check_str,
)
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.global_step import get_global_step, read_step
from torchsupervisor.core.registry import get_default_graph
from torchsupervisor.core.session import Session
from torchsupervisor.core.training_state import TrainingState
from torchsupervisor.distributed import env as distributed
from torchsupervisor.distributed.replica_streams import ReplicaStreams, start_streams
from torchsupervisor.distributed.replicas import ReplicaGroup
from torchsupervisor.hooks._global_step import session_global_step
from torchsupervisor.monitored.replica_stop import ReplicaStop
from torchsupervisor.monitored.scaffold import Scaffold, check_scaffold, prepare_state, same_state
from torchsupervisor.storage import DirectoryLock, storage_for
from torchsupervisor.supervisor.session_manager import SessionManager
from torchsupervisor.tiers.memory import MEMORY_TIER, MemoryTier, MemoryTierConfig

if TYPE_CHECKING:
    import torch

    from torchsupervisor.tiers.tier import SnapshotTier

__all__ = ["ChiefSessionCreator", "SessionCreator", "WorkerSessionCreator"]

logger = logging.getLogger("torchsupervisor")


class SessionCreator:
    """A factory of sessions; subclasses implement ``create_session``.

    TF name: ``tf.compat.v1.train.SessionCreator``.
    """

    def create_session(self) -> Session:
        """Create and return a ready session.

        Returns:
            A ``Session`` whose state is ready to train.

        Raises:
            NotImplementedError: In this base class.

        TF name: ``tf.compat.v1.train.SessionCreator.create_session``.
        """
        raise NotImplementedError("SessionCreator subclasses implement create_session()")


def _resolve_state(scaffold: Scaffold, state: Mapping[str, Any] | None) -> TrainingState:
    if state is None:
        return scaffold.state if scaffold.state is not None else prepare_state(None)
    if scaffold.state is not None and not same_state(scaffold.state, state):
        raise ValueError(
            "state: the scaffold already has a different state; pass the state to the "
            "Scaffold or to the session creator, not two different ones"
        )
    return prepare_state(state)


class _ScaffoldedCreator(SessionCreator):
    def __init__(
        self,
        scaffold: Scaffold | None,
        master: str,
        config: object,
        state: Mapping[str, Any] | None,
        device: torch.device | str | None,
        clock: Clock | None,
    ) -> None:
        check_scaffold(scaffold)
        check_str("master", master)
        check_state("state", state)
        check_clock("clock", clock)
        self._scaffold = scaffold or Scaffold(clock=clock)
        self._master = master
        self._config = config
        self._state = _resolve_state(self._scaffold, state)
        self._device = device
        self._clock = clock
        self._session_manager: SessionManager | None = None
        self._optional: set[str] = set()
        self._streams: ReplicaStreams | None = None
        self.replica_stop: ReplicaStop | None = None
        """The stop every rank agrees on (``replica_stop``), from the first session of a
        replicated run; None without replicas (``MonitoredSession.should_stop`` asks it)."""

    def close(self, checkpoint_step: int | None = None) -> None:
        """Release what this creator holds (``MonitoredSession.close`` calls it).

        Args:
            checkpoint_step: The step of the newest checkpoint the session's hooks committed
                or restored, or None.
        """
        raise NotImplementedError

    def _join_replicas(
        self, sess: Session, group: ReplicaGroup, each_step: bool, saves_together: bool = False
    ) -> None:
        """The first session of each rank of a replicated run, at the same point (the chief
        before its broadcast, which carries the others' restored streams; the others after
        it): every rank's random streams into the chief's checkpoints (``replica_streams``;
        ``each_step``: at every step boundary, for the chief's memory tier), and the agreed
        stop (``replica_stop``; ``saves_together``: of a sharded state)."""
        step = session_global_step(sess, get_global_step())
        self._streams = start_streams(sess, group, step, every_boundary=each_step)
        self.replica_stop = ReplicaStop(group, step, self._streams, saves_together)

    def _follow_streams(self, sess: Session) -> None:
        """A session re-created after a recoverable error: the gathers go on at its step
        boundaries (the other ranks' sessions go on with theirs)."""
        if self._streams is not None:
            self._streams.follow(sess)

    def _leave_replicas(self) -> None:
        streams, self._streams = self._streams, None
        if streams is not None:
            streams.close()
        if self.replica_stop is not None:
            self.replica_stop.end(None)

    @property
    def scaffold(self) -> Scaffold:
        """The scaffold (finalized by ``create_session``).

        TF name: none (TF keeps it private, ``ChiefSessionCreator._scaffold``).
        """
        return self._scaffold

    @property
    def state(self) -> dict[str, Any]:
        """The state of the sessions this creator makes (with the global step).

        TF name: none (TF's sessions run the default graph's variables).
        """
        return self._state

    def allow_missing(self, *names: str) -> None:
        """Let a restore skip these state entries, with a warning, when a checkpoint lacks them.

        Applied to the scaffold's saver (``Saver.allow_missing``) when a session is created;
        ``MonitoredTrainingSession`` uses it for the ``"rng"`` entry it adds.

        Args:
            *names: Top-level names of state entries.

        TF name: none (TF's restore has no optional entries).
        """
        self._optional.update(names)

    def _finalize(self) -> Any:
        """Finalize the scaffold; return its saver (told about the optional entries)."""
        self._scaffold.finalize()
        saver = self._scaffold.saver
        if self._optional and hasattr(saver, "allow_missing"):
            saver.allow_missing(*sorted(self._optional))
        return saver

    def _get_session_manager(self) -> SessionManager:
        if self._session_manager is None:
            scaffold = self._scaffold
            self._session_manager = SessionManager(
                local_init_op=scaffold.local_init_op,
                local_init_feed_dict=scaffold.local_init_feed_dict,
                ready_op=scaffold.ready_op,
                ready_for_local_init_op=scaffold.ready_for_local_init_op,
                graph=get_default_graph(),
                state=self._state,
                device=self._device,
                clock=self._clock,
            )
        return self._session_manager


class ChiefSessionCreator(_ScaffoldedCreator):
    """Create sessions for the chief: restore the newest valid checkpoint, or initialize.

    Args:
        scaffold: The ``Scaffold`` (finalized at the first ``create_session``); None: a
            default one.
        master: ``""`` for an in-process session.
        config: Passed to the session.
        checkpoint_dir: Directory to restore the newest valid checkpoint from; None: no
            restore from a directory.
        checkpoint_filename_with_path: A specific checkpoint prefix to restore instead.
        state: The training state (a mapping of names to stateful objects); None: the
            scaffold's state, or only the global step of the ``GLOBAL_STEP`` collection.
        device: Where the init op materializes meta-device modules.
        clock: Time source for waits.
        memory_tier: Keep the newest snapshots in host memory as well (``checkpoint_dir``
            needed; see ``Supervisor``'s ``memory_tier``): the sessions restore from it when
            it holds a newer valid snapshot, and ``close`` frees it when the newest checkpoint
            of ``checkpoint_dir`` holds the last step.

    Raises:
        ValueError: If ``state`` differs from a state the scaffold already has.
        TypeError: For a ``memory_tier`` that is not a ``MemoryTierConfig``.

    TF name: ``tf.compat.v1.train.ChiefSessionCreator``.
    """

    def __init__(
        self,
        scaffold: Scaffold | None = None,
        master: str = "",
        config: object = None,
        checkpoint_dir: str | None = None,
        checkpoint_filename_with_path: str | None = None,
        *,
        state: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        clock: Clock | None = None,
        memory_tier: MemoryTierConfig | None = None,
    ) -> None:
        super().__init__(scaffold, master, config, state, device, clock)
        self._memory_config = check_memory_tier(memory_tier)
        self._memory: MemoryTier | None = None
        self._last_session: Session | None = None
        self._checkpoint_dir = check_path("checkpoint_dir", checkpoint_dir)
        self._checkpoint_filename_with_path = check_path(
            "checkpoint_filename_with_path", checkpoint_filename_with_path
        )
        self._cleaned = False
        self._initialized = False
        self._writer_lock: DirectoryLock | None = None

    @property
    def checkpoint_dir(self) -> str | None:
        """The directory sessions restore from (and the run's log directory), or None.

        TF name: none (TF kept it private).
        """
        return self._checkpoint_dir

    @property
    def memory_tier(self) -> MemoryTier | None:
        """The memory tier of the session (``memory_tier=`` and a ``checkpoint_dir``), once
        a session started it; else None.

        TF name: none.
        """
        return self._memory

    @property
    def writer_lock(self) -> DirectoryLock | None:
        """The writer lock of ``checkpoint_dir`` while a session holds it, else None.

        TF name: none (TF had no writer lock).
        """
        return self._writer_lock

    def close(self, checkpoint_step: int | None = None) -> None:
        """Release the writer lock of ``checkpoint_dir`` (``MonitoredSession.close`` calls it);
        stop the memory tier, freed when the newest checkpoint holds the last step.

        Args:
            checkpoint_step: The step of the newest checkpoint the session's hooks committed
                or restored (``MonitoredSession`` passes it); None: the newest checkpoint of
                ``checkpoint_dir`` tells.

        TF name: none (TF had no writer lock).
        """
        self._close_memory_tier(checkpoint_step)
        self._leave_replicas()
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None

    def _open_memory_tier(self) -> list[SnapshotTier]:
        """The memory tier (and its local-disk tier), opened at the first session
        (``memory_tier`` and a directory)."""
        if self._memory is None and self._memory_config is not None and self._checkpoint_dir:
            run_id = ensure_run_id(self._checkpoint_dir)
            self._memory = MemoryTier(
                self._memory_config,
                self._checkpoint_dir,
                run_id,
                rank=distributed.rank(),
                clock=self._clock,
            )
        return [] if self._memory is None else self._memory.tiers

    def _start_memory_tier(self, sess: Session) -> None:
        if self._memory is None:
            return
        step = session_global_step(sess, get_global_step())
        if step is None:
            logger.warning("The memory tier needs a global step; it is off")
            self._memory.close()
            self._memory = None
            return
        restored = sess.restored_checkpoint if sess.restored_tier == MEMORY_TIER else None
        self._memory.start(sess, step, restored)

    def _close_memory_tier(self, saved_step: int | None) -> None:
        """Stop the memory tier; free it when the newest checkpoint holds the last step."""
        memory, self._memory = self._memory, None
        if memory is None:
            return
        sess, self._last_session = self._last_session, None
        step = None if sess is None else session_global_step(sess, get_global_step())
        if saved_step is None and self._checkpoint_dir:
            newest = latest_checkpoint(self._checkpoint_dir)
            saved_step = None if newest is None else checkpoint_step(newest)
        held = step is not None and saved_step == read_step(step)
        try:
            memory.close(free=held)
        except OSError as e:
            logger.warning("Could not free the memory tier at %s: %s", memory.directory, e)

    def create_session(self) -> Session:
        """Create a session whose state is restored or initialized and ready.

        Waits first for the checkpoint the scaffold's saver is still writing (a session
        re-created after a recoverable error then restores it, not an older one). When
        nothing is restored, the first session runs the init op and ``init_fn``; a later one
        keeps the state as it is in memory (see ``MonitoredSession``: the state's objects
        cannot be re-initialized as TF's variables were).

        Under a process group of several ranks, the first session of rank 0 (the chief)
        then broadcasts its state to the other ranks' ``WorkerSessionCreator`` sessions.

        Returns:
            The session; ``session.restored_checkpoint`` names the checkpoint restored.

        Raises:
            RuntimeError: When the state cannot be made ready (``SessionManager``'s texts).
            ValueError: If both checkpoint locations are given.
            DataLossError: If ``checkpoint_dir`` has checkpoints and none is valid.
            LogdirLockedError: Another process is writing to ``checkpoint_dir``.
            CorruptCheckpointError, NotFoundError, InvalidArgumentError: ``Saver.restore``'s
                errors, when the checkpoint given by ``checkpoint_filename_with_path`` does
                not restore.

        TF name: ``tf.compat.v1.train.ChiefSessionCreator.create_session``.
        """
        saver = self._finalize()
        wait = getattr(saver, "wait", None)
        if wait is not None:
            wait()
        if self._checkpoint_dir and self._writer_lock is None:
            storage = storage_for(self._checkpoint_dir)
            storage.makedirs(self._checkpoint_dir)
            self._writer_lock = storage.lock(self._checkpoint_dir)
        if self._checkpoint_dir and not self._cleaned:
            clean_checkpoint_dir(self._checkpoint_dir)
            ensure_run_id(self._checkpoint_dir)  # The run's identity, kept across restarts.
            self._cleaned = True
        if self._initialized:
            init_op, init_feed_dict, init_fn = _keep_state, None, None
        else:
            init_op = self._scaffold.init_op
            init_feed_dict, init_fn = self._scaffold.init_feed_dict, self._scaffold.init_fn
        sess = self._get_session_manager().prepare_session(
            self._master,
            saver=saver,
            checkpoint_dir=self._checkpoint_dir,
            checkpoint_filename_with_path=self._checkpoint_filename_with_path,
            config=self._config,
            init_op=init_op,
            init_feed_dict=init_feed_dict,
            init_fn=init_fn,
            tiers=self._open_memory_tier(),
        )
        self._last_session = sess
        self._start_memory_tier(sess)
        first, self._initialized = not self._initialized, True
        if first:
            group = _replica_group(True, _AGREE_ROLES_SECS, sess.state, self._clock)
            if group is not None:
                each_step = self._memory is not None  # Its snapshots hold every rank's streams.
                self._join_replicas(sess, group, each_step)
                group.publish_ready(
                    {"checkpoint": sess.restored_checkpoint, _STREAMS_EACH_STEP: each_step}
                )
                group.broadcast_state(sess.state)
        else:
            self._follow_streams(sess)
        return sess


def check_memory_tier(memory_tier: object) -> MemoryTierConfig | None:
    """Return ``memory_tier`` (a creator's argument) checked.

    Raises:
        TypeError: If it is neither a ``MemoryTierConfig`` nor None.
    """
    if memory_tier is not None and not isinstance(memory_tier, MemoryTierConfig):
        raise TypeError(
            f"memory_tier must be a MemoryTierConfig or None, got {memory_tier!r} "
            f"({type(memory_tier).__name__})"
        )
    return memory_tier


def _keep_state() -> None:
    """The init op of a re-created session: the state in memory is already initialized."""


_replica_sessions = 0  # First sessions of creators under a process group, in this process.

_AGREE_ROLES_SECS = 300.0
_STREAMS_EACH_STEP = "streams_each_step"  # The chief's ready record: gather at each step.
_READY_POLL_SECS = 0.5


def _replica_group(
    chief: bool, max_wait_secs: float, state: Mapping[str, Any], clock: Clock | None
) -> ReplicaGroup | None:
    """The group in which the chief's state reaches the other ranks, or None.

    Under a process group of several ranks, every rank's first session agrees on the roles
    through the store: when rank 0 is the one chief, its restored (or initialized) state is
    broadcast to every other rank, so that no replica trains from fresh weights while the
    chief resumed (silent divergence). Other arrangements (every rank its own chief, as a
    Horovod program passing ``is_chief=True`` everywhere) are left alone, with a warning.

    Distributed: every rank's first session calls it, in the same order.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    if is_sharded(state):
        if chief:
            logger.warning(
                "A sharded (DTensor) state under ChiefSessionCreator and WorkerSessionCreator: "
                "each rank keeps its own. Give every rank a ShardedSessionCreator and a "
                "ShardedCheckpointSaverHook (MonitoredTrainingSession does)."
            )
        return None
    group = _new_group(clock)
    group.post("chief", bool(chief))
    roles = group.gather("chief", max_wait_secs, what="Agreeing on the chief")
    if roles == [True] + [False] * (len(roles) - 1):
        return group
    chiefs = [rank for rank, is_chief in enumerate(roles) if is_chief]
    if group.rank == 0:
        logger.warning(
            "The chief ranks are %s, not rank 0 alone: each rank keeps its own state (no "
            "broadcast of the chief's restored state)",
            chiefs,
        )
    return None


def _new_group(clock: Clock | None) -> ReplicaGroup:
    """The replica group of a creator's first session under a process group (every rank
    makes its creators' groups in the same order: one count for every kind of creator)."""
    global _replica_sessions
    _replica_sessions += 1
    return ReplicaGroup(f"monitored/{_replica_sessions}", clock=clock)


class WorkerSessionCreator(_ScaffoldedCreator):
    """Create sessions for a non-chief: wait until the state is ready.

    Args:
        scaffold: The ``Scaffold``; None: a default one.
        master: ``""`` for an in-process session.
        config: Passed to the session.
        max_wait_secs: The longest wait for a ready state, in seconds.
        state: The training state; None: the scaffold's.
        device: Passed to the session.
        clock: Time source for waits.
        goodput_dir: The run's log directory, where a ``MonitoredSession`` of this rank
            writes its goodput ledger (``MonitoredTrainingSession`` passes its
            ``checkpoint_dir`` on every rank of a process group); None: no ledger.

    Raises:
        ValueError: If ``state`` differs from a state the scaffold already has.

    TF name: ``tf.compat.v1.train.WorkerSessionCreator``.
    """

    def __init__(
        self,
        scaffold: Scaffold | None = None,
        master: str = "",
        config: object = None,
        max_wait_secs: float = 30 * 60,
        *,
        state: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        clock: Clock | None = None,
        goodput_dir: str | None = None,
    ) -> None:
        super().__init__(scaffold, master, config, state, device, clock)
        self._max_wait_secs = check_number("max_wait_secs", max_wait_secs)
        self._created = False
        self.goodput_dir = check_path("goodput_dir", goodput_dir)
        """Where this rank's goodput ledger goes (a ``MonitoredSession`` reads it), or None."""

    def create_session(self) -> Session:
        """Wait for a session whose state is ready.

        Polls every ``recovery_wait_secs`` of the session manager, up to ``max_wait_secs``.

        Under a process group of several ranks whose chief is rank 0, the first session then
        waits for the chief to be ready and receives its state (the restored checkpoint, or
        the chief's initialization): every replica starts from the same state.

        Returns:
            A session whose state the ready op reports ready.

        Raises:
            DeadlineExceededError: ``"Session was not ready after waiting %d secs."``.

        Distributed: with a process group, every rank's first session is a collective (see
        ``ChiefSessionCreator.create_session``).

        TF name: ``tf.compat.v1.train.WorkerSessionCreator.create_session``.
        """
        self._finalize()
        sess = self._get_session_manager().wait_for_session(
            self._master, config=self._config, max_wait_secs=self._max_wait_secs
        )
        first, self._created = not self._created, True
        if first:
            group = _replica_group(False, self._max_wait_secs, sess.state, self._clock)
            if group is not None:  # Start from the chief's state, as every replica must.
                info = group.wait_ready(_READY_POLL_SECS, self._max_wait_secs)
                group.broadcast_state(sess.state)
                sess.restored_checkpoint = info.get("checkpoint")
                self._join_replicas(sess, group, bool(info.get(_STREAMS_EACH_STEP)))
        else:
            self._follow_streams(sess)
        return sess

    def close(self, checkpoint_step: int | None = None) -> None:
        """Leave the replicas: stop gathering this rank's random streams and polling for an
        agreed stop (``MonitoredSession.close`` calls it).

        Args:
            checkpoint_step: As ``ChiefSessionCreator.close`` (unused here).

        TF name: none.
        """
        del checkpoint_step
        self._leave_replicas()
