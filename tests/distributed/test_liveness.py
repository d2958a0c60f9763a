"""Whether a rank's process is gone (``liveness``), with real processes: a child alive, killed
and reaped, killed and not reaped (a zombie); and the waits of ``ReplicaGroup`` that end at
once when the rank they wait for is gone."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from rank_processes import run_ranks
from repo_paths import worker

from torchsupervisor.core.global_step import GlobalStep
from torchsupervisor.distributed.liveness import ProcessIdentity, process_gone
from torchsupervisor.distributed.replicas import ReplicaGroup
from torchsupervisor.distributed.stop_agreement import StopAgreement
from torchsupervisor.errors import DeadlineExceededError, ReplicaGoneError

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="Linux only")


@pytest.fixture
def child():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    if process.poll() is None:
        process.kill()
    process.wait(30)


def _identity(pid: int) -> ProcessIdentity:
    return dataclasses.replace(ProcessIdentity.current(), pid=pid)


def test_an_identity_is_stored_as_json_and_garbage_is_none():
    here = ProcessIdentity.current()
    assert here.pid == os.getpid() and here.boot and here.pid_namespace
    assert ProcessIdentity.decode(here.encode()) == here
    assert ProcessIdentity.decode("not json") is None
    assert ProcessIdentity.decode('{"pid": 1}') is None


def test_a_process_is_gone_once_killed_reaped_or_not(child):
    identity = _identity(child.pid)
    assert not process_gone(identity)
    os.kill(child.pid, signal.SIGKILL)
    for _ in range(500):  # A zombie until reaped: gone already.
        if process_gone(identity):
            break
        time.sleep(0.01)
    with open(f"/proc/{child.pid}/stat", "rb") as f:  # Not reaped yet: a zombie.
        assert f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    assert process_gone(identity)
    child.wait(30)
    assert process_gone(identity)  # Reaped: no such pid.


def test_a_process_elsewhere_or_this_one_is_never_gone(child):
    child.kill()
    child.wait(30)
    dead = _identity(child.pid)
    assert process_gone(dead)
    assert not process_gone(dataclasses.replace(dead, boot="another-boot"))
    assert not process_gone(dataclasses.replace(dead, pid_namespace=dead.pid_namespace + 1))
    assert not process_gone(ProcessIdentity.current())
    assert not process_gone(dataclasses.replace(dead, boot=""), dataclasses.replace(dead, boot=""))


def _groups_with_dead_rank(child, rank: int) -> list[ReplicaGroup]:
    """Two ranks on one store; ``rank`` recorded as the killed ``child``."""
    store = dist.HashStore()
    groups = [ReplicaGroup(1, store=store, rank=r, world_size=2) for r in range(2)]
    child.kill()
    child.wait(30)
    store.set(groups[rank].processes.key(rank), _identity(child.pid).encode())
    return groups


def test_a_non_chief_stops_waiting_for_a_chief_that_is_gone(child):
    _, worker = _groups_with_dead_rank(child, 0)
    started = time.monotonic()
    with pytest.raises(ReplicaGoneError) as raised:
        worker.wait_ready(0.05, 600)
    assert time.monotonic() - started < 10  # About a second, not 600.
    assert raised.value.ranks == [0] and "Waiting for the chief's 'ready'" in str(raised.value)


def test_an_agreement_stops_waiting_for_a_rank_that_is_gone(child):
    chief, _ = _groups_with_dead_rank(child, 1)
    chief.post("restore/candidates", [])
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError) as raised:  # As a deadline, only sooner.
        chief.gather("restore/candidates", 600, what="Agreeing on the checkpoints")
    assert time.monotonic() - started < 10
    assert isinstance(raised.value, ReplicaGoneError) and raised.value.ranks == [1]
    assert "Agreeing on the checkpoints: rank(s) [1] are gone" in str(raised.value)


def test_a_rank_that_is_alive_or_recorded_nothing_is_waited_for(child, fake_clock):
    store = dist.HashStore()
    chief = ReplicaGroup(1, store=store, rank=0, world_size=3, clock=fake_clock)
    store.set(chief.processes.key(1), _identity(child.pid).encode())  # Alive; 2: no record.
    chief.post("x", 1)
    with pytest.raises(DeadlineExceededError) as raised:
        chief.gather("x", 5, what="Agreeing", poll_secs=0.5)
    assert not isinstance(raised.value, ReplicaGoneError)
    assert "rank(s) [1, 2] did not answer within 5 s" in str(raised.value)


def test_under_torchrun_a_start_whose_chief_died_ends_in_seconds_not_at_the_sigkill():
    """The survivor keeps running through torchrun's SIGTERM (as a Supervisor does); before,
    it waited until torchrun's SIGKILL, 30 s later, at every such restart."""
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"),
            worker("startup_death_worker.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    elapsed = time.monotonic() - started
    assert done.returncode != 0
    gone = [line.split() for line in done.stdout.splitlines() if line.startswith("GONE ")]
    assert len(gone) == 1 and gone[0][2:] == ["[0]"], done.stdout + done.stderr[-3000:]
    # About a second after it began to wait (before: no GONE, a wait until the SIGKILL).
    assert float(gone[0][1]) < 10, (gone, elapsed)


def test_a_rank_that_died_before_its_first_group_is_gone_for_the_others():
    """Recorded when it joined (``connect``): rank 0 waits about a second, not 120 s."""
    results = run_ranks(worker("startup_death_worker.py"), "before-group", timeout=120)
    assert results[1][2] == -signal.SIGKILL
    out, err, code = results[0]
    gone = [line.split() for line in out.splitlines() if line.startswith("GONE ")]
    assert code == 3 and len(gone) == 1 and gone[0][2:] == ["[1]"], out + err[-3000:]
    assert float(gone[0][1]) < 10


def test_a_stop_does_not_wait_for_the_step_count_of_a_rank_that_is_gone(child):
    chief, _ = _groups_with_dead_rank(child, 1)
    agreement = StopAgreement(chief, GlobalStep(3), poll_secs=0.005)
    try:
        agreement.request("SIGTERM")
        started = time.monotonic()
        assert agreement.stop_step(timeout_secs=600) is None  # This rank stops now.
        assert time.monotonic() - started < 10
    finally:
        agreement.close()
