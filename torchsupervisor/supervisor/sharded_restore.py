"""The restore of a sharded state (FSDP2 / DTensor): every rank restores its shards of the same
checkpoint or snapshot, or initializes them.

No rank holds the whole model, so no rank can restore for the others and broadcast (what the
chief of a replicated state does). The Supervisor's ``ShardedMode`` and the
``MonitoredTrainingSession``'s ``ShardedSessionCreator`` both prepare a session this way:

1. The chief (rank 0) removes what a crash left in the log directory and makes sure of the
   run's id (the caller holds its writer lock); the others wait for its word in the store.
2. Every rank lists the checkpoints it would try; the lists must be equal (a directory that is
   not shared, or a save racing the start, is an error on every rank).
3. With the memory tier, every rank opens its own (of its local shards), serves what its node
   holds to the others and offers the steps every rank holds (``tiers/agreed``, ``tiers/ring``).
4. Every rank restores through the ``SessionManager``: ``Saver.restore`` of a state of
   DTensors is a collective whose errors reach every rank, so a corrupt checkpoint makes every
   rank fall back to the same older one; an agreed snapshot restores on every rank or on none.
   With nothing to restore, each rank runs the init op and ``init_fn`` on its own shards.
5. The ranks check that they resumed from the same checkpoint at the same step; a rank whose
   restore failed raises a flag, and the others stop waiting for it. The memory tier then
   snapshots from that step on.

Distributed: every rank calls ``prepare_sharded`` once per session, in the same order.

TF name: none (TF's chief restored the parameter servers' variables for everyone).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from torchsupervisor.checkpoint.recovery import clean_checkpoint_dir, restore_candidates
from torchsupervisor.checkpoint.run_id import ensure_run_id
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.global_step import read_step
from torchsupervisor.core.session import Session
from torchsupervisor.distributed.replicas import ReplicaGroup, agree
from torchsupervisor.supervisor.mode_tiers import ModeTiers
from torchsupervisor.tiers.agreed import agreed_tier
from torchsupervisor.tiers.local_disk import LOCAL_TIER
from torchsupervisor.tiers.tier import SnapshotTier

__all__ = ["prepare_sharded"]


def prepare_sharded(
    replicas: ReplicaGroup,
    tiers: ModeTiers,
    prepare: Callable[[Sequence[SnapshotTier]], Session],
    *,
    poll_secs: float,
    max_wait_secs: float,
    clock: Clock,
) -> Session:
    """Prepare this rank's session of a sharded state with every other rank (module docstring).

    Args:
        replicas: The session's replica group.
        tiers: This rank's memory tier and peers (not opened yet); its settings give the log
            directory (``replica_logdir``), the saver, the global step and the memory tier.
        prepare: Prepares the session through the ``SessionManager``, restoring from the log
            directory and the snapshot tiers it is given.
        poll_secs: How often a non-chief looks for the chief's word, in seconds.
        max_wait_secs: The longest wait for the other ranks at each agreement, in seconds.
        clock: Time source of the waits.

    Returns:
        The session, restored or initialized.

    Raises:
        FailedPreconditionError: If the ranks see different checkpoints or resumed from
            different ones.
        DeadlineExceededError: If a rank did not answer within ``max_wait_secs``.
        Exception: What ``prepare`` raised (after the flag that releases the other ranks).
    """
    st = tiers.settings
    logdir = st.replica_logdir
    if replicas.rank == replicas.chief_rank:
        if logdir:
            clean_checkpoint_dir(logdir)
            ensure_run_id(logdir)  # Before the others read it (the memory tier).
        replicas.publish_ready({}, name="restore/open")
    else:
        replicas.wait_ready(poll_secs, max_wait_secs, name="restore/open", clock=clock)
    candidates = restore_candidates(logdir) if logdir and st.saver is not None else []
    agree(
        replicas,
        "restore/candidates",
        {"logdir": bool(logdir), "candidates": [os.path.basename(c) for c in candidates]},
        max_wait_secs,
        what="the checkpoints to restore from (is the logdir shared by every replica?)",
    )
    opened = tiers.open(sharded=True)
    config = st.memory_tier
    if config is not None and logdir and st.saver is not None:
        ring = tiers.exchange_ring()
        memory = tiers.memory
        agreed = [agreed_tier(memory, replicas, max_wait_secs, **ring)]
        if config.local_disk is not None:  # The same on every rank.
            local = None if memory is None else memory.local_disk
            agreed.append(agreed_tier(local, replicas, max_wait_secs, name=LOCAL_TIER))
        opened = [t for t in agreed if t is not None]
    try:
        sess = prepare(opened)
    except Exception as e:
        replicas.raise_flag("restore/failed", f"rank {replicas.rank}: {type(e).__name__}: {e}")
        raise
    restored = sess.restored_checkpoint
    step = None if st.global_step is None else read_step(st.global_step)
    tiers.drop_abandoned(step)  # Before any rank sends.
    agree(
        replicas,
        "restore/result",
        {"checkpoint": os.path.basename(restored) if restored else None, "step": step},
        max_wait_secs,
        what="the resume point",
        abort="restore/failed",
    )
    tiers.start(sess)
    return sess
