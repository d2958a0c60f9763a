"""``LocalStorage.put_received``: a file written from a socket (a peer's snapshot), by
``splice(2)`` where Linux has it and through a buffer elsewhere, under the commit protocol:
exact bytes, nothing left when the peer closes early or goes quiet, a spare's pages reused."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from torchsupervisor.storage import local
from torchsupervisor.storage.local import LocalStorage
from torchsupervisor.storage.private import MemoryTierStorage

PAYLOAD = os.urandom(3 * (1 << 20) + 12345)  # Several pipe loads and a part of one.


@pytest.fixture(params=["splice", "buffer"])
def way(request, monkeypatch):
    """Each test both ways: splice(2), and the buffer of a platform without it."""
    if request.param == "splice" and not hasattr(os, "splice"):
        pytest.skip("no splice(2) on this platform")
    if request.param == "buffer":
        monkeypatch.delattr(local.os, "splice", raising=False)
    return request.param


def _send(data: bytes, *, close: bool = True, timeout: float | None = 10.0):
    """A connected pair: the far end sends ``data`` from a thread (then closes, with
    ``close``); returns the near end, with ``timeout``, and the thread."""
    near, far = socket.socketpair()
    near.settimeout(timeout)

    def run() -> None:
        far.sendall(data)
        if close:
            far.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return near, far, thread


def test_the_file_holds_exactly_the_bytes_received_and_the_rest_stays_in_the_socket(tmp_path, way):
    path = tmp_path / "model.ckpt-1.data-00000-of-00001"
    near, _, thread = _send(PAYLOAD + b"the manifest")
    with near:
        LocalStorage().put_received(str(path), near, len(PAYLOAD))
        assert path.read_bytes() == PAYLOAD
        assert near.recv(64) == b"the manifest"
    thread.join(10)
    assert os.listdir(tmp_path) == [path.name]


def test_a_peer_that_closes_early_leaves_nothing(tmp_path, way):
    path = tmp_path / "model.ckpt-1.data-00000-of-00001"
    near, _, thread = _send(PAYLOAD[:100_000])
    with near, pytest.raises(ConnectionError, match="bytes short"):
        LocalStorage().put_received(str(path), near, len(PAYLOAD))
    thread.join(10)
    assert os.listdir(tmp_path) == []


def test_a_quiet_peer_times_out_and_leaves_nothing(tmp_path, way):
    path = tmp_path / "model.ckpt-1.data-00000-of-00001"
    near, far, thread = _send(PAYLOAD[:5000], close=False, timeout=0.3)
    with near, far, pytest.raises(TimeoutError):  # socket.timeout is TimeoutError.
        LocalStorage().put_received(str(path), near, len(PAYLOAD))
    thread.join(10)
    assert os.listdir(tmp_path) == []


def test_a_snapshot_received_into_the_memory_tier_reuses_a_spares_pages(tmp_path, way):
    storage = MemoryTierStorage()
    old = tmp_path / "model.ckpt-1.data-00000-of-00001"
    storage.put(str(old), [b"x" * (2 * len(PAYLOAD))])  # Longer: the rest must be cut.
    storage.delete(str(old))
    (spare,) = storage.spares(str(tmp_path))
    inode = os.stat(spare).st_ino
    path = tmp_path / "model.ckpt-2.data-00000-of-00001"
    near, _, thread = _send(PAYLOAD)
    with near:
        storage.put_received(str(path), near, len(PAYLOAD))
    thread.join(10)
    assert path.read_bytes() == PAYLOAD
    assert os.stat(path).st_ino == inode and storage.spares(str(tmp_path)) == []
    assert os.stat(path).st_mode & 0o777 == 0o600
