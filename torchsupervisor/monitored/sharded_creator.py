"""``ShardedSessionCreator``: the session of every rank of a sharded state (FSDP2 / DTensor).

No rank holds the whole model, so no rank can restore for the others and broadcast (what the
chief of a replicated state does): every rank restores its own shards of one checkpoint (or
memory-tier snapshot), as the Supervisor's ``ShardedMode`` does
(``supervisor/sharded_restore.prepare_sharded``: the chief cleans the directory, the ranks
agree on what they would restore, restore through the ``SessionManager`` and check their
resume point). Before that the chief takes the writer lock of ``checkpoint_dir``. Then the
session gets the replica group (``Session.replicas``): every rank's
``ShardedCheckpointSaverHook`` saves with it. The agreed stop (``replica_stop``) ends every
rank's loop after the same number of steps, and a rank that leaves with an error vetoes the
checkpoints, so that the others neither wait for it nor save without it. With
``memory_tier``, each rank keeps snapshots of its own shards in host memory (and a copy on
the next node), restored by every rank or by none.

A session is not re-created in-process (``MonitoredSession``'s recovery from a preemption
error): the other ranks are inside the step's collectives with this one, so every rank must
start again together (``torchrun --max-restarts``); the second ``create_session`` raises.

Distributed: every rank of the process group makes one, with the same ``checkpoint_dir``.

TF name: none (TF's chief restored the parameter servers' variables for everyone).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from torchsupervisor.core.checks import check_number, check_path
from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.global_step import get_global_step, read_step
from torchsupervisor.core.session import Session
from torchsupervisor.distributed.replicas import ReplicaGroup
from torchsupervisor.errors import FailedPreconditionError
from torchsupervisor.hooks._global_step import is_step
from torchsupervisor.monitored.creators import _new_group, _ScaffoldedCreator, check_memory_tier
from torchsupervisor.monitored.scaffold import Scaffold
from torchsupervisor.storage import DirectoryLock, storage_for
from torchsupervisor.supervisor.mode_tiers import ModeTiers, TierSettings
from torchsupervisor.supervisor.modes import OPEN_POLL_SECS
from torchsupervisor.supervisor.sharded_restore import prepare_sharded
from torchsupervisor.tiers.memory import MemoryTier, MemoryTierConfig

if TYPE_CHECKING:
    import torch

__all__ = ["ShardedSessionCreator"]


class ShardedSessionCreator(_ScaffoldedCreator):
    """Create the session of one rank of a sharded state, restored with every other rank.

    Args:
        scaffold: The ``Scaffold`` (finalized at ``create_session``); None: a default one.
        master: ``""`` when the process group is already joined; ``"env://"`` or a
            ``Server.target`` to join it.
        config: Passed to the session.
        checkpoint_dir: The directory every rank restores from and saves to (shared by every
            rank); None: each rank initializes its shards.
        max_wait_secs: The longest wait for the other ranks at each agreement, in seconds.
        state: The training state (its modules' parameters DTensors); None: the scaffold's.
        device: Where the init op materializes meta-device modules.
        clock: Time source for waits.
        memory_tier: Each rank keeps the newest snapshots of its own shards in host memory
            as well (``checkpoint_dir`` needed; see ``Supervisor``'s ``memory_tier``): the
            ranks restore the newest step every rank holds there, or on a peer node, when it
            is newer than the newest checkpoint, and ``close`` frees it when the newest
            checkpoint holds the last step. None: off.

    Raises:
        ValueError: If ``state`` differs from a state the scaffold already has; for an
            argument out of range.
        TypeError: For an argument of the wrong type (a ``memory_tier`` that is not a
            ``MemoryTierConfig``).

    Distributed: every rank makes one; ``create_session`` is a collective.

    TF name: none (module docstring).
    """

    def __init__(
        self,
        scaffold: Scaffold | None = None,
        master: str = "",
        config: object = None,
        checkpoint_dir: str | None = None,
        *,
        max_wait_secs: float = 7200,
        state: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        clock: Clock | None = None,
        memory_tier: MemoryTierConfig | None = None,
    ) -> None:
        super().__init__(scaffold, master, config, state, device, clock)
        self._checkpoint_dir = check_path("checkpoint_dir", checkpoint_dir)
        self._max_wait_secs = check_number("max_wait_secs", max_wait_secs)
        self._memory_config = check_memory_tier(memory_tier)
        self._tiers: ModeTiers | None = None
        self._writer_lock: DirectoryLock | None = None
        self._created = False

    @property
    def checkpoint_dir(self) -> str | None:
        """The directory every rank restores from (and keeps its goodput ledger in), or None.

        TF name: none.
        """
        return self._checkpoint_dir

    @property
    def memory_tier(self) -> MemoryTier | None:
        """This rank's memory tier (of its shards) once a session started it; else None.

        TF name: none.
        """
        return None if self._tiers is None else self._tiers.memory

    @property
    def writer_lock(self) -> DirectoryLock | None:
        """(Chief) The writer lock of ``checkpoint_dir`` while a session holds it, else None.

        TF name: none.
        """
        return self._writer_lock

    def create_session(self) -> Session:
        """Create this rank's session, its shards restored from the checkpoint every rank
        restores, or initialized (module docstring).

        Returns:
            The session; ``restored_checkpoint`` names the checkpoint restored, and
            ``replicas`` is the replica group of its checkpoints.

        Raises:
            FailedPreconditionError: If the ranks see different checkpoints, resumed from
                different ones, or a session is created a second time.
            DeadlineExceededError: If a rank did not answer within ``max_wait_secs``.
            LogdirLockedError: (Chief) another process is writing to ``checkpoint_dir``.
            DataLossError: If ``checkpoint_dir`` has checkpoints and none is valid.
            RuntimeError: When the state cannot be made ready (``SessionManager``'s texts).

        Distributed: a collective of every rank.

        TF name: none (``SessionCreator.create_session``).
        """
        if self._created:
            raise FailedPreconditionError(
                None,
                None,
                "A session of a sharded state is not re-created in-process (the other ranks "
                "are inside this step's collectives): every rank must start again "
                "(torchrun --max-restarts)",
            )
        self._created = True
        saver = self._finalize()
        group = _sharded_group(self._clock)
        logdir = self._checkpoint_dir
        if group.rank == group.chief_rank and logdir:
            storage = storage_for(logdir)
            storage.makedirs(logdir)
            self._writer_lock = storage.lock(logdir)
        step = self._state.get("global_step")
        settings = TierSettings(
            memory_tier=self._memory_config,
            replica_logdir=logdir,
            saver=saver,
            global_step=step if is_step(step) else get_global_step(),
            is_chief=group.rank == group.chief_rank,
            clock=self._clock or REAL_CLOCK,
        )
        self._tiers = ModeTiers(settings, group)
        scaffold = self._scaffold
        sess = prepare_sharded(
            group,
            self._tiers,
            lambda tiers: self._get_session_manager().prepare_session(
                self._master,
                saver=saver,
                checkpoint_dir=logdir,
                config=self._config,
                init_op=scaffold.init_op,
                init_feed_dict=scaffold.init_feed_dict,
                init_fn=scaffold.init_fn,
                tiers=tiers,
            ),
            poll_secs=OPEN_POLL_SECS,
            max_wait_secs=self._max_wait_secs,
            clock=settings.clock,
        )
        sess.replicas = group
        # Each rank keeps its own streams; the final checkpoint of an agreed stop gets every
        # rank's (a restart from it continues them).
        self._join_replicas(sess, group, each_step=False, saves_together=True)
        return sess

    def close(self, checkpoint_step: int | None = None) -> None:
        """Leave the replicas, stop the memory tier and release the writer lock
        (``MonitoredSession.close`` calls it).

        Args:
            checkpoint_step: The step of the newest checkpoint the session's hooks committed
                or restored (known to every rank once a collective save returns; rank 0
                updates the state file after that): the memory tier is freed when it is the
                last step. None: kept.

        TF name: none.
        """
        self._leave_replicas()
        tiers, self._tiers = self._tiers, None
        if tiers is not None:
            step = tiers.settings.global_step
            tiers.close(step is not None and checkpoint_step == read_step(step))
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None


def _sharded_group(clock: Clock | None) -> ReplicaGroup:
    """The replica group of a sharded state's first session."""
    if not (dist.is_available() and dist.is_initialized()):
        raise FailedPreconditionError(
            None,
            None,
            "A sharded state needs its process group: join it first (master='env://', or "
            "torch.distributed.init_process_group)",
        )
    return _new_group(clock)
