"""``examples/digits.py`` and ``examples/tf1_input_pipeline.py`` run, are resumable, and resume
at the restored step."""

from __future__ import annotations

import collections
import glob
import os
import signal
import subprocess
import sys
import sysconfig

from repo_paths import repo
from supervisor_helpers import START, all_events, scalars, session_logs

from torchsupervisor import CheckpointReader, latest_checkpoint

ROOT = repo()
DIGITS = os.path.join(ROOT, "examples", "digits.py")


def _command(logdir, max_steps):
    return [sys.executable, DIGITS, "--logdir", logdir, "--max-steps", str(max_steps)]


def _run(logdir, max_steps):
    done = subprocess.run(_command(logdir, max_steps), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _latest_step(logdir):
    return CheckpointReader(latest_checkpoint(logdir)).global_step


def test_digits_example_runs_and_resumes_at_the_restored_step(tmp_path):
    logdir = str(tmp_path)
    # A long run, stopped by SIGTERM once it printed progress: its final checkpoint is at the
    # step where it stopped.
    proc = subprocess.Popen(
        _command(logdir, 1_000_000), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()
    assert line.startswith("step 200: loss "), (line, proc.stderr.read() if proc.poll() else "")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "Received SIGTERM: stopping at step" in err
    stopped = _latest_step(logdir)
    assert 200 <= stopped < 1_000_000

    # Run again: it continues from that checkpoint, not from scratch, and runs to the end.
    _run(logdir, stopped + 40)
    assert _latest_step(logdir) == stopped + 40

    events = all_events(logdir)
    starts = [step for step, status, _ in session_logs(events) if status == START]
    assert starts == [1, stopped + 1]  # At the first step each session produces.
    # Every step's loss was written exactly once: the second run trained no step again.
    counts = collections.Counter(step for step, _ in scalars(events, "loss"))
    assert sorted(counts) == list(range(1, stopped + 41))
    assert set(counts.values()) == {1}
    accuracies = [value for _, value in scalars(events, "accuracy")]
    assert accuracies and accuracies[-1] > 0.5


PIPELINE = os.path.join(ROOT, "examples", "tf1_input_pipeline.py")


def test_tf1_input_pipeline_example_ends_with_its_input_and_resumes_exactly(tmp_path):
    # Stopped by SIGTERM as soon as it trains, then run again: together the two runs train
    # exactly the steps of the input (every file once per epoch), none twice.
    logdir = str(tmp_path)
    command = [sys.executable, PIPELINE, "--logdir", logdir, "--num-epochs", "2"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "starting at step 0\n"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    stopped = _latest_step(logdir)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"starting at step {stopped}"
    files = min(200, len(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))))
    assert lines[-1] == f"done at step {-(-files * 2 // 16)}"  # 2 epochs, batches of 16
