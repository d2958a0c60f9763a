"""Who keeps a copy of the chief's memory tier, and how a restarted chief gets it back.

At each start of a replicated run (DDP) with the memory tier, every rank posts through the
process group's store (``ReplicaGroup.post``) its node, and every rank but the chief the
address of the ``PeerServer`` it starts and the steps of the copies it holds. The chief
gathers the posts, and:

* before its restore: if a peer holds a newer copy of its snapshots than its own memory and
  the checkpoint directory, it fetches that copy into its own memory tier (the restore then
  checks every byte of it, as of any snapshot);
* after: it sends each snapshot it commits to the first rank on another node (the ring's
  next node), through a ``PeerSender``. With every rank on one node there is no peer: a lost
  node would take the copy with it.

Thread safety: on the training thread, at the start and the end of a session.

TF name: none.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from torchsupervisor.checkpoint.files import checkpoint_step, remove_checkpoint
from torchsupervisor.checkpoint.recovery import scan_checkpoints
from torchsupervisor.distributed.launcher import current_launcher
from torchsupervisor.errors import DeadlineExceededError
from torchsupervisor.tiers.memory_root import memory_root, rank_directory
from torchsupervisor.tiers.peer import (
    PeerSender,
    PeerServer,
    fetch_snapshot,
    peer_directory,
)
from torchsupervisor.tiers.tier import snapshot_files

if TYPE_CHECKING:
    from collections.abc import Iterator

    from torchsupervisor.distributed.replicas import ReplicaGroup
    from torchsupervisor.tiers.memory import MemoryTier, MemoryTierConfig

__all__ = [
    "PEER_HOST_ENV",
    "adopt_local_copy",
    "choose_peer",
    "drop_abandoned",
    "exchange",
    "fetch_newer",
    "peer_host",
    "serve_copies",
]

logger = logging.getLogger("torchsupervisor")

POSTS = "memory/peers"
PEER_HOST_ENV = "TORCHSUPERVISOR_PEER_HOST"
"""The address this node's ``PeerServer`` listens on, as the other nodes reach it."""
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_OWNER = 0  # The chief: the rank whose snapshots are copied (a replicated state's only one).


def peer_host() -> str:
    """``$TORCHSUPERVISOR_PEER_HOST``; else the loopback when the ranks meet on it (every
    node on this host: the launcher's rendezvous address); else this host's address."""
    host = os.environ.get(PEER_HOST_ENV)
    if host:
        return host
    if (current_launcher().master_addr or "127.0.0.1") in _LOOPBACK:
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def serve_copies(config: MemoryTierConfig, logdir: str) -> PeerServer:
    """Start this rank's server of copies of the chief's snapshots (a non-chief)."""
    root = memory_root(config.root)
    run_directory = os.path.dirname(rank_directory(root, logdir, _OWNER))
    return PeerServer(root, run_directory, peer_host(), owners=(_OWNER,))


def exchange(
    replicas: ReplicaGroup, node: int, server: PeerServer | None, timeout_secs: float
) -> list[dict[str, Any]] | None:
    """Post this rank's node and server; return every rank's post (None on the chief when some
    rank did not post in time: no peers then, with a warning; None on the others)."""
    post: dict[str, Any] = {"node": node}
    if server is not None:
        holds = server.holds().get(_OWNER, [])
        post.update(address=server.address, token=server.token, holds=holds)
    replicas.post(POSTS, post)
    if replicas.rank != _OWNER:
        return None
    try:
        return replicas.gather(POSTS, timeout_secs, what="the memory tier's peers")
    except DeadlineExceededError as e:
        logger.warning("No peer replicas of the memory tier: %s", e)
        return None


def _floor(memory: MemoryTier, newest_elsewhere: int | None) -> int:
    own = [s.step for s in memory.snapshots()]
    return max([-1, *own, *([] if newest_elsewhere is None else [newest_elsewhere])])


def adopt_local_copy(memory: MemoryTier, newest_elsewhere: int | None) -> str | None:
    """Copy into ``memory`` the newest copy of the chief's snapshots that this node keeps as
    a peer (a chief restarted on the node that was its peer) when it is newer than the
    memory's own snapshots and ``newest_elsewhere``; return its prefix, or None."""
    directory = peer_directory(os.path.dirname(memory.directory), _OWNER)
    storage = memory.storage
    if not storage.is_dir(directory):
        return None
    try:
        return _adopt(memory, directory, newest_elsewhere)
    finally:  # The chief keeps no copy of its own snapshots beside them.
        storage.remove_directory(memory_root(memory.config.root), directory)


def _adopt(memory: MemoryTier, directory: str, newest_elsewhere: int | None) -> str | None:
    storage = memory.storage
    held = scan_checkpoints(directory, storage=storage)
    step = checkpoint_step(held[0]) if held else None
    if step is None or step <= _floor(memory, newest_elsewhere):
        return None
    names = snapshot_files(held[0], storage)
    prefix = os.path.join(memory.directory, os.path.basename(held[0]))
    try:
        for name in names:  # The data first, the manifest last: committed when complete.
            with storage.open_read(os.path.join(directory, name)) as f:
                storage.put_streamed(os.path.join(memory.directory, name), _chunks(f.stream()))
    except OSError as e:
        remove_checkpoint(prefix, storage=storage)
        logger.warning("Could not take the peer copy of step %d kept on this node: %s", step, e)
        return None
    logger.warning("Took the memory tier's snapshot of step %d from this node's peer copy", step)
    return prefix


def _chunks(f: Any) -> Iterator[bytes]:
    while chunk := f.read(8 << 20):
        yield chunk


def fetch_newer(
    memory: MemoryTier, posts: list[dict[str, Any]], newest_elsewhere: int | None
) -> str | None:
    """Fetch the newest copy a peer holds into ``memory`` when it is newer than the memory's
    own snapshots and ``newest_elsewhere`` (the checkpoint directory's newest step); return
    its prefix, or None."""
    floor = _floor(memory, newest_elsewhere)
    offers = sorted(
        ((step, rank) for rank, post in enumerate(posts) for step in post.get("holds") or ()),
        reverse=True,
    )
    for step, rank in offers:
        if step <= floor:
            break
        post = posts[rank]
        try:
            prefix = fetch_snapshot(
                post["address"],
                post["token"],
                _OWNER,
                step,
                memory_root(memory.config.root),
                memory.directory,
            )
        except Exception as e:
            logger.warning(
                "Could not fetch the peer copy of step %d from rank %d (%s): %s",
                step,
                rank,
                post["address"],
                e,
            )
            continue
        logger.warning(
            "Fetched the memory tier's snapshot of step %d from its peer copy on rank %d",
            step,
            rank,
        )
        return prefix
    return None


def drop_abandoned(server: PeerServer, step: int) -> None:
    """On a rank keeping copies, once the chief restored ``step`` and before it sends again:
    delete the copies newer than it (a timeline the restart abandoned), so that a later
    restart never takes them."""
    for dropped in server.drop_newer(_OWNER, step):
        logger.info("Deleted the peer copy of step %d: the run restored step %d", dropped, step)


def choose_peer(posts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rank the chief sends its snapshots to: the first on another node (None: none)."""
    node = posts[_OWNER].get("node")
    for post in posts[_OWNER + 1 :]:
        if post.get("node") != node and post.get("address"):
            return post
    return None


def start_sender(posts: list[dict[str, Any]] | None, every_secs: float = 0.0) -> PeerSender | None:
    """The chief's sender to its peer (a send at most once per ``every_secs``), or None (no
    posts, no rank on another node)."""
    peer = None if posts is None else choose_peer(posts)
    if peer is None:
        if posts is not None:
            logger.info("No rank on another node: the memory tier has no peer replica")
        return None
    return PeerSender(peer["address"], peer["token"], _OWNER, every_secs)
