"""examples/digits_monitored.py: MonitoredTrainingSession + QueueRunner input, end to end."""

from __future__ import annotations

import re
import subprocess
import sys

from repo_paths import repo
from supervisor_helpers import checkpoint_steps

EXAMPLE = repo("examples", "digits_monitored.py")
_DONE = re.compile(r"Done at step (\d+): held-out accuracy ([\d.]+)%")


def run(logdir: str, *args: str) -> str:
    # No timed checkpoint: on a busy machine 44 steps can take longer than the default 10 s,
    # and the assertions below are about the final and the step-0 checkpoints only.
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--logdir", logdir, "--save-checkpoint-secs", "3600", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_end_of_input_ends_training_and_a_rerun_resumes(tmp_path):
    logdir = str(tmp_path / "run")
    first = run(logdir, "--epochs", "2")
    assert "Training from step 0" in first
    step, accuracy = _DONE.search(first).groups()
    assert step == "44" and float(accuracy) > 50.0  # 1437 examples // 64 = 22 batches/epoch.
    assert checkpoint_steps(logdir) == [0, 44]  # The final checkpoint of the clean exit.
    second = run(logdir, "--epochs", "1", "--max-steps", "50")
    assert "Training from step 44" in second
    assert _DONE.search(second).group(1) == "50"  # StopAtStepHook, before the input ends.
    assert checkpoint_steps(logdir) == [0, 44, 50]
