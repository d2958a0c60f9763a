"""The main job: the digits demo runs, resumes, and survives SIGKILL at random moments."""

from __future__ import annotations

import fcntl
import os
import pty
import random
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.storage import is_temporary_name

_DONE = re.compile(r"Done at step (\d+): held-out accuracy ([\d.]+)%")
_PROGRESS = re.compile(r"step +(\d+) +loss +[\d.]+ +held-out accuracy +([\d.]+)%")


def _demo(logdir: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torchsupervisor",
        "demo",
        "--logdir",
        logdir,
        "--log-every",
        "50",
        *args,
    ]


def _run(logdir: str, *args: str) -> str:
    proc = subprocess.run(_demo(logdir, *args), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _committed_steps(logdir: str) -> list[int]:
    steps = []
    for name in os.listdir(logdir):
        if name.endswith(".index"):
            reader = CheckpointReader(os.path.join(logdir, name[: -len(".index")]))
            reader.verify()  # Every committed checkpoint is complete and intact.
            steps.append(reader.global_step)
    return sorted(steps)


def _index_names(logdir: str) -> set[str]:
    """The checkpoints' index files (written last, at the commit) by name, read nothing."""
    if not os.path.isdir(logdir):
        return set()
    return {name for name in os.listdir(logdir) if name.endswith(".index")}


def _wait_for_a_new_checkpoint(logdir: str, before: set[str], proc: subprocess.Popen) -> None:
    for _ in range(2400):  # 120 s at most.
        if _index_names(logdir) - before:
            return
        assert proc.poll() is None, "the demo ended before it saved"
        time.sleep(0.05)
    raise AssertionError("no checkpoint was committed in 120 s")


def test_sigkill_at_random_moments_always_resumes_from_a_complete_checkpoint(tmp_path):
    logdir = str(tmp_path / "run")
    rng = random.Random(7)
    args = ["--max-steps", "100000", "--save-model-secs", "0.1", "--step-delay-secs", "0.002"]
    last_accuracy = 0.0
    for _ in range(1):  # More random kills: test_crash_torture.py (and make test-slow).
        before = _index_names(logdir)
        proc = subprocess.Popen(_demo(logdir, *args), stdout=subprocess.PIPE, text=True)
        try:
            header = proc.stdout.readline()
            assert "Starting from scratch" in header or "Resumed at step" in header
            proc.stdout.readline()  # The accuracy at the start.
            progress = proc.stdout.readline()  # Training is under way.
            assert _PROGRESS.search(progress), progress
            # A save of this run commits first: on a machine that other processes keep busy
            # the idle-priority writer may take seconds, and the kill is meant to land at a
            # random moment of a run that saves, not before its first save.
            _wait_for_a_new_checkpoint(logdir, before, proc)
            time.sleep(rng.uniform(0.0, 1.3))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        committed = _committed_steps(logdir)
        assert committed, "a checkpoint must have been committed before the kill"
        resumed = subprocess.run(
            _demo(logdir, "--max-steps", str(committed[-1] + 50)),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert resumed.returncode == 0, resumed.stderr
        assert f"Resumed at step {committed[-1]} " in resumed.stdout
        assert not [n for n in os.listdir(logdir) if is_temporary_name(n)]
        accuracy = float(_DONE.search(resumed.stdout).group(2))
        assert accuracy >= last_accuracy - 5.0  # Training continues; it never starts over.
        last_accuracy = accuracy
    assert last_accuracy > 85.0


def test_demo_trains_resumes_and_tensorboard_reads_its_logdir(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torchsupervisor import summary_iterator

    logdir = str(tmp_path / "run")
    first = _run(logdir, "--max-steps", "150", "--save-summaries-secs", "0.2")
    assert "Starting from scratch" in first
    step, accuracy = _DONE.search(first).groups()
    assert step == "150" and float(accuracy) > 50.0
    second = _run(logdir, "--max-steps", "300", "--save-summaries-secs", "0.2")
    assert "Resumed at step 150" in second
    step, accuracy = _DONE.search(second).groups()
    assert step == "300" and float(accuracy) > 80.0
    assert _committed_steps(logdir)[-1] == 300

    files = sorted(f for f in os.listdir(logdir) if "tfevents" in f)
    assert len(files) == 2
    logs = []
    for name in files:
        events = list(summary_iterator(os.path.join(logdir, name)))
        assert events[0].file_version == "brain.Event:2"
        logs.append([(e.session_log.status, e.step) for e in events if e.HasField("session_log")])
    start, stop, checkpoint = 1, 2, 3
    for run_logs, first_step, last_step in zip(logs, (0, 150), (150, 300)):
        assert run_logs[0] == (start, first_step + 1)  # START at the first step produced.
        assert run_logs[-1] == (stop, 0)  # STOP at exit, without a step.
        assert (checkpoint, last_step) in run_logs  # The final checkpoint.
    accumulator = EventAccumulator(logdir, size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    assert {"train/loss", "eval/accuracy", "global_step/sec"} <= set(tags["scalars"])
    assert {"weights/conv1", "weights/fc1"} <= set(tags["histograms"])
    losses = accumulator.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, 301))  # One continuous series.
    accuracies = [e.step for e in accumulator.Scalars("eval/accuracy")]
    assert accuracies == [0, 50, 100, 150, 200, 250, 300]
    # Run again once finished (its start and restore span many 0.05 s summary intervals): it
    # trains nothing and writes no global_step/sec of 0 (TF's first value, or a "stall").
    _run(logdir, "--max-steps", "300", "--save-summaries-secs", "0.05")
    (rerun,) = sorted(set(f for f in os.listdir(logdir) if "tfevents" in f) - set(files))
    rates = [
        v.simple_value
        for e in summary_iterator(os.path.join(logdir, rerun))
        for v in e.summary.value
        if v.tag == "global_step/sec"
    ]
    assert rates == []


def test_the_demo_draws_a_live_line_on_a_terminal(tmp_path):
    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    seen = bytearray()

    def read_terminal() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the demo closed its end.
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(
            _demo(str(tmp_path / "run"), "--max-steps", "60", "--step-delay-secs", "0.02"),
            stdout=subprocess.PIPE,
            stderr=terminal,
            text=True,
            timeout=300,
        )
    finally:
        os.close(terminal)
        reader.join(30)
        os.close(master)
    assert proc.returncode == 0
    assert "Done at step 60" in proc.stdout  # The plain lines stay on stdout.
    line = seen.decode(errors="replace")
    assert "%|" in line and "step 60/60" in line and "steps/s" in line and "loss " in line


def test_kill_9_and_a_reboot_resume_from_the_local_disk_tier(tmp_path):
    """``--memory-every-n-steps 1 --local-dir DIR``: the demo is killed with SIGKILL, its
    node's memory is lost (the tmpfs emptied), and the restart resumes from the newest copy
    on the local disk, checked, at a step it had reached."""
    logdir, shm, local = str(tmp_path / "run"), tmp_path / "shm", tmp_path / "local"
    shm.mkdir()
    env = {**os.environ, "TORCHSUPERVISOR_MEMORY_ROOT": str(shm)}
    args = [
        *("--max-steps", "100000", "--save-model-secs", "3600", "--step-delay-secs", "0.01"),
        *("--memory-every-n-steps", "1", "--local-dir", str(local)),
        *("--local-every-secs", "0.2"),
    ]
    proc = subprocess.Popen(
        _demo(logdir, *args), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        copies: list[str] = []
        for _ in range(1200):  # 120 s at most.
            copies = [p for p in _tree(local) if p.endswith(".index")]
            if len(copies) >= 2:
                break
            assert proc.poll() is None, "the demo ended"
            time.sleep(0.1)
        assert len(copies) >= 2, "no second copy on the local disk in 120 s"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    newest = max(
        int(p[: -len(".index")].rsplit("-", 1)[1]) for p in _tree(local) if p.endswith(".index")
    )
    for path in _tree(shm):  # The reboot: the node's memory is gone.
        if os.path.isfile(path):
            os.unlink(path)
    again = ["--max-steps", str(newest + 5), *args[2:4], *args[6:]]  # No delay.
    out = subprocess.run(
        _demo(logdir, *again), capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(rf"Resumed at step {newest} from \S+ \(local tier\)", out.stdout), out.stdout
    assert _DONE.search(out.stdout)


def _tree(root) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]
