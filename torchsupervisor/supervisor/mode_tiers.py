"""A mode's memory tier and its peer replicas: opened before the restore, started with the
session, closed (and freed when the final checkpoint holds the last step) at its end.

* One process, or the chief of a replicated run (DDP): the memory tier of the chief's state;
  with replicas, the chief sends each snapshot to a peer on another node, and a restarted
  chief takes a newer copy before its restore (``tiers/replication``).
* A non-chief of a replicated run: serves the chief's copies (``stop_serving`` at its end
  frees them on the chief's word).
* Every rank of a sharded run (FSDP2): a memory tier of its own shards (``open(sharded=True)``;
  the ranks agree on the step to restore in ``ShardedMode``, ``tiers/agreed``), each rank's
  snapshots sent to the next node of a ring, and a server of what the node holds
  (``exchange_ring``, ``tiers/ring``).

Thread safety: the training thread, as the mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

from torchsupervisor.checkpoint.files import checkpoint_step
from torchsupervisor.checkpoint.recovery import restore_candidates
from torchsupervisor.checkpoint.run_id import ensure_run_id, read_run_id
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.session import Session
from torchsupervisor.distributed import env as distributed
from torchsupervisor.distributed.launcher import current_launcher
from torchsupervisor.distributed.replicas import ReplicaGroup
from torchsupervisor.errors import DeadlineExceededError
from torchsupervisor.tiers import replication, ring
from torchsupervisor.tiers.memory import MEMORY_TIER, MemoryTier, MemoryTierConfig
from torchsupervisor.tiers.peer import PeerSender, PeerServer
from torchsupervisor.tiers.tier import SnapshotTier

__all__ = ["PEER_END", "PEER_EXCHANGE_SECS", "RING_END", "ModeTiers", "TierSettings"]

logger = logging.getLogger("torchsupervisor")

PEER_EXCHANGE_SECS = 120.0
"""The longest the chief waits for the other ranks' peer posts, and for a last send (s)."""

PEER_END = "memory/end"
"""Where the chief says whether the copies of its memory tier may be freed."""

RING_END = "memory/ring-end"
"""Where each rank of a sharded run says it has sent its last copy and freed its tier."""


@dataclasses.dataclass(frozen=True)
class TierSettings:
    """What ``ModeTiers`` reads of its owner's settings: the Supervisor's arguments of the
    same names (``Settings``; ``replica_logdir``: the log directory, on every rank), or a
    ``ShardedSessionCreator``'s."""

    memory_tier: MemoryTierConfig | None
    replica_logdir: str | None
    saver: Any
    global_step: Any
    is_chief: bool
    clock: Clock

    @classmethod
    def of(cls, settings: Any) -> TierSettings:
        """The fields of ``settings`` (any object with these attributes: ``Settings``)."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})


class ModeTiers:
    """The memory tier and peer replicas of one mode (module docstring).

    Args:
        settings: What it reads of its owner's settings (``TierSettings.of``).
        replicas: The run's ranks, or None for one process.

    Attributes:
        memory: This rank's memory tier once opened (None: off, or not this rank's).
        peer_server: The server of the chief's copies (a non-chief of a replicated run).
        peer_sender: The chief's sender of its snapshots to its peer.
    """

    def __init__(self, settings: TierSettings, replicas: ReplicaGroup | None) -> None:
        self.settings = settings
        self.replicas = replicas
        self.memory: MemoryTier | None = None
        self.peer_server: PeerServer | None = None
        self.peer_sender: PeerSender | None = None
        self.ring_posts: list[dict[str, Any]] | None = None

    def open(self, sharded: bool = False) -> list[SnapshotTier]:
        """This rank's memory tier and its local-disk tier (``MemoryTier.tiers``), opened
        before the restore (``memory_tier`` set); of its local shards with ``sharded``."""
        st = self.settings
        logdir = st.replica_logdir
        if st.memory_tier is None or not logdir or st.saver is None:
            return []
        if st.global_step is None:
            logger.warning("The memory tier needs a global step; it is off")
            return []
        run_id = ensure_run_id(logdir) if st.is_chief else read_run_id(logdir)
        if run_id is None:
            logger.warning("No run id in %s: the memory tier is off on this rank", logdir)
            return []
        self.memory = MemoryTier(
            st.memory_tier,
            logdir,
            run_id,
            rank=distributed.rank(),
            sharded=sharded,
            world_size=distributed.world_size() if sharded else 1,
            clock=st.clock,
        )
        return self.memory.tiers

    def start(self, sess: Session) -> None:
        """Snapshot into the memory tier from now on (the state restored or initialized)."""
        if self.memory is None:
            return
        from_memory = sess.restored_tier == MEMORY_TIER
        self.memory.start(
            sess, self.settings.global_step, sess.restored_checkpoint if from_memory else None
        )
        if self.ring_posts is not None:
            self.peer_sender = ring.start_sender(self.ring_posts, self.memory.rank)
            if self.peer_sender is not None and self.memory.config.peer_every_secs:
                logger.warning(
                    "MemoryTierConfig.peer_every_secs is for replicated runs: a sharded run "
                    "sends every snapshot to its peer"
                )
        if self.peer_sender is not None:
            self.memory.on_commit = self.peer_sender.offer

    def exchange_ring(self) -> dict[str, Any]:
        """A sharded run with the memory tier, on every rank: serve this node's snapshots and
        copies, gather every rank's post (``tiers/ring``); return ``agreed_tier``'s
        ``offered`` and ``fetch`` for this rank."""
        st = self.settings
        replicas, logdir = self.replicas, st.replica_logdir
        if replicas is None or st.memory_tier is None or not logdir:
            return {}
        memory = self.memory
        if memory is not None:
            try:
                self.peer_server = ring.serve(st.memory_tier, logdir, memory.slots)
            except OSError as e:
                logger.warning("This rank keeps no peer copies of the memory tier: %s", e)
        node = current_launcher().node_id
        posts = ring.exchange(replicas, node, self.peer_server, PEER_EXCHANGE_SECS)
        self.ring_posts = posts
        if posts is None or memory is None:
            return {}
        return {
            "offered": ring.offered_steps(posts, memory.rank),
            "fetch": ring.fetcher(memory, posts),
        }

    def exchange_peers(self) -> None:
        """With replicas and the memory tier: the chief gathers the peers' copies (fetching a
        newer one before its restore) and picks the peer it sends to; every other rank
        serves copies (``tiers/replication.py``)."""
        st = self.settings
        replicas, logdir = self.replicas, st.replica_logdir
        if replicas is None or st.memory_tier is None or not logdir:
            return
        node = current_launcher().node_id
        if not st.is_chief:
            try:
                self.peer_server = replication.serve_copies(st.memory_tier, logdir)
            except OSError as e:
                logger.warning("This rank keeps no peer replica of the memory tier: %s", e)
            replication.exchange(replicas, node, self.peer_server, PEER_EXCHANGE_SECS)
            return
        if self.memory is None:
            return
        posts = replication.exchange(replicas, node, None, PEER_EXCHANGE_SECS)
        candidates = restore_candidates(logdir)
        newest = checkpoint_step(candidates[0]) if candidates else None
        replication.adopt_local_copy(self.memory, newest)
        if posts is None:
            return
        replication.fetch_newer(self.memory, posts, newest)
        self.peer_sender = replication.start_sender(posts, st.memory_tier.peer_every_secs)

    def close_peers(self, free: bool) -> None:
        """Stop sending (after the snapshot being sent) and serving; with ``free``, delete
        the copies this rank keeps."""
        sender, self.peer_sender = self.peer_sender, None
        if sender is not None:
            sender.close(PEER_EXCHANGE_SECS)
        server, self.peer_server = self.peer_server, None
        if server is not None:
            try:
                server.close(free=free)
            except OSError as e:
                logger.warning("Could not free the peer replica at %s: %s", server.directory, e)

    def drop_abandoned(self, step: int | None) -> None:
        """After the restore of ``step`` (the same on every rank) and before any rank sends:
        delete the copies newer than it, of a timeline the restart abandoned (a sharded run:
        ``ring.drop_abandoned``; a replicated run's non-chief: its copies of the chief's)."""
        memory, posts, server = self.memory, self.ring_posts, self.peer_server
        if step is None:
            return
        try:
            if posts is not None and memory is not None:
                ring.drop_abandoned(memory, posts, current_launcher().node_id, step)
            elif posts is None and server is not None:
                replication.drop_abandoned(server, step)
        except OSError as e:
            logger.warning("Could not delete the copies newer than step %d: %s", step, e)

    def close(self, saved: bool) -> None:
        """Stop the memory tier and the peers; free them with ``saved`` (the newest checkpoint
        holds the current step)."""
        if self.ring_posts is not None:
            self._close_ring(saved)
            return
        if self.memory is not None:
            self.memory.on_commit = None  # Nothing more goes to the peer after its close.
        self.close_peers(saved)
        if self.replicas is not None and self.settings.memory_tier is not None:
            # The ranks keeping copies free them on this word (``WorkerMode.stop``).
            with contextlib.suppress(Exception):
                self.replicas.publish_ready({"free": saved}, name=PEER_END)
        memory, self.memory = self.memory, None
        if memory is None:
            return
        try:
            memory.close(free=saved)
        except OSError as e:
            logger.warning("Could not free the memory tier at %s: %s", memory.directory, e)

    def _close_ring(self, saved: bool) -> None:
        """A sharded run's end on every rank: stop sending (after the snapshot being sent),
        close the tier; with ``saved`` on every rank (they wait for each other, at most
        ``PEER_EXCHANGE_SECS``, so that no copy arrives after), the lowest rank of each node
        frees what the node still holds of the run."""
        posts, self.ring_posts = self.ring_posts, None
        memory, self.memory = self.memory, None
        if memory is not None:
            memory.on_commit = None
        sender, self.peer_sender = self.peer_sender, None
        if sender is not None:
            sender.close(PEER_EXCHANGE_SECS)
        if memory is not None:
            try:
                memory.close(free=saved)
            except OSError as e:
                logger.warning("Could not free the memory tier at %s: %s", memory.directory, e)
        replicas = self.replicas
        everyone = False
        if replicas is not None:
            replicas.post(RING_END, saved)
            if saved:
                try:
                    everyone = all(
                        replicas.gather(RING_END, PEER_EXCHANGE_SECS, what="the ring's end")
                    )
                except DeadlineExceededError as e:
                    logger.info("Keeping the peer copies of the memory tier: %s", e)
        self.close_peers(False)
        if everyone and memory is not None and posts is not None:
            try:
                ring.remove_leftovers(memory, posts, current_launcher().node_id)
            except OSError as e:
                logger.warning("Could not free the peer copies of the memory tier: %s", e)

    def stop_serving(self, aborted: bool) -> None:
        """A non-chief's end: stop serving peer copies; free them when the chief says its
        final checkpoint holds the last step (it publishes that at its own end; waited for at
        most ``PEER_EXCHANGE_SECS``). With ``aborted`` (a second signal, or a session that
        ended with an error: the chief may be gone) nothing is waited for and the copies are
        kept (the next start of the run replaces them)."""
        free = False
        if self.peer_server is not None and self.replicas is not None and not aborted:
            try:
                st = self.settings
                info = self.replicas.wait_ready(
                    0.05, PEER_EXCHANGE_SECS, name=PEER_END, clock=st.clock
                )
                free = bool(info.get("free"))
            except Exception as e:
                logger.info("Keeping the peer copy of the memory tier: %s", e)
        self.close_peers(free)
