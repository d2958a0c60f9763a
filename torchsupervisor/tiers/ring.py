"""Peer copies of a sharded run's memory tier: every rank's snapshots kept on the next node.

In a sharded run (FSDP2) each rank's snapshot holds only its own part of the state, so a lost
node takes its ranks' parts with it. So every rank sends each snapshot it commits to the rank
in the same position on the next node of a ring (the nodes in the order of their lowest rank;
positions wrap when the next node has fewer ranks), which keeps the newest ``keep`` copies
(the tier's slots: the ranks' writers may be snapshots apart, and a restore needs one step
that every rank holds).

At each start every rank runs a ``PeerServer`` that takes copies from any rank and gives back
any snapshot its node holds: the copies, and the node's own ``rank-<r>`` directories (a rank
lost with its node comes back with its number on another node, and torchrun may renumber the
ranks: the part of rank r is wherever a ``rank-r`` or ``peer-r`` directory holds it). The ranks
post their node, server and holdings, and each counts as held the steps of its own part that
its memory holds or some node offers. The agreed restore (``tiers/agreed``) then fetches this
rank's part of the step chosen when its memory lacks it (its own node first, then the others),
and checks every byte of it as of any snapshot; a copy that fails is replaced by the next
node's. Nothing is read from disk or the bucket as long as one copy of every part survives.

Thread safety: on the training thread, at the start and the end of a session.

TF name: none.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torchsupervisor.errors import DeadlineExceededError
from torchsupervisor.tiers.memory_root import memory_root, rank_directory
from torchsupervisor.tiers.peer import PeerSender, PeerServer, fetch_snapshot, remove_newer
from torchsupervisor.tiers.replication import peer_host

if TYPE_CHECKING:
    from torchsupervisor.distributed.replicas import ReplicaGroup
    from torchsupervisor.tiers.memory import MemoryTier, MemoryTierConfig

__all__ = [
    "drop_abandoned",
    "exchange",
    "fetcher",
    "offered_steps",
    "remove_leftovers",
    "ring_target",
    "serve",
    "start_sender",
]

logger = logging.getLogger("torchsupervisor")

POSTS = "memory/ring"


def ring_target(nodes: list[int], rank: int) -> int | None:
    """The rank that keeps the copies of ``rank``'s snapshots: the one in the same position
    (modulo its node's size) on the next node of the ring; None with a single node.

    Args:
        nodes: By rank, the node of each rank (any node ids).
        rank: The rank whose snapshots are sent.
    """
    members: dict[int, list[int]] = {}
    for r, node in enumerate(nodes):
        members.setdefault(node, []).append(r)  # Nodes in the order of their lowest rank.
    order = list(members)
    if len(order) < 2:
        return None
    node = nodes[rank]
    position = members[node].index(rank)
    following = members[order[(order.index(node) + 1) % len(order)]]
    return following[position % len(following)]


def serve(config: MemoryTierConfig, logdir: str, keep: int) -> PeerServer:
    """Start this rank's server: copies from any rank (``keep`` of each), and every snapshot
    of this node's memory given back."""
    root = memory_root(config.root)
    run_directory = os.path.dirname(rank_directory(root, logdir, 0))
    return PeerServer(root, run_directory, peer_host(), owners=None, keep=keep, local=True)


def exchange(
    replicas: ReplicaGroup, node: int, server: PeerServer | None, timeout_secs: float
) -> list[dict[str, Any]] | None:
    """Post this rank's node, server and holdings; return every rank's post (None, with a
    warning, when some rank did not post in time: no copies are fetched or sent then)."""
    post: dict[str, Any] = {"node": node}
    if server is not None:
        holds = {str(owner): steps for owner, steps in server.holds().items()}
        post.update(address=server.address, token=server.token, holds=holds)
    replicas.post(POSTS, post)
    try:
        return replicas.gather(POSTS, timeout_secs, what="the memory tier's ring of copies")
    except DeadlineExceededError as e:
        logger.warning("No peer copies of the memory tier: %s", e)
        return None


def _sources(posts: list[dict[str, Any]], owner: int, step: int) -> list[int]:
    """The ranks whose servers offer ``owner``'s part of ``step``, its own node's first."""
    offering = [
        rank
        for rank, post in enumerate(posts)
        if post.get("address") and step in (post.get("holds") or {}).get(str(owner), ())
    ]
    node = posts[owner].get("node")
    return sorted(offering, key=lambda rank: posts[rank].get("node") != node)


def offered_steps(posts: list[dict[str, Any]], owner: int) -> list[int]:
    """The steps of rank ``owner``'s part that some node offers, newest first."""
    steps = {s for post in posts for s in (post.get("holds") or {}).get(str(owner), ())}
    return sorted(steps, reverse=True)


def fetcher(memory: MemoryTier, posts: list[dict[str, Any]]) -> Any:
    """A function of a step yielding, one at a time, this rank's part of it fetched into
    ``memory`` from each node that offers it (its own first); a fetch that fails is logged
    and the next node is tried."""
    owner = memory.rank
    root = memory_root(memory.config.root)

    def fetch(step: int) -> Iterator[str]:
        for rank in _sources(posts, owner, step):
            post = posts[rank]
            try:
                prefix = fetch_snapshot(
                    post["address"], post["token"], owner, step, root, memory.directory
                )
            except Exception as e:
                logger.warning(
                    "Could not fetch the copy of step %d of rank %d from rank %d (%s): %s",
                    step,
                    owner,
                    rank,
                    post["address"],
                    e,
                )
                continue
            logger.warning(
                "Fetched rank %d's part of step %d of the memory tier from rank %d's node (a "
                "peer copy)",
                owner,
                step,
                rank,
            )
            yield prefix

    return fetch


def start_sender(posts: list[dict[str, Any]] | None, rank: int) -> PeerSender | None:
    """This rank's sender to its ring target, or None (no posts, one node, no server)."""
    if posts is None:
        return None
    target = ring_target([post.get("node", 0) for post in posts], rank)
    if target is None:
        logger.info("Every rank is on one node: the memory tier has no peer copies")
        return None
    peer = posts[target]
    if not peer.get("address"):
        logger.warning("Rank %d keeps no copies: rank %d's snapshots have none", target, rank)
        return None
    return PeerSender(peer["address"], peer["token"], rank)


def _lowest_on_node(posts: list[dict[str, Any]], node: int) -> int:
    return min(r for r, post in enumerate(posts) if post.get("node") == node)


def drop_abandoned(memory: MemoryTier, posts: list[dict[str, Any]], node: int, step: int) -> None:
    """After the agreed restore of ``step`` and before any rank sends again, on the lowest
    rank of each node: delete the node's snapshots newer than ``step`` that no tier of its
    ranks owns (the copies, and the snapshots of ranks now on other nodes). They belong to a
    timeline the restart abandoned, and a later restart must never take them; each rank's own
    tier deletes its own (``MemoryTier.start``)."""
    if _lowest_on_node(posts, node) != memory.rank:
        return
    local = {f"rank-{r}" for r, post in enumerate(posts) if post.get("node") == node}
    run_directory = os.path.dirname(memory.directory)
    storage = memory.storage
    for name in storage.list(run_directory) if storage.is_dir(run_directory) else ():
        if name in local or not name.startswith(("peer-", "rank-")):
            continue
        remove_newer(os.path.join(run_directory, name), step, storage)


def remove_leftovers(memory: MemoryTier, posts: list[dict[str, Any]], node: int) -> None:
    """At a clean end, on the lowest rank of each node, after every rank of the run has closed
    its tier and its sender: delete what the node still holds of the run (the copies, and the
    snapshots of ranks that are now on other nodes)."""
    if _lowest_on_node(posts, node) != memory.rank:
        return
    root = memory_root(memory.config.root)
    run_directory = os.path.dirname(memory.directory)
    storage = memory.storage
    for name in storage.list(run_directory) if storage.is_dir(run_directory) else ():
        storage.remove_directory(root, os.path.join(run_directory, name))
