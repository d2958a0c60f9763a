"""Peer replicas over the loopback: a snapshot sent, kept, fetched back byte for byte; what
the server refuses (a wrong token, another owner, a name out of the snapshot, a torn send)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import stat
import threading
import time

import pytest
import torch

import torchsupervisor as ts
from torchsupervisor.checkpoint.files import remove_checkpoint
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.core.session import Session
from torchsupervisor.tiers import replication
from torchsupervisor.tiers.memory import MemoryTier
from torchsupervisor.tiers.memory_root import memory_root
from torchsupervisor.tiers.peer import PeerSender, PeerServer, fetch_snapshot, send_snapshot

RUN_ID = "a" * 32


@pytest.fixture
def setup(tmp_path):
    """The chief's memory tier with snapshots of steps 5 and 6, and a peer's server."""
    base = tmp_path / "chief"
    base.mkdir()
    tier = MemoryTier(ts.MemoryTierConfig(slots=3, root=str(base)), str(tmp_path / "log"), RUN_ID)
    # 12 MB: more than one chunk of the transport (8 MiB) and of a socket read.
    state = {"w": torch.arange(3_000_000.0), "global_step": ts.GlobalStep(5)}
    prefixes = [tier.saver.save(Session(state), tier.save_path, global_step=5)]
    state["w"] += 1
    state["global_step"].assign(6)
    prefixes.append(tier.saver.save(Session(state), tier.save_path, global_step=6))
    (tmp_path / "peer").mkdir()
    root = memory_root(str(tmp_path / "peer"))
    server = PeerServer(root, os.path.join(root, "run"), "127.0.0.1")
    yield tier, prefixes, server, root
    server.close()
    tier.close()


def test_a_snapshot_is_kept_by_the_peer_and_fetched_back_byte_for_byte(setup):
    _, (five, six), server, root = setup
    send_snapshot(server.address, server.token, 0, five)
    send_snapshot(server.address, server.token, 0, six)
    assert server.holds() == {0: [6]}  # The newest copy only.
    for name in os.listdir(server.directory_of(0)):
        assert stat.S_IMODE(os.stat(os.path.join(server.directory_of(0), name)).st_mode) == 0o600
    back = fetch_snapshot(server.address, server.token, 0, 6, root, os.path.join(root, "back"))
    for suffix in (".index", ".data-00000-of-00001"):
        with open(six + suffix, "rb") as a, open(back + suffix, "rb") as b:
            assert a.read() == b.read()
    CheckpointReader(back).verify()
    assert CheckpointReader(back).manifest.origin == {"run_id": RUN_ID, "rank": 0}
    with pytest.raises(RuntimeError, match="no copy"):
        fetch_snapshot(server.address, server.token, 0, 5, root, os.path.join(root, "x"))


def _raw_request(address: str, header: dict, body: bytes = b"") -> dict:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        with contextlib.suppress(OSError):  # The server may answer and close before the end.
            conn.sendall(json.dumps(header).encode() + b"\n" + body)
            conn.shutdown(socket.SHUT_WR)
        return json.loads(conn.makefile().readline())


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"token": "0" * 32}, "token"),
        ({"owner": 1}, "rank 1"),
        ({"files": [["../evil", 3], ["model.ckpt-6.index", 3]]}, "not a file of the snapshot"),
        ({"files": [["model.ckpt-6.index", 3], ["model.ckpt-6.data-00000-of-00001", 3]]}, "last"),
        ({"files": [["model.ckpt-7.index", 3]]}, "not a file of the snapshot of step 6"),
        ({"files": [["model.ckpt-6.index", 10**15]]}, "needs"),
    ],
)
def test_the_server_refuses_bad_requests_and_keeps_nothing(setup, change, error):
    _, _, server, _ = setup
    header = {"op": "put", "token": server.token, "owner": 0, "step": 6}
    header["files"] = [["model.ckpt-6.index", 3]]
    answer = _raw_request(server.address, {**header, **change}, b"abc")
    assert error in answer["error"]
    assert os.listdir(server.directory_of(0)) == []


def test_a_torn_send_leaves_no_copy(setup):
    _, _, server, _ = setup
    header = {"op": "put", "token": server.token, "owner": 0, "step": 6}
    header["files"] = [["model.ckpt-6.data-00000-of-00001", 1000], ["model.ckpt-6.index", 10]]
    answer = _raw_request(server.address, header, b"x" * 500)  # Then the sender dies.
    assert "closed the connection" in answer["error"]
    assert server.holds() == {} and os.listdir(server.directory_of(0)) == []


def test_the_sender_sends_the_newest_offered(setup):
    _, (five, six), server, _ = setup
    sender = PeerSender(server.address, server.token, 0)
    sender.offer(five)
    sender.offer(six)
    sender.close(60)
    assert sender.sent == 6 and server.holds() == {0: [6]}


def test_a_restarted_chief_fetches_a_newer_copy_than_its_memory_and_the_disk(setup, tmp_path):
    _, (_, six), server, _ = setup
    send_snapshot(server.address, server.token, 0, six)
    (tmp_path / "new").mkdir()
    fresh = MemoryTier(
        ts.MemoryTierConfig(root=str(tmp_path / "new")), str(tmp_path / "log"), RUN_ID
    )
    try:
        posts = [{"node": 0}, {"node": 1, "address": server.address, "token": server.token}]
        posts[1]["holds"] = server.holds()[0]
        assert replication.fetch_newer(fresh, posts, newest_elsewhere=6) is None  # Not newer.
        prefix = replication.fetch_newer(fresh, posts, newest_elsewhere=3)
        assert [s.step for s in fresh.snapshots()] == [6] and fresh.damaged == []
        state = {"w": torch.zeros(3_000_000), "global_step": ts.GlobalStep()}
        fresh.restore(Session(state), prefix)
        assert state["global_step"].value == 6 and state["w"][-1] == 3_000_000.0
        assert replication.choose_peer(posts) is posts[1]
        assert replication.choose_peer([{"node": 0}, {"node": 0, "address": "x"}]) is None
    finally:
        fresh.close()


def test_the_copies_of_a_timeline_the_chief_abandoned_are_deleted(setup):
    _, (five, six), server, _ = setup
    send_snapshot(server.address, server.token, 0, six)
    replication.drop_abandoned(server, 6)  # The chief restored step 6: the copy stays.
    assert server.holds() == {0: [6]}
    replication.drop_abandoned(server, 3)  # It restored step 3: step 6 was abandoned.
    assert server.holds() == {}
    send_snapshot(server.address, server.token, 0, six)
    send_snapshot(server.address, server.token, 0, five)  # A new timeline from step 5.
    assert server.holds() == {0: [5]}


def test_the_sender_waits_its_interval_and_sends_the_newest_at_close(setup):
    _, (five, six), server, _ = setup
    sender = PeerSender(server.address, server.token, 0, every_secs=3600.0)
    try:
        sender.offer(five)
        deadline = time.monotonic() + 60
        while sender.sent != 5 and time.monotonic() < deadline:  # The first goes at once.
            time.sleep(0.01)
        assert sender.sent == 5
        sender.offer(six)
        time.sleep(0.3)
        assert sender.sent == 5 and server.holds() == {0: [5]}  # Within its interval.
    finally:
        sender.close(60)
    assert sender.sent == 6 and server.holds() == {0: [6]}  # The close sends what waits.


def test_a_snapshot_being_sent_is_never_overwritten_by_the_next(setup):
    """Retention deletes the snapshot being sent and the next one is written meanwhile: the
    peer still receives the snapshot as it was (its pages did not become the next's spare)."""
    tier, (five, _), _, _ = setup
    data = five + ".data-00000-of-00001"
    with open(data, "rb") as f:
        original = f.read()
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"

    def send():
        with contextlib.suppress(OSError, RuntimeError, ValueError):  # No answer comes.
            send_snapshot(address, "t", 0, five)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(60)
            line = b""
            while not line.endswith(b"\n") and len(line) < 1 << 16:  # The header, exactly.
                line += conn.recv(1)
            assert json.loads(line)["files"][0] == [os.path.basename(data), len(original)]
            time.sleep(0.2)  # The sender is blocked on the full socket by now.
            remove_checkpoint(five, storage=tier.storage)  # Retention, while it is sent.
            assert tier.storage.spares(tier.directory) == []  # Unlinked: never a spare.
            nine = five[: -len("5")] + "9.data-00000-of-00001"
            tier.storage.put(nine, [b"\xff" * len(original)])  # The next snapshot.
            received = bytearray()
            while len(received) < len(original):
                chunk = conn.recv(min(1 << 20, len(original) - len(received)))
                assert chunk
                received += chunk
        assert received == original
    finally:
        thread.join(60)
        listener.close()


def test_a_snapshot_deleted_before_its_send_lets_the_next_go_at_once(setup, caplog):
    tier, (five, six), server, _ = setup
    remove_checkpoint(five, storage=tier.storage)  # Retention won the race.
    caplog.set_level(logging.DEBUG, logger="torchsupervisor")
    sender = PeerSender(server.address, server.token, 0, every_secs=3600.0)
    try:
        sender.offer(five)
        deadline = time.monotonic() + 60
        while not any("deleted before" in m for m in caplog.messages):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sender.offer(six)
        deadline = time.monotonic() + 60
        while sender.sent != 6 and time.monotonic() < deadline:  # Not an hour later.
            time.sleep(0.01)
        assert sender.sent == 6 and server.holds() == {0: [6]}
    finally:
        sender.close(60)
