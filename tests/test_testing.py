"""``torchsupervisor.testing``: the fakes other tests rely on must themselves be right."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch
import torch.distributed as dist

from torchsupervisor.core.clock import Deadline
from torchsupervisor.testing import FakeClock, FaultyStorage, GatedStorage, WorldError, run_world

# ------------------------------------------------------------------------------ FakeClock


def test_fake_clock_moves_only_when_advanced_or_slept():
    clock = FakeClock(start_secs=10.0, epoch_secs=1000.0)
    assert (clock.monotonic(), clock.time()) == (10.0, 1010.0)
    clock.advance(2.5)
    clock.sleep(0.5)
    assert (clock.monotonic(), clock.time(), clock.sleeps) == (13.0, 1013.0, [0.5])
    clock.set_wall(5000.0)
    assert (clock.monotonic(), clock.time()) == (13.0, 5000.0)


def test_a_timed_wait_on_auto_advance_uses_up_its_timeout_at_once():
    clock = FakeClock(start_secs=0.0)
    event = threading.Event()
    assert clock.wait(event, 30.0) is False
    assert clock.monotonic() == 30.0 and clock.timed_waits == [30.0]
    event.set()
    assert clock.wait(event, 30.0) is True
    assert clock.monotonic() == 30.0  # A set event does not move the time.


def test_a_deadline_on_a_fake_clock():
    clock = FakeClock(start_secs=0.0)
    deadline = Deadline(clock, 10.0)
    clock.advance(4.0)
    assert deadline.remaining() == pytest.approx(6.0)
    clock.advance(7.0)
    assert deadline.remaining() == 0.0 and deadline.expired()


def test_without_auto_advance_a_wait_blocks_until_the_test_moves_time_past_it():
    clock = FakeClock(start_secs=0.0, auto_advance=False)
    event = threading.Event()
    result = []
    thread = threading.Thread(target=lambda: result.append(clock.wait(event, 5.0)))
    thread.start()
    assert clock.timed_wait_started.wait(10)
    clock.advance(4.0)
    thread.join(0.05)
    assert thread.is_alive()  # 4 of 5 fake seconds: still waiting.
    clock.advance(1.0)
    thread.join(10)
    assert not thread.is_alive() and result == [False]


# --------------------------------------------------------------------------- FaultyStorage


def test_the_nth_matching_call_fails_as_many_times_as_asked(tmp_path):
    storage = FaultyStorage()
    # A name no temporary directory contains (pytest's --basetemp may hold any letter).
    fault = storage.fail("rename", nth=2, times=2, path_contains="match-", errno=errno.ENOSPC)
    storage.put(str(tmp_path / "a"), [b"1"])  # Not matching: not counted.
    storage.put(str(tmp_path / "match-b1"), [b"1"])  # The first match goes through.
    for name in ("match-b2", "match-b3"):
        with pytest.raises(OSError) as caught:
            storage.put(str(tmp_path / name), [b"1"])
        assert caught.value.errno == errno.ENOSPC and name in caught.value.filename
    storage.put(str(tmp_path / "match-b4"), [b"1"])  # Two failures asked for, two given.
    assert fault.raised == 2 and fault.seen == 4
    assert sorted(os.listdir(tmp_path)) == [
        "a",
        "match-b1",
        "match-b4",
    ]  # Failed: nothing left.
    assert [os.path.basename(p) for p in storage.operations("rename")] == [
        "a", "match-b1", "match-b2", "match-b3", "match-b4"
    ]  # fmt: skip


def test_a_fault_for_another_rank_does_not_fire(tmp_path, monkeypatch):
    storage = FaultyStorage()
    storage.fail("write", rank=1)
    monkeypatch.setenv("RANK", "0")
    storage.put(str(tmp_path / "x"), [b"1"])
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(OSError):
        storage.put(str(tmp_path / "y"), [b"1"])


def test_watch_sees_calls_and_clear_disarms(tmp_path):
    storage = FaultyStorage()
    seen = []
    storage.watch("fsync", seen.append)
    storage.put(str(tmp_path / "x"), [b"1"])
    assert [os.path.basename(p).split(".tmp")[0] for p in seen] == ["x"]
    storage.fail("write", times=None)
    with pytest.raises(OSError):
        storage.put(str(tmp_path / "x"), [b"2"])
    storage.clear()
    storage.put(str(tmp_path / "x"), [b"3"])
    assert len(seen) == 1  # Disarmed: neither the failure nor the watch acts any more.
    assert (tmp_path / "x").read_bytes() == b"3"
    assert len(storage.operations("write")) == 3  # The record of calls is kept.


@pytest.mark.parametrize(("operation", "nth"), [("chmod", 1), ("write", 0)])
def test_bad_rules_are_refused(operation, nth):
    with pytest.raises(ValueError, match=r"operation|nth"):
        FaultyStorage().fail(operation, nth=nth)


def test_a_gate_holds_a_stage_until_opened(tmp_path):
    storage = GatedStorage()
    gate = storage.hold("rename", path_contains="held", timeout_secs=60)
    thread = threading.Thread(target=storage.put, args=(str(tmp_path / "held"), [b"1"]))
    thread.start()
    assert gate.reached.wait(30)
    assert not (tmp_path / "held").exists()  # Held before the rename.
    gate.open()
    thread.join(30)
    assert (tmp_path / "held").read_bytes() == b"1"


def test_a_gate_never_opened_fails_the_call_instead_of_hanging(tmp_path):
    storage = GatedStorage()
    storage.hold("write", timeout_secs=0.01)
    with pytest.raises(OSError, match="never opened the gate"):
        storage.put(str(tmp_path / "x"), [b"1"])
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------ run_world


def sum_of_ranks(rank: int, world_size: int, offset: int) -> tuple[int, int, str]:
    total = torch.tensor([rank + offset])
    dist.all_reduce(total)
    return rank, int(total.item()), os.environ["WORLD_SIZE"]


def fails_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")


def test_run_world_runs_every_rank_in_one_process_group():
    assert run_world(sum_of_ranks, 10) == [(0, 21, "2"), (1, 21, "2")]


def test_run_world_names_the_rank_that_raised():
    with pytest.raises(WorldError) as caught:
        run_world(fails_on_rank_one)
    assert set(caught.value.failures) == {1}
    assert "ValueError: rank one refuses" in caught.value.failures[1]
