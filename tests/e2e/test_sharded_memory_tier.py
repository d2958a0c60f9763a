"""The memory tier of a sharded state (FSDP2): a rank killed with SIGKILL, and every rank
resumes from its own memory at one step they all hold; a damaged part on one rank moves every
rank to the step before, together; and the run's final checkpoint is bitwise the one of a run
without the kill (each rank continues its own random streams: dropout).

``examples/fsdp_digits.py`` under ``torchrun --standalone --nproc_per_node=2`` with
``--memory-every-n-steps 1`` and no periodic checkpoint (the disk holds only the first
checkpoint): a worker is killed at a random moment past step 30; the newest step both ranks
hold is then damaged on one rank (a flipped bit), and the run is started again: both ranks
refuse that step and resume from the memory tier at the step before, and train to the end.
A run stopped with SIGTERM resumes from its shared final checkpoint, which holds every rank's
streams, as bitwise the run without the stop.
"""

from __future__ import annotations

import glob
import os
import random
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch
from example_runs import finish, signal_rank, start_example, wait_until
from repo_paths import repo

from torchsupervisor import CheckpointReader, latest_checkpoint
from torchsupervisor.checkpoint.files import checkpoint_step
from torchsupervisor.tiers.memory_root import memory_root

ROOT = repo()
MAX_STEPS = 120
_RESUMED = re.compile(r"rank (\d): resumed at step (\d+) from \S+ \((\w+) tier\)")
_LOST = re.compile(r"at most (\d+) steps? lost")


def _torchrun(
    logdir, workdir, restarts: int, fresh: bool = True, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    if fresh:
        workdir.mkdir()
    return start_example(
        "fsdp_digits.py",
        logdir,
        workdir,
        *("--max-steps", str(MAX_STEPS), "--save-model-secs", "3600"),
        *("--memory-every-n-steps", "1", "--log-every", "1000", *extra),
        restarts=restarts,
    )


def _newest_snapshot(workdir, rank: int) -> int:
    pattern = os.path.join(memory_root(str(workdir / "shm")), "*", f"rank-{rank}", "*.index")
    steps = [int(p[: -len(".index")].rsplit("-", 1)[1]) for p in glob.glob(pattern)]
    return max(steps, default=-1)


def _held(workdir, rank: int, tier: str = "shm") -> list[int]:
    """The steps of ``rank``'s snapshots in the memory tier (``shm``) or on the local disk."""
    pattern = os.path.join(memory_root(str(workdir / tier)), "*", f"rank-{rank}", "*.index")
    return sorted(int(p[: -len(".index")].rsplit("-", 1)[1]) for p in glob.glob(pattern))


def _flip_a_bit(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def _kill_a_rank_once(process, run, ready, victim: int, what: str) -> None:
    """Once ``ready()`` (within 180 s), SIGKILL rank ``victim``: torchrun (no restarts) fails."""
    wait_until(process, run, ready, what)
    try:
        time.sleep(random.Random().uniform(0, 0.3))
        signal_rank(process, victim, signal.SIGKILL)
        assert process.wait(120) != 0  # No restarts: torchrun stops the other rank and fails.
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def _damage_then_run_to_the_end(tmp_path, run, tier: str, step: int, extra=()) -> tuple[int, str]:
    """Flip a bit of a random rank's snapshot of ``step`` in ``tier`` (``shm``, ``local``),
    run again to the end; return that rank and the run's output."""
    damaged = random.Random().randrange(2)
    pattern = os.path.join(
        memory_root(str(run / tier)), "*", f"rank-{damaged}", f"model.ckpt-{step}.data-*"
    )
    _flip_a_bit(glob.glob(pattern)[0])
    (run / "out.log").rename(run / "first.log")
    process = _torchrun(tmp_path / "logdir", run, restarts=0, fresh=False, extra=extra)
    return damaged, finish(process, run)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> CheckpointReader:
    """The final checkpoint of the same run without a kill."""
    root = tmp_path_factory.mktemp("uninterrupted")
    finish(_torchrun(root / "logdir", root / "run", restarts=0), root / "run")
    return CheckpointReader(latest_checkpoint(str(root / "logdir")))


def _assert_as_uninterrupted(logdir, uninterrupted: CheckpointReader) -> None:
    """Every tensor of the final checkpoint equal to the uninterrupted run's (but NumPy's
    generator, which the example never seeds: each process starts it from the OS)."""
    final = CheckpointReader(latest_checkpoint(str(logdir)))
    names = sorted(uninterrupted.get_variable_to_shape_map())
    assert sorted(final.get_variable_to_shape_map()) == names
    differ = [
        n
        for n in names
        if n != "rng/numpy/keys"
        and not torch.equal(final.get_tensor(n), uninterrupted.get_tensor(n))
    ]
    assert differ == [], differ


def test_a_killed_rank_then_every_rank_resumes_from_its_memory_at_one_step(tmp_path, uninterrupted):
    run = tmp_path / "run"
    process = _torchrun(tmp_path / "logdir", run, restarts=0)
    _kill_a_rank_once(
        process,
        run,
        lambda: min(_newest_snapshot(run, r) for r in (0, 1)) >= 30,
        random.Random().randrange(2),
        "no snapshot of step 30 on every rank",
    )
    held = [_held(run, r) for r in (0, 1)]
    common = sorted(set(held[0]) & set(held[1]))
    # The ranks' writers are at most two snapshots apart (a rank a step ahead, the other's
    # snapshot in flight at the kill), and each keeps three: a step both hold.
    assert common, held
    on_disk = latest_checkpoint(str(tmp_path / "logdir"))
    # The newest step both hold is damaged on one rank: both go to the one before, together
    # (or, two apart, with no step before it both hold, to the checkpoint on disk).
    step, tier = (common[-2], "memory") if len(common) > 1 else (checkpoint_step(on_disk), "disk")
    damaged, text = _damage_then_run_to_the_end(tmp_path, run, "shm", common[-1])
    assert (
        f"step {common[-1]} of the memory tier is not usable on every rank (rank {damaged}" in text
    )
    resumed = sorted(_RESUMED.findall(text))
    expected = [("0", str(step), tier), ("1", str(step), tier)]
    assert resumed == expected, (held, text[-3000:])
    lost = [int(n) for n in _LOST.findall(text)]
    assert tier == "disk" or (lost and max(lost) <= 4), text[-3000:]  # Two more: one dropped.
    assert len(re.findall(rf"rank \d: done at step {MAX_STEPS}", text)) == 2, text[-3000:]
    assert latest_checkpoint(str(tmp_path / "logdir")).endswith(f"model.ckpt-{MAX_STEPS}")
    # The checkpoint of the start holds the chief's streams only (no stop gathered them):
    # from it, rank 1 derives its own.
    if tier == "memory":
        _assert_as_uninterrupted(tmp_path / "logdir", uninterrupted)
    # A clean end whose final checkpoint holds the last step frees every rank's memory.
    assert _held(run, 0) == _held(run, 1) == []


# In make test-slow (35 s): the suite keeps the local-disk tier after a reboot in
# tests/e2e/test_demo.py and tests/tiers/test_local_disk.py (one process), and the ranks'
# agreement on a common step of a tier in the killed-rank test above (tiers/agreed.py).
@pytest.mark.slow
def test_after_a_reboot_every_rank_resumes_from_its_local_disk_at_one_step(tmp_path, uninterrupted):
    """``--local-dir``: every rank copies its snapshot every 10 steps, at the same steps. A
    rank is killed, the node's memory is lost, the newest common copy is damaged on one rank:
    both ranks resume from their local disks at the common step before, together."""
    run = tmp_path / "run"
    extra = ("--local-dir", str(run / "local"), "--local-every-n-steps", "10", "--local-keep", "3")
    process = _torchrun(tmp_path / "logdir", run, restarts=0, extra=extra)
    _kill_a_rank_once(
        process,
        run,
        lambda: min(len(_held(run, r, "local")) for r in (0, 1)) >= 3,
        1,
        "no three copies on every rank",
    )
    held = [_held(run, r, "local") for r in (0, 1)]
    common = sorted(set(held[0]) & set(held[1]))
    assert len(common) >= 2 and all(step % 10 == 0 for step in common), held  # The same steps.
    shutil.rmtree(run / "shm")  # The reboot: the node's memory is gone.
    (run / "shm").mkdir()
    damaged, text = _damage_then_run_to_the_end(tmp_path, run, "local", common[-1], extra)
    assert (
        f"step {common[-1]} of the local tier is not usable on every rank (rank {damaged}" in text
    )
    resumed = sorted(_RESUMED.findall(text))
    assert resumed == [("0", str(common[-2]), "local"), ("1", str(common[-2]), "local")], text[
        -3000:
    ]
    assert len(re.findall(rf"rank \d: done at step {MAX_STEPS}", text)) == 2, text[-3000:]
    _assert_as_uninterrupted(tmp_path / "logdir", uninterrupted)
    # A clean end whose final checkpoint holds the last step frees every rank's copies.
    assert _held(run, 0, "local") == _held(run, 1, "local") == []


def test_a_stopped_run_resumes_from_its_shared_checkpoint_as_if_never_stopped(
    tmp_path, uninterrupted
):
    """SIGTERM to rank 1: every rank stops at one step and saves it together, the streams of
    every rank in it (``replica_streams``: gathered at that step), and the memory tier is
    freed; the run started again restores that shared checkpoint, each rank its own streams."""
    run, logdir = tmp_path / "run", tmp_path / "logdir"
    process = _torchrun(logdir, run, restarts=0)
    wait_until(
        process,
        run,
        lambda: min(_newest_snapshot(run, r) for r in (0, 1)) >= 30,
        "no snapshot of step 30 on every rank",
    )
    signal_rank(process, 1, signal.SIGTERM)
    finish(process, run, timeout=120)
    stopped = CheckpointReader(latest_checkpoint(str(logdir)))
    step = stopped.global_step
    assert 30 <= step < MAX_STEPS
    assert list(stopped.read_specs()["rng"]["replicas"]) == ["1"]
    assert _held(run, 0) == _held(run, 1) == []  # Freed: the restart reads the checkpoint.
    (run / "out.log").rename(run / "first.log")
    text = finish(_torchrun(logdir, run, restarts=0, fresh=False), run)
    resumed = sorted(_RESUMED.findall(text))
    assert resumed == [("0", str(step), "disk"), ("1", str(step), "disk")], resumed
    _assert_as_uninterrupted(logdir, uninterrupted)
