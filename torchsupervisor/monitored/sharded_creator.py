"""``ShardedSessionCreator``: the session of every rank of a sharded state (FSDP2 / DTensor).

No rank holds the whole model, so no rank can restore for the others and broadcast (what the
chief of a replicated state does): every rank restores its own shards, and they must be the
shards of one checkpoint. The first session of each rank, in this order (as the Supervisor's
``ShardedMode``):

1. The chief (rank 0) takes the writer lock of ``checkpoint_dir``, removes what a crash left
   there and makes sure of the run's id; the others wait for its word in the store.
2. Every rank lists the checkpoints it would try; the lists must be equal (a directory that
   is not shared, or a save racing the start, is an error on every rank).
3. Every rank restores through the ``SessionManager``: ``Saver.restore`` of a state of
   DTensors is a collective whose errors reach every rank, so a corrupt checkpoint makes
   every rank fall back to the same older one. With nothing to restore, each rank runs the
   init op and ``init_fn`` on its own shards.
4. The ranks check that they resumed from the same checkpoint at the same step; a rank whose
   restore failed raises a flag, and the others stop waiting for it.
5. The session gets the replica group (``Session.replicas``): every rank's
   ``ShardedCheckpointSaverHook`` saves with it. The agreed stop (``replica_stop``) ends
   every rank's loop after the same number of steps, and a rank that leaves with an error
   vetoes the checkpoints, so that the others neither wait for it nor save without it.

A session is not re-created in-process (``MonitoredSession``'s recovery from a preemption
error): the other ranks are inside the step's collectives with this one, so every rank must
start again together (``torchrun --max-restarts``); the second ``create_session`` raises.

Distributed: every rank of the process group makes one, with the same ``checkpoint_dir``.

TF name: none (TF's chief restored the parameter servers' variables for everyone).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from torchsupervisor.checkpoint.recovery import clean_checkpoint_dir, restore_candidates
from torchsupervisor.checkpoint.run_id import ensure_run_id
from torchsupervisor.core.checks import check_number, check_path
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.global_step import get_global_step, read_step
from torchsupervisor.core.session import Session
from torchsupervisor.distributed.replicas import ReplicaGroup, agree
from torchsupervisor.errors import FailedPreconditionError
from torchsupervisor.hooks._global_step import session_global_step
from torchsupervisor.monitored.creators import _new_group, _ScaffoldedCreator
from torchsupervisor.monitored.scaffold import Scaffold
from torchsupervisor.storage import DirectoryLock, storage_for

if TYPE_CHECKING:
    import torch

__all__ = ["ShardedSessionCreator"]

_OPEN_POLL_SECS = 0.05
"""How often a non-chief looks at the store for the chief's word that the directory is
ready, in seconds (one store check; the Supervisor's ``OPEN_POLL_SECS``)."""


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

    Raises:
        ValueError: If ``state`` differs from a state the scaffold already has; for an
            argument out of range.
        TypeError: For an argument of the wrong type.

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
    ) -> None:
        super().__init__(scaffold, master, config, state, device, clock)
        self._checkpoint_dir = check_path("checkpoint_dir", checkpoint_dir)
        self._max_wait_secs = check_number("max_wait_secs", max_wait_secs)
        self._writer_lock: DirectoryLock | None = None
        self._created = False

    @property
    def checkpoint_dir(self) -> str | None:
        """The directory every rank restores from (and keeps its goodput ledger in), or None.

        TF name: none.
        """
        return self._checkpoint_dir

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
        if group.rank == group.chief_rank:
            if logdir:
                storage = storage_for(logdir)
                storage.makedirs(logdir)
                self._writer_lock = storage.lock(logdir)
                clean_checkpoint_dir(logdir)
                ensure_run_id(logdir)  # The run's identity, kept across restarts.
            group.publish_ready({}, name="restore/open")
        else:
            group.wait_ready(
                _OPEN_POLL_SECS, self._max_wait_secs, name="restore/open", clock=self._clock
            )
        candidates = restore_candidates(logdir) if logdir and saver is not None else []
        agree(
            group,
            "restore/candidates",
            {"logdir": bool(logdir), "candidates": [os.path.basename(c) for c in candidates]},
            self._max_wait_secs,
            what="the checkpoints to restore from (is checkpoint_dir shared by every rank?)",
        )
        scaffold = self._scaffold
        try:
            sess = self._get_session_manager().prepare_session(
                self._master,
                saver=saver,
                checkpoint_dir=logdir,
                config=self._config,
                init_op=scaffold.init_op,
                init_feed_dict=scaffold.init_feed_dict,
                init_fn=scaffold.init_fn,
            )
        except Exception as e:
            group.raise_flag("restore/failed", f"rank {group.rank}: {type(e).__name__}: {e}")
            raise
        restored = sess.restored_checkpoint
        step = session_global_step(sess, get_global_step())
        agree(
            group,
            "restore/result",
            {
                "checkpoint": os.path.basename(restored) if restored else None,
                "step": None if step is None else read_step(step),
            },
            self._max_wait_secs,
            what="the resume point",
            abort="restore/failed",
        )
        sess.replicas = group
        # Each rank keeps its own streams; the final checkpoint of an agreed stop gets every
        # rank's (a restart from it continues them).
        self._join_replicas(sess, group, each_step=False, saves_together=True)
        return sess

    def close(self) -> None:
        """Leave the replicas and release the writer lock (``MonitoredSession.close``).

        TF name: none.
        """
        self._leave_replicas()
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
