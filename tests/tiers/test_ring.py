"""The ring of a sharded run's peer copies (``tiers/ring``): which rank keeps whose copies, a
server keeping several copies per rank and giving back the node's own snapshots, and an
agreed restore that fetches this rank's part from its peers, refusing a damaged copy for the
next node's."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist

import torchsupervisor as ts
from torchsupervisor.checkpoint.run_id import ensure_run_id
from torchsupervisor.cli import main as cli_main
from torchsupervisor.core.session import Session
from torchsupervisor.distributed.replicas import ReplicaGroup
from torchsupervisor.tiers import ring
from torchsupervisor.tiers.agreed import agreed_tier
from torchsupervisor.tiers.memory import MemoryTier
from torchsupervisor.tiers.memory_root import memory_root, rank_directory
from torchsupervisor.tiers.peer import PeerServer, fetch_snapshot, send_snapshot

RUN_ID = "b" * 32


@pytest.mark.parametrize(
    ("nodes", "targets"),
    [
        ([0, 1], [1, 0]),
        ([0, 0, 1, 1], [2, 3, 0, 1]),  # The same position on the next node.
        ([0, 1, 2], [1, 2, 0]),
        ([0, 0, 1], [2, 2, 0]),  # The next node has fewer ranks: positions wrap.
        ([7, 7, 3, 3], [2, 3, 0, 1]),  # Nodes in the order of their lowest rank, any ids.
        ([0, 0], [None, None]),  # One node: a lost node would take the copies with it.
    ],
)
def test_each_rank_sends_to_the_same_position_on_the_next_node(nodes, targets):
    assert [ring.ring_target(nodes, rank) for rank in range(len(nodes))] == targets


def _state(value: float, step: int) -> dict:
    return {"w": torch.full((50_000,), value), "global_step": ts.GlobalStep(step)}


def _tier(base, logdir: str, rank: int = 0, run_id: str = RUN_ID) -> MemoryTier:
    base.mkdir(exist_ok=True)
    config = ts.MemoryTierConfig(slots=3, root=str(base))
    return MemoryTier(config, logdir, run_id, rank=rank, sharded=True, world_size=2)


def _snapshot(tier: MemoryTier, step: int) -> str:
    return tier.saver.save(Session(_state(float(step), step)), tier.save_path, global_step=step)


def _server(base, logdir: str, keep: int = 2) -> PeerServer:
    base.mkdir(exist_ok=True)
    root = memory_root(str(base))
    run_directory = os.path.dirname(rank_directory(root, logdir, 0))
    return PeerServer(root, run_directory, "127.0.0.1", owners=None, keep=keep, local=True)


def test_a_ring_server_keeps_copies_of_any_rank_and_gives_back_the_nodes_own(tmp_path):
    logdir = str(tmp_path / "log")
    sender = _tier(tmp_path / "sender", logdir, rank=1)
    prefixes = [_snapshot(sender, step) for step in (5, 6, 7)]
    server = _server(tmp_path / "node", logdir, keep=2)
    own = _tier(tmp_path / "node", logdir, rank=3)  # A snapshot of this node's own rank 3.
    _snapshot(own, 9)
    try:
        for prefix in prefixes:
            send_snapshot(server.address, server.token, 1, prefix)
        assert server.holds() == {1: [7, 6], 3: [9]}  # The newest two copies, and its own.
        # Rank 1 restored step 5 (a restart that abandoned 6 and 7) and sends it again: the
        # copies of the abandoned timeline go.
        send_snapshot(server.address, server.token, 1, prefixes[0])
        assert server.holds() == {1: [5], 3: [9]}
        into = str(tmp_path / "fetched")
        fetched = fetch_snapshot(server.address, server.token, 3, 9, str(tmp_path), into)
        state = _state(0.0, 0)
        own.saver.restore(Session(state), fetched)
        assert state["global_step"].value == 9 and state["w"][0] == 9.0
    finally:
        server.close(free=True)
        own.close()
        sender.close()
    assert server.holds() == {3: [9]}  # Its copies freed; the node's own snapshot is not.


def _flip_a_byte(prefix: str) -> None:
    data = prefix + ".data-00000-of-00001"
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def _posts(servers: list[PeerServer]) -> list[dict]:
    """Posts of ranks 0, 1, ... each on its own node, each with its server's holdings."""
    return [
        {"node": i, "address": s.address, "token": s.token, "holds": {"0": s.holds()[0]}}
        for i, s in enumerate(servers)
    ]


def _agreed(memory: MemoryTier, posts: list[dict]):
    """Rank 0 of a one-rank run's agreed tier over its memory and the copies posted."""
    replicas = ReplicaGroup(0, store=dist.HashStore(), rank=0, world_size=1)
    offered = ring.offered_steps(posts, 0)
    tier = agreed_tier(memory, replicas, 5.0, offered=offered, fetch=ring.fetcher(memory, posts))
    assert tier is not None
    return tier


def test_an_agreed_restore_fetches_this_ranks_part_and_refuses_a_damaged_copy(tmp_path, caplog):
    logdir = str(tmp_path / "log")
    sender = _tier(tmp_path / "sender", logdir)
    six = _snapshot(sender, 6)
    near, far = _server(tmp_path / "near", logdir), _server(tmp_path / "far", logdir)
    memory = _tier(tmp_path / "self", logdir)  # Rank 0 back on an empty node.
    try:
        for server in (near, far):
            send_snapshot(server.address, server.token, 0, six)
        _flip_a_byte(os.path.join(near.directory_of(0), "model.ckpt-6"))
        posts = _posts([near, far])  # Rank 0's own node is near's.
        assert ring.offered_steps(posts, 0) == [6]
        tier = _agreed(memory, posts)
        [snapshot] = tier.snapshots()
        state = _state(0.0, 0)
        with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
            tier.restore(Session(state), snapshot.prefix)
        assert state["global_step"].value == 6 and torch.equal(state["w"], _state(6.0, 6)["w"])
        text = caplog.text
        # Its own node's copy first: damaged, refused; then the other node's.
        assert text.index("from rank 0's node") < text.index("was refused")
        assert text.index("was refused") < text.index("from rank 1's node")
    finally:
        for server in (near, far):
            server.close(free=True)
        memory.close()
        sender.close()


def test_an_agreed_restore_fails_when_no_copy_passes(tmp_path):
    logdir = str(tmp_path / "log")
    sender = _tier(tmp_path / "sender", logdir)
    six = _snapshot(sender, 6)
    server = _server(tmp_path / "near", logdir)
    memory = _tier(tmp_path / "self", logdir)
    try:
        send_snapshot(server.address, server.token, 0, six)
        _flip_a_byte(os.path.join(server.directory_of(0), "model.ckpt-6"))
        tier = _agreed(memory, _posts([server]))
        state = _state(0.0, 0)
        with pytest.raises(ts.errors.CorruptCheckpointError, match="not usable on every rank"):
            tier.restore(Session(state), tier.snapshots()[0].prefix)
        assert state["global_step"].value == 0  # Unchanged.
    finally:
        server.close(free=True)
        memory.close()
        sender.close()


def test_at_a_clean_end_the_lowest_rank_of_a_node_frees_what_the_node_holds(tmp_path):
    logdir = str(tmp_path / "log")
    server = _server(tmp_path / "node", logdir)
    stale = _tier(tmp_path / "node", logdir, rank=5)  # A rank now on another node.
    _snapshot(stale, 3)
    stale.close()
    mine = _tier(tmp_path / "node", logdir, rank=2)
    other = _tier(tmp_path / "node", logdir, rank=3)
    sender = _tier(tmp_path / "sender", logdir, rank=1)
    send_snapshot(server.address, server.token, 1, _snapshot(sender, 4))
    server.close()
    sender.close()
    posts = [{"node": 0}, {"node": 0}, {"node": 1}, {"node": 1}]
    run_directory = os.path.dirname(mine.directory)
    try:
        ring.remove_leftovers(other, posts, 1)  # Not the lowest rank of node 1: nothing.
        assert sorted(os.listdir(run_directory)) == ["peer-1", "rank-2", "rank-3", "rank-5"]
        mine.close(free=True)
        other.close(free=True)
        ring.remove_leftovers(mine, posts, 1)
        assert os.listdir(memory_root(str(tmp_path / "node"))) == []
    finally:
        mine.close()
        other.close()


def test_ls_shows_the_copies_a_node_keeps_and_a_sharded_runs_own_parts(tmp_path, capsys):
    logdir = str(tmp_path / "log")
    os.makedirs(logdir)
    run_id = ensure_run_id(logdir)
    own = _tier(tmp_path / "node", logdir, rank=1, run_id=run_id)
    _snapshot(own, 7)
    sender = _tier(tmp_path / "sender", logdir, rank=0, run_id=run_id)
    server = _server(tmp_path / "node", logdir)
    try:
        send_snapshot(server.address, server.token, 0, _snapshot(sender, 8))
        assert cli_main(["ls", logdir, "--memory-root", str(tmp_path / "node")]) == 0
    finally:
        server.close()
        own.close()
        sender.close()
    lines = capsys.readouterr().out.splitlines()
    copy = next(line for line in lines if line.startswith("peer (rank 0)"))
    assert " 8 " in copy and "valid" in copy and "peer copy" in copy
    assert "<- a restart restores" in copy  # Rank 0 restarted here takes the newer copy.
    part = next(line for line in lines if line.startswith("memory (rank 1)"))
    assert " 7 " in part and "valid" in part  # A sharded snapshot's origin has its world size.
    assert "from the peer tier (step 8)" in lines[-1]


def test_after_a_restore_the_copies_of_the_abandoned_timeline_are_deleted(tmp_path):
    logdir = str(tmp_path / "log")
    server = _server(tmp_path / "node", logdir, keep=3)
    sender = _tier(tmp_path / "sender", logdir, rank=0)
    for step in (4, 5, 6):
        send_snapshot(server.address, server.token, 0, _snapshot(sender, step))
    server.close()
    sender.close()
    gone = _tier(tmp_path / "node", logdir, rank=3)  # Rank 3 is now on another node.
    for step in (5, 6):
        _snapshot(gone, step)
    gone.close()
    lowest = _tier(tmp_path / "node", logdir, rank=1)
    local = _tier(tmp_path / "node", logdir, rank=2)  # Its own tier deletes its own.
    for step in (5, 6):
        _snapshot(local, step)
    posts = [{"node": 0}, {"node": 1}, {"node": 1}, {"node": 0}]
    try:
        ring.drop_abandoned(local, posts, 1, 5)  # Not the lowest rank of node 1: nothing.
        assert server.holds() == {0: [6, 5, 4], 2: [6, 5], 3: [6, 5]}
        ring.drop_abandoned(lowest, posts, 1, 5)  # The ranks agreed to restore step 5.
        assert server.holds() == {0: [5, 4], 2: [6, 5], 3: [5]}
    finally:
        lowest.close()
        local.close()
