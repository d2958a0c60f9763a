"""Crash torture: SIGKILL at random moments, during training and during saves.

Every restart must restore a complete, intact checkpoint holding exactly one step's state, and
must resume from the newest checkpoint committed before the kill: a committed checkpoint is
never lost, a partial one never restored. The default suite runs a few trials; ``-m slow``
runs 50 (``make test-slow``).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import adversarial_record
import pytest
from repo_paths import worker

from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.storage import is_temporary_name

WORKER = worker("torture_worker.py")


def _committed(logdir: str) -> list[int]:
    """Steps of the committed checkpoints, each verified byte by byte."""
    steps = []
    for name in os.listdir(logdir):
        if name.endswith(".index"):
            reader = CheckpointReader(os.path.join(logdir, name[: -len(".index")]))
            reader.verify()
            steps.append(reader.global_step)
    return sorted(steps)


def _torture(logdir: str, trials: int, seed: int, record: bool = False) -> None:
    rng = random.Random(seed)
    expected = 0
    for trial in range(trials):
        proc = subprocess.Popen(
            [sys.executable, WORKER, logdir],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            restored = proc.stdout.readline().split()
            assert restored[:1] == ["RESTORED"], (restored, proc.stderr.read())
            # The newest committed checkpoint at the last kill, exactly that step's state.
            assert restored[1:] == [str(expected), "True"], (trial, restored)
            assert proc.stdout.readline().strip() == "TRAINING"
            time.sleep(rng.uniform(0.05, 1.2))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        committed = _committed(logdir)  # Whatever the kill interrupted, these are intact.
        # The newest commit never goes back. (A first run killed before its first commit,
        # e.g. on a busy machine, leaves none: the next run starts fresh at step 0.)
        newest = committed[-1] if committed else 0
        held = newest >= expected and (committed or expected == 0)
        if record:
            adversarial_record.record(
                "SIGKILL at random moments", None if held else f"trial {trial}: {committed}"
            )
        assert held, (trial, committed)
        expected = newest
    # A last run that ends cleanly leaves no temporary file and no unreferenced shard.
    final = subprocess.run(
        [sys.executable, WORKER, logdir, str(expected + 10)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert final.returncode == 0, final.stderr
    assert final.stdout.split()[:3] == ["RESTORED", str(expected), "True"]
    assert _committed(logdir)[-1] == expected + 10
    # Retention held through every kill: a checkpoint committed just before a kill, before
    # the state file listed it, was adopted by the restart instead of leaking.
    assert len(_committed(logdir)) <= 5, _committed(logdir)
    names = os.listdir(logdir)
    assert not [n for n in names if is_temporary_name(n)]
    indexes = {n[: -len(".index")] for n in names if n.endswith(".index")}
    assert {n.split(".data-")[0] for n in names if ".data-" in n} <= indexes


def test_random_kills_default(tmp_path):
    _torture(str(tmp_path), trials=5, seed=11)


@pytest.mark.slow
def test_random_kills_many(tmp_path):
    _torture(str(tmp_path), trials=50, seed=12, record=True)
