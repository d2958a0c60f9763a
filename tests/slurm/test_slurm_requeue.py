"""A real SLURM on this host (``slurm_cluster.py``): ``sbatch --requeue`` jobs stopped by
``scancel --signal=USR1``, by their time limit with no signal, and by ``--signal=B:USR1@N``
(slow), each resuming in the same log directory until it finishes by itself, bitwise equal to
an uninterrupted run, with one run id and no step lost.

The training is ``tests/workers/preemption_worker.py`` (a small MLP with dropout, a shuffled
``ResumableDataLoader`` with two worker processes, RNG state in the checkpoint), run straight
by the batch script (``exec``: the signals of ``--signal=B:`` go to the batch shell).
SLURM holds a requeued job for 2 minutes; the tests release it 3 s after its requeue
(``SlurmCluster.release``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from repo_paths import worker
from slurm_cluster import RELEASE_AFTER_SECS
from supervisor_helpers import accumulator

WORKER = worker("preemption_worker.py")
STEPS = 150
JOB_SECS = 240.0  # Bound of one job's whole life here (a busy 2-core machine), not a timing.
ENDED_BADLY = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


def _losses(text: str) -> dict[int, str]:
    """Each step's loss, the last one printed (a step redone after a stop prints again)."""
    losses = {}
    for line in text.splitlines():
        if line.startswith("LOSS "):
            _, step, value = line.split()
            losses[int(step)] = value
    return losses


def _done(text: str) -> tuple[int, str]:
    """The last ``DONE`` line's step and digest (a cycle that requeued may print one too,
    if SLURM's SIGTERM does not end it first)."""
    done = [line for line in text.splitlines() if line.startswith("DONE ")][-1]
    return int(done.split()[1]), done.split()[2]


def _uninterrupted(logdir: str, steps: int):
    """Every step's loss and the final parameters' digest of a run that is never stopped."""
    done = subprocess.run(
        [sys.executable, WORKER, logdir, str(steps)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "SLURM_JOB_ID": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return _losses(done.stdout), _done(done.stdout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _uninterrupted(str(tmp_path_factory.mktemp("slurm-reference")), STEPS)


def _submit(
    slurm, tmp_path, *sbatch_args: str, worker_args: str = "", steps: int = STEPS
) -> tuple[str, str, str]:
    logdir = str(tmp_path / "logdir")
    out = str(tmp_path / "job.out")
    script = tmp_path / "train.sh"
    command = f"{sys.executable} -u {WORKER} {logdir} {steps} --scalars {worker_args}"
    script.write_text(f"#!/bin/bash\nexec {command}\n")
    job = slurm.sbatch(
        "--requeue", "--open-mode=append", f"--output={out}", *sbatch_args, str(script)
    )
    return job, logdir, out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _wait_for_text(slurm, job: str, out: str, text: str) -> None:
    deadline = time.monotonic() + JOB_SECS
    while text not in _read(out):
        assert time.monotonic() < deadline, f"no {text!r} in the job's output{slurm.logs()}"
        assert slurm.job(job)["JobState"] not in ENDED_BADLY, _read(out)
        time.sleep(0.1)


def _run_to_completion(slurm, job: str, out: str, max_cycles: int) -> int:
    """Release each requeue until the job completes; return how many times it requeued."""
    deadline = time.monotonic() + JOB_SECS * max_cycles
    held_since: dict[str, float] = {}  # By restart count: when it was first seen held.
    while True:
        fields = slurm.job(job)
        state = fields["JobState"]
        if state == "COMPLETED":
            return int(fields["Restarts"])
        assert state not in ENDED_BADLY, f"job {job} ended {state}:\n{_read(out)}{slurm.logs()}"
        assert int(fields["Restarts"]) <= max_cycles, _read(out)
        assert time.monotonic() < deadline, f"job {job} still {state}:\n{_read(out)}"
        if state == "PENDING" and fields.get("Reason") == "BeginTime":
            since = held_since.setdefault(fields["Restarts"], time.monotonic())
            if time.monotonic() - since >= RELEASE_AFTER_SECS:
                slurm.release(job)
        time.sleep(0.2)


def _check_resumed_exactly(text: str, reference, restarts: int, logdir: str) -> None:
    losses, done = reference
    assert _losses(text) == losses  # Every step's loss, bitwise, across the requeues.
    assert _done(text) == done
    ready = [int(line.split()[1]) for line in text.splitlines() if line.startswith("READY ")]
    assert len(ready) == restarts + 1 and ready[0] == 0
    # Each cycle resumed at the step the one before stopped at: no step lost.
    stops = [
        int(line.split("stopping at step ")[1].split()[0])
        for line in text.splitlines()
        if "stopping at step " in line
    ]
    assert stops == ready[1:], text
    with open(os.path.join(logdir, "run_id")) as f:
        assert len(f.read().strip()) == 32  # One run id, kept across the requeues.
    # TensorBoard shows one continuous series: each step once, with the loss it had.
    series = [(e.step, e.value) for e in accumulator(logdir).Scalars("loss")]
    assert [step for step, _ in series] == sorted(losses)
    assert all(value == float(np.float32(losses[step])) for step, value in series)


def test_scancel_signal_usr1_stops_requeues_and_resumes_bitwise(slurm, tmp_path, reference):
    job, logdir, out = _submit(slurm, tmp_path, worker_args="--step-delay 0.05")
    _wait_for_text(slurm, job, out, "LOSS 20 ")
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    restarts = _run_to_completion(slurm, job, out, max_cycles=2)
    text = _read(out)
    assert restarts == 1, text
    assert "Received SIGUSR1: stopping at step" in text
    assert f"Requeued SLURM job {job}" in text
    _check_resumed_exactly(text, reference, restarts, logdir)


def test_time_limit_without_a_signal_stops_before_it_and_requeues(slurm, tmp_path, reference):
    # A minute's limit; the run stops 45 s before it (its grace period) with a final
    # checkpoint, requeues, and each new start gets a new minute, until the steps are done.
    job, logdir, out = _submit(
        slurm, tmp_path, "--time=1", worker_args="--step-delay 0.1 --grace 45"
    )
    restarts = _run_to_completion(slurm, job, out, max_cycles=6)
    text = _read(out)
    assert restarts >= 1, text
    assert text.count("Preemption notice from SLURM time limit (job ") == restarts
    _check_resumed_exactly(text, reference, restarts, logdir)


@pytest.mark.slow
def test_signal_b_usr1_before_the_time_limit_requeues_until_done(slurm, tmp_path, reference):
    # SLURM sends USR1 to the batch shell 50 s before the limit (give or take its 30-60 s
    # check interval): the job stops, requeues, and finishes by itself.
    job, logdir, out = _submit(
        slurm,
        tmp_path,
        "--time=1",
        "--signal=B:USR1@50",
        worker_args="--step-delay 0.3 --grace 5",
    )
    restarts = _run_to_completion(slurm, job, out, max_cycles=8)
    text = _read(out)
    assert restarts >= 1 and text.count("Received SIGUSR1") == restarts, text
    _check_resumed_exactly(text, reference, restarts, logdir)


# The soaks of issue 44's targets (make test-slow) --------------------------------------------


def _count(text: str, prefix: str) -> int:
    return sum(line.startswith(prefix) for line in text.splitlines())


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_twenty_requeue_cycles_of_scancel_signal_usr1(slurm, tmp_path):
    cycles, steps = 20, 400
    reference = _uninterrupted(str(tmp_path / "reference"), steps)
    job, logdir, out = _submit(slurm, tmp_path, worker_args="--step-delay 0.02", steps=steps)
    for cycle in range(cycles):
        deadline = time.monotonic() + JOB_SECS
        while True:  # This cycle is up and has trained a few steps past its resume.
            text = _read(out)
            tail = text[text.rfind("READY ") :] if "READY " in text else ""
            if _count(text, "READY ") == cycle + 1 and _count(tail, "LOSS ") >= 3:
                break
            assert time.monotonic() < deadline, f"cycle {cycle} did not start:\n{text}"
            assert slurm.job(job)["JobState"] not in ENDED_BADLY, text
            time.sleep(0.05)
        slurm.run("scancel", "--signal=USR1", "--batch", job)
        deadline = time.monotonic() + JOB_SECS
        while not (
            (fields := slurm.job(job))["JobState"] == "PENDING"
            and int(fields["Restarts"]) == cycle + 1
        ):
            assert time.monotonic() < deadline, f"cycle {cycle} did not requeue:\n{_read(out)}"
            assert fields["JobState"] not in ENDED_BADLY | {"COMPLETED"}, _read(out)
            time.sleep(0.1)
        time.sleep(RELEASE_AFTER_SECS)
        slurm.release(job)
    restarts = _run_to_completion(slurm, job, out, max_cycles=cycles)
    text = _read(out)
    assert restarts == cycles and text.count("Requeued SLURM job") == cycles
    _check_resumed_exactly(text, reference, restarts, logdir)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ten_requeue_cycles_at_the_time_limit_without_a_signal(slurm, tmp_path):
    steps = 800
    reference = _uninterrupted(str(tmp_path / "reference"), steps)
    job, logdir, out = _submit(
        slurm, tmp_path, "--time=1", worker_args="--step-delay 0.1 --grace 50", steps=steps
    )
    restarts = _run_to_completion(slurm, job, out, max_cycles=40)
    text = _read(out)
    assert restarts >= 10, text
    assert text.count("Preemption notice from SLURM time limit (job ") == restarts
    _check_resumed_exactly(text, reference, restarts, logdir)
