"""The chief/worker protocol of ``replicas.py`` in one process: "ranks" share an in-memory
``HashStore``; collectives are replaced by a recording fake where a test needs them."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchsupervisor.core.global_step import GlobalStep
from torchsupervisor.distributed import replicas
from torchsupervisor.distributed.replicas import ReplicaGroup, communication_device
from torchsupervisor.distributed.stop_agreement import HEARTBEAT_STALE_SECS, StopAgreement
from torchsupervisor.errors import DeadlineExceededError
from torchsupervisor.testing import FakeClock


class CountingStore:
    """A ``HashStore`` that counts the looks at a key (but at the ranks' process records,
    which ``liveness`` reads) and calls ``on_set`` at every write."""

    def __init__(self, on_set=None) -> None:
        self.inner = dist.HashStore()
        self.checks = 0
        self.on_set = on_set

    def check(self, keys):
        if not any("/process/" in k for k in keys):
            self.checks += 1
        return self.inner.check(keys)

    def get(self, key):
        return self.inner.get(key)

    def set(self, key, value):
        if self.on_set is not None:
            self.on_set(key)
        self.inner.set(key, value)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def add(self, key, amount):
        return self.inner.add(key, amount)


def _groups(store, world_size: int = 2, clock=None) -> list[ReplicaGroup]:
    return [
        ReplicaGroup(1, store=store, rank=r, world_size=world_size, clock=clock)
        for r in range(world_size)
    ]


# ------------------------------------------------------------------------------ wait_ready


def test_wait_ready_looks_every_recovery_wait_secs_and_gives_up_with_tfs_text(fake_clock):
    store = CountingStore()
    _, worker = _groups(store)
    start = fake_clock.monotonic()
    with pytest.raises(DeadlineExceededError) as raised:
        worker.wait_ready(1, 3, clock=fake_clock)
    assert raised.value.message == "Session was not ready after waiting 3 secs."
    # As TF's wait_for_session: with recovery_wait_secs=1 and max_wait_secs=3, four looks.
    assert store.checks == 4 and fake_clock.sleeps == [1, 1, 1]
    assert fake_clock.monotonic() - start == 3


def test_wait_ready_returns_the_chiefs_resume_point_once_published(fake_clock):
    store = CountingStore()
    chief, worker = _groups(store)

    class PublishingClock(type(fake_clock)):
        def sleep(self, secs):
            super().sleep(secs)
            if len(self.sleeps) == 2:
                chief.publish_ready({"checkpoint": "/logdir/model.ckpt-7", "step": 7})

    clock = PublishingClock()
    info = worker.wait_ready(0.5, None, clock=clock)  # None: no deadline.
    assert info == {"checkpoint": "/logdir/model.ckpt-7", "step": 7}
    assert clock.sleeps == [0.5, 0.5] and store.checks == 3


def test_wait_ready_under_another_name_and_session_generation_are_apart(fake_clock):
    store = dist.HashStore()
    ReplicaGroup(1, store=store, rank=0, world_size=2).publish_ready({"a": 1}, name="restore/open")
    later = ReplicaGroup(2, store=store, rank=1, world_size=2)
    with pytest.raises(DeadlineExceededError):
        later.wait_ready(1, 2, name="restore/open", clock=fake_clock)
    same = ReplicaGroup(1, store=store, rank=1, world_size=2)
    assert same.wait_ready(1, 2, name="restore/open", clock=fake_clock) == {"a": 1}


# -------------------------------------------------------------------------- broadcast_state


def test_communication_device_follows_the_backend():
    assert communication_device("gloo") == torch.device("cpu")
    assert communication_device("cpu:gloo,cuda:nccl") == torch.device("cpu")
    assert communication_device("nccl", cuda_device=lambda: 3) == torch.device("cuda", 3)


class FakeBroadcast:
    """``dist.broadcast`` between two sequential calls of ``broadcast_state``: the chief's
    tensors are recorded; the non-chief's buffers are filled from them, in order."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.devices: dict[str, list[str]] = {"chief": [], "worker": []}
        self.receiving = False

    def __call__(self, tensor, src, *args, **kwargs):
        assert src == 0
        side = "worker" if self.receiving else "chief"
        self.devices[side].append(tensor.device.type)
        if not self.receiving:
            self.sent.append(tensor.detach().clone())
            return
        expected = self.sent.pop(0)
        assert (tensor.dtype, tensor.shape) == (expected.dtype, expected.shape)
        tensor.copy_(expected)


def _state(seed: int, stepped: bool):
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if stepped:
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
    scale = float(seed)
    return {
        "model": model,
        "optimizer": optimizer,
        "w": torch.full((4,), scale),
        "table": np.full(3, scale),
        "meta": {"epoch": seed, "name": f"run{seed}"},
    }


def test_broadcast_state_sends_every_tensor_from_the_backends_device(monkeypatch):
    fake = FakeBroadcast()
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "gloo")
    monkeypatch.setattr(dist, "broadcast", fake)
    chief_group, worker_group = _groups(dist.HashStore())
    chief, worker = _state(1, stepped=True), _state(2, stepped=False)
    chief_group.broadcast_state(chief)
    fake.receiving = True
    worker_group.broadcast_state(worker)
    assert not fake.sent
    assert fake.devices["chief"] == fake.devices["worker"]
    assert set(fake.devices["chief"]) == {"cpu"}
    for name, value in chief["model"].state_dict().items():
        assert torch.equal(worker["model"].state_dict()[name], value)
    moments = [s["momentum_buffer"] for s in worker["optimizer"].state.values()]
    expected = [s["momentum_buffer"] for s in chief["optimizer"].state.values()]
    assert len(moments) == 2 and all(torch.equal(a, b) for a, b in zip(moments, expected))
    assert torch.equal(worker["w"], torch.full((4,), 1.0))
    assert isinstance(worker["table"], np.ndarray) and worker["table"].tolist() == [1.0] * 3
    assert worker["meta"] == {"epoch": 1, "name": "run1"}


def test_with_nccl_both_sides_communicate_from_the_current_cuda_device(monkeypatch):
    """No CUDA here: the device NCCL needs (cuda:<current>) is recorded, and the meta device
    stands in for it, so the test sees which tensors each side hands to the collective."""
    chosen: list[torch.device] = []

    def device_for(backend):
        chosen.append(communication_device(backend, cuda_device=lambda: 0))
        return torch.device("meta")

    class Stop(Exception):
        pass

    devices: dict[str, list[str]] = {"chief": [], "worker": []}
    receiving = [False]

    def broadcast(tensor, src, *args, **kwargs):
        devices["worker" if receiving[0] else "chief"].append(tensor.device.type)
        if receiving[0]:
            raise Stop  # A meta buffer holds no data to go on with.

    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "nccl")
    monkeypatch.setattr(replicas, "communication_device", device_for)
    monkeypatch.setattr(dist, "broadcast", broadcast)
    chief_group, worker_group = _groups(dist.HashStore())
    chief_group.broadcast_state(_state(1, stepped=True))  # CPU tensors in the state.
    receiving[0] = True
    with pytest.raises(Stop):
        worker_group.broadcast_state(_state(2, stepped=False))
    assert chosen == [torch.device("cuda", 0)] * 2
    # size, payload, 2 parameters, 2 momentum buffers, w, table: all from the NCCL device.
    assert devices["chief"] == ["meta"] * 8
    assert devices["worker"] == ["meta"]


# ---------------------------------------------------------------------------- StopAgreement


def _wait_until(predicate, timeout_secs: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_secs
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_poller_marks_the_stop_pending_before_it_posts_its_step_count():
    seen: list[bool] = []
    agreements: list[StopAgreement] = []

    def on_set(key: str) -> None:
        if "/progress/" in key:
            seen.append(agreements[0].pending)

    store = CountingStore(on_set)
    (group,) = _groups(store, world_size=1)
    agreements.append(StopAgreement(group, GlobalStep(4), poll_secs=0.005))
    try:
        agreements[0].request("stop requested")
        _wait_until(lambda: seen)
        assert seen == [True]
        assert agreements[0].stop_step() == 5
    finally:
        agreements[0].close()


def test_every_rank_stops_after_the_largest_posted_count_and_logs_the_first_reason(caplog):
    g0, g1 = _groups(dist.HashStore())
    steps = [GlobalStep(5), GlobalStep(7)]
    agreements = [StopAgreement(g, s, poll_secs=0.005) for g, s in zip((g0, g1), steps)]
    try:
        with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
            agreements[1].request("RuntimeError: boom")
            _wait_until(lambda: all(a.pending for a in agreements))
            agreements[0].request("error")  # Later: the first reason is kept.
            assert [a.stop_step() for a in agreements] == [8, 8]
            for agreement in agreements:  # A poller ends once it has reported the stop.
                agreement.poller.join(30)
        assert g0.flag("stop") == "rank 1: RuntimeError: boom"
        reported = [m for m in (r.getMessage() for r in caplog.records) if "Every rank" in m]
        assert reported == ["Every rank stops: rank 1: RuntimeError: boom"]  # Rank 0, once.
    finally:
        for agreement in agreements:
            agreement.close()


def test_a_rank_that_fails_stops_the_others_at_once_and_they_learn_that_it_failed(
    caplog, fake_clock
):
    g0, g1 = _groups(dist.HashStore(), clock=fake_clock)
    steps = [GlobalStep(5), GlobalStep(3)]
    agreements = [StopAgreement(g, s, poll_secs=0.005) for g, s in zip((g0, g1), steps)]
    try:
        with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
            agreements[1].request("RuntimeError: boom", failed=True)
            _wait_until(lambda: agreements[0].pending)
            # Rank 1 takes no more steps: another step of rank 0 would wait for it in a
            # collective. Rank 0 stops now, without waiting out the timeout for rank 1.
            start = fake_clock.monotonic()
            assert agreements[0].stop_step(timeout_secs=30) is None
            assert fake_clock.monotonic() - start < 30
        assert "left with an error; stopping now" in caplog.text
        assert agreements[0].peer_failure() == "rank 1: RuntimeError: boom"
        assert agreements[1].peer_failure() is None  # Its own failure is not a peer's.
        # Rank 1's poller saw the flag too (it ends once it has), and did not post a count
        # over its "gone".
        agreements[1].poller.join(30)
        assert agreements[1].pending and not agreements[1].poller.is_alive()
        assert g0.flag("progress/1") == "-1"
    finally:
        for agreement in agreements:
            agreement.close()


def test_a_stop_that_a_rank_asked_for_without_failing_is_no_peer_failure():
    g0, g1 = _groups(dist.HashStore())
    agreements = [StopAgreement(g, GlobalStep(2), poll_secs=0.005) for g in (g0, g1)]
    try:
        agreements[1].request("SIGTERM")
        _wait_until(lambda: all(a.pending for a in agreements))
        agreements[0].request("RuntimeError: later", failed=True)  # Not the first reason.
        assert agreements[1].stop_step() is None  # Rank 0 is gone: stop now.
        assert [a.peer_failure() for a in agreements] == [None, None]
    finally:
        for agreement in agreements:
            agreement.close()


class _BeatingClock(FakeClock):
    """A fake clock whose every sleep comes with a beat of rank 1 (with ``group``): a rank
    that lives but has not posted (a slow one)."""

    group: ReplicaGroup | None = None

    def sleep(self, secs: float) -> None:
        if self.group is not None:
            self.group.add("beat/1", 1)
        super().sleep(secs)


@pytest.mark.parametrize("rank_1", ["never beats", "beats"])
def test_a_stop_step_that_some_rank_never_posts_gives_up(rank_1):
    # Rank 1's process record is this process's: only its beats (or none) can tell about it.
    clock = _BeatingClock()
    g0, _ = _groups(dist.HashStore(), clock=clock)
    clock.group = g0 if rank_1 == "beats" else None
    agreement = StopAgreement(g0, GlobalStep(3), poll_secs=0.005)
    try:
        agreement.request("SIGTERM")
        _wait_until(lambda: agreement.pending)
        start = clock.monotonic()
        assert agreement.stop_step(timeout_secs=60) is None
        assert 60 <= clock.monotonic() - start < 61  # Its budget on the group's clock.
    finally:
        agreement.close()


def test_a_stop_waits_5_s_not_60_for_a_rank_whose_beats_stopped(fake_clock, caplog):
    """Rank 1 lost while a stop is agreed (on another machine: its pid tells nothing here):
    its poller no longer beats and it never posts; rank 0 stops once the beats have stood
    still for 5 s of its own clock (it used to wait out the 60 s deadline, longer than a
    cloud's preemption notice)."""
    g0, g1 = _groups(dist.HashStore(), clock=fake_clock)
    chief = StopAgreement(g0, GlobalStep(3), poll_secs=0.005)
    lost = StopAgreement(g1, GlobalStep(3), poll_secs=0.005)
    try:
        _wait_until(lambda: g0.add("beat/1", 0) > 0)  # Rank 1 beat: its poller runs.
        lost.close()  # Its node is lost: no more beats, no post.
        chief.request("SIGTERM")
        _wait_until(lambda: chief.pending)
        start = fake_clock.monotonic()
        with caplog.at_level(logging.ERROR, logger="torchsupervisor"):
            assert chief.stop_step(timeout_secs=60) is None  # This rank stops now.
        waited = fake_clock.monotonic() - start
        assert HEARTBEAT_STALE_SECS <= waited < HEARTBEAT_STALE_SECS + 2, waited
        assert "rank(s) [1] have not answered nor beaten for 5 s" in caplog.text
    finally:
        chief.close()
        lost.close()


class _Raising:
    """A stateful object whose ``state_dict`` raises (a data loader whose worker died)."""

    def state_dict(self) -> dict:
        raise RuntimeError("the loader's worker died")

    def load_state_dict(self, state: dict) -> None:
        pass


def broadcast_failing_rank(rank: int, world_size: int, failing: int) -> str:
    """``broadcast_state`` on 2 real gloo ranks, ``failing``'s state unable to flatten: what
    each rank raised (or ``received``)."""
    from torchsupervisor.distributed.replicas import ReplicaGroup

    group = ReplicaGroup(1, store=dist.HashStore(), rank=rank, world_size=world_size)
    state = _state(1 if rank == 0 else 2, stepped=rank == 0)
    if rank == failing:
        state["loader"] = _Raising()
    try:
        group.broadcast_state(state)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "received" if state["meta"] == {"epoch": 1, "name": "run1"} else "not received"


@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_that_cannot_flatten_its_state_raises_without_leaving_the_other_waiting(failing):
    """It raised before the broadcasts, and the other rank waited in one."""
    from torchsupervisor.testing import run_world

    chief, replica = run_world(broadcast_failing_rank, failing, timeout_secs=60)
    died = "RuntimeError: the loader's worker died"
    if failing == 0:
        assert chief == died
        assert replica.startswith("AbortedError: The chief (rank 0) could not send its state")
    else:
        assert chief == "received" and replica == died  # The replica took its part first.
