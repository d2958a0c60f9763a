"""Preemption: signals stop training cleanly with a final checkpoint; resumes are exact."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from repo_paths import worker

from torchsupervisor import latest_checkpoint
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.driver.preemption import PreemptionHandler
from torchsupervisor.storage import is_temporary_name

WORKER = worker("preemption_worker.py")
STEPS = 90


def _start(logdir, *args, start_new_session=False):
    return subprocess.Popen(
        [sys.executable, WORKER, logdir, str(STEPS), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=start_new_session,
    )


def _read_until(proc, prefix):
    lines = []
    while True:
        line = proc.stdout.readline()
        assert line, f"worker ended before {prefix!r}: {lines} {proc.stderr.read()}"
        lines.append(line)
        if line.startswith(prefix):
            return lines


def _finish(proc):
    out, err = proc.communicate(timeout=300)
    return out.splitlines(), err, proc.returncode


def _losses(lines):
    return {int(x.split()[1]): x.split()[2] for x in lines if x.startswith("LOSS")}


def _done(lines):
    (done,) = [x for x in lines if x.startswith("DONE")]
    return int(done.split()[1]), done.split()[2]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run."""
    logdir = str(tmp_path_factory.mktemp("reference"))
    lines, err, code = _finish(_start(logdir))
    assert code == 0, err
    steps, digest = _done(lines)
    assert steps == STEPS
    return _losses(lines), digest


def _temporaries(logdir):
    return [n for n in os.listdir(logdir) if is_temporary_name(n)]


def _valid_checkpoints(logdir, *, temporaries_allowed=False):
    """Verify every committed checkpoint; return their steps, oldest first.

    A checkpoint that retention retires while it is read is skipped. Temporary files are
    never taken for a checkpoint; they fail the test unless ``temporaries_allowed`` (right
    after a SIGKILL, which may interrupt a write: the next start removes them).
    """
    steps = []
    for name in os.listdir(logdir):
        if name.endswith(".index"):
            try:
                reader = CheckpointReader(os.path.join(logdir, name[: -len(".index")]))
                reader.verify()
            except Exception:
                # While the worker runs, retention may delete a listed checkpoint before it is
                # read. It deletes the index first, so a checkpoint whose index is gone was
                # retired, not damaged; any other failure is the test's failure.
                if os.path.exists(os.path.join(logdir, name)):
                    raise
                continue
            steps.append(reader.global_step)
    if not temporaries_allowed:
        assert not _temporaries(logdir)
    return sorted(steps)


def test_sigterm_at_several_points_resumes_bitwise(tmp_path, reference):
    ref_losses, ref_digest = reference
    logdir = str(tmp_path)
    rng = random.Random(3)
    losses: dict[int, str] = {}
    stops: list[int] = []
    for _ in range(2):
        proc = _start(logdir, "--step-delay", "0.02")
        lines = _read_until(proc, "READY")
        resumed_at = int(lines[-1].split()[1])
        assert resumed_at == (stops[-1] if stops else 0)
        # Signal once the worker has reported a step a few steps on, not after a delay: the
        # stop lands mid-run however busy the machine. The last target is at most 20 steps
        # (plus a stop's overshoot) from the start; at 0.02 s a step, the signal would have
        # to take more than a second to be handled for a stop to reach the end.
        target = resumed_at + rng.randint(3, 10)
        lines += _read_until(proc, f"LOSS {target} ")
        proc.send_signal(signal.SIGTERM)
        out, err, code = _finish(proc)
        assert code == 0, err
        lines += out
        stopped, _ = _done(lines)
        # Handled mid-run: after the step reported before the signal, well before the end.
        assert target < stopped < STEPS, (target, stopped)
        assert f"Received SIGTERM: stopping at step {stopped} " in err
        # The final checkpoint is at exactly the step where training stopped.
        assert _valid_checkpoints(logdir)[-1] == stopped
        assert CheckpointReader(latest_checkpoint(logdir)).global_step == stopped
        assert max(_losses(lines)) == stopped - 1
        losses.update(_losses(lines))
        stops.append(stopped)
    assert len(stops) == 2 and stops == sorted(set(stops)), stops  # Strictly increasing.
    lines, err, code = _finish(_start(logdir))
    assert code == 0, err
    assert lines[0] == f"READY {stops[-1]}"
    losses.update(_losses(lines))
    steps, digest = _done(lines)
    assert steps == STEPS
    assert losses == ref_losses  # The loss of every step, bitwise.
    assert digest == ref_digest  # The final parameters, bitwise.


def test_sigterm_to_the_process_group_spares_the_data_loader_workers(tmp_path, reference):
    """SLURM and ``kill -TERM -<pgid>`` signal the DataLoader's worker processes too: they
    ignore it, and the main process stops with a final checkpoint and exit status 0."""
    ref_losses, ref_digest = reference
    logdir = str(tmp_path)
    # Its own process group (and session): the worker and its two DataLoader workers.
    proc = _start(logdir, "--step-delay", "0.02", start_new_session=True)
    try:
        lines = _read_until(proc, "LOSS 20 ")
        os.killpg(proc.pid, signal.SIGTERM)
        out, err, code = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, err
    assert "DataLoader worker" not in err, err
    lines += out
    stopped, _ = _done(lines)
    assert 20 < stopped < STEPS
    assert f"Received SIGTERM: stopping at step {stopped} " in err
    assert _valid_checkpoints(logdir)[-1] == stopped
    assert CheckpointReader(latest_checkpoint(logdir)).global_step == stopped
    losses = _losses(lines)
    lines, err, code = _finish(_start(logdir))
    assert code == 0, err
    assert lines[0] == f"READY {stopped}"
    losses.update(_losses(lines))
    assert losses == ref_losses
    assert _done(lines) == (STEPS, ref_digest)


# A plain DataLoader whose main process signals its own process group mid-epoch.
PLAIN_LOADER = """
import os, signal, sys, torch
from torch.utils.data import DataLoader
from torchsupervisor.driver.preemption import IgnorePreemptionSignals, PreemptionHandler
handler = PreemptionHandler()
handler.install()
init = IgnorePreemptionSignals() if sys.argv[1] == "helper" else None
loader = DataLoader(torch.arange(400), batch_size=4, num_workers=2, worker_init_fn=init)
for i, batch in enumerate(loader):
    if i == 3:
        os.killpg(os.getpgid(0), signal.SIGTERM)  # This process and its workers.
print("BATCHES", i + 1, handler.describe())
"""


def test_a_plain_data_loader_with_the_worker_init_helper_survives_a_group_sigterm():
    procs = {
        init: subprocess.Popen(
            [sys.executable, "-c", PLAIN_LOADER, init],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # Its own process group.
        )
        for init in ("helper", "none")
    }
    (out, err), code = procs["helper"].communicate(timeout=300), procs["helper"].returncode
    assert code == 0, err
    assert out == "BATCHES 100 SIGTERM\n"  # Every batch, and the main process saw it.
    # Without the helper the same signal kills the workers, and the loop fails ("DataLoader
    # worker (pid ...) exited unexpectedly", or a connection reset by the dead worker) or
    # hangs for ever: about once in a hundred runs on a busy machine a worker dies holding the
    # lock of the DataLoader's shared "workers done" event, and the main process waits for that
    # lock in _mark_worker_as_unavailable (seen with py-spy). A loop that fails ends within
    # seconds (the DataLoader checks its workers every 5 s); one still running after a minute
    # is that hang. Either way it never gets through its batches.
    try:
        (out, err), code = procs["none"].communicate(timeout=60), procs["none"].returncode
        assert code != 0, (code, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(procs["none"].pid, signal.SIGKILL)
        out, err = procs["none"].communicate(timeout=30)
    assert not out, (out, err)


def test_sigkill_then_restart_replays_bitwise_from_the_checkpoint(tmp_path, reference):
    ref_losses, ref_digest = reference
    logdir = str(tmp_path)
    proc = _start(logdir, "--step-delay", "0.05")
    _read_until(proc, "READY")
    _read_until(proc, "LOSS 30 ")
    # Kill once a checkpoint past step 0 is committed: on a busy machine (fsyncs of other
    # processes) the first saves can lag a second behind the steps. One line per step, so
    # this loop is bounded.
    while not [s for s in _valid_checkpoints(logdir, temporaries_allowed=True) if s > 0]:
        assert not _read_until(proc, "LOSS ")[-1].startswith(f"LOSS {STEPS - 1} ")
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    # A kill during a save (one every 0.05 s) leaves its temporary files behind; make sure
    # there is one, so that the restart's clean-up is always tested.
    resume_step = _valid_checkpoints(logdir, temporaries_allowed=True)[-1]
    assert resume_step > 0
    planted = os.path.join(logdir, f"model.ckpt-{resume_step + 1}.index.tmp{'0' * 32}")
    with open(planted, "wb") as f:
        f.write(b"half-written")
    left = _temporaries(logdir)
    lines, err, code = _finish(_start(logdir))
    assert code == 0, err
    assert lines[0] == f"READY {resume_step}"
    assert left and "Removed" not in err  # The normal case of a restart: no warning.
    assert _valid_checkpoints(logdir)[-1] == STEPS  # And no temporary file is left.
    replayed = _losses(lines)
    assert min(replayed) == resume_step
    assert replayed == {s: v for s, v in ref_losses.items() if s >= resume_step}
    assert _done(lines)[1] == ref_digest


def _release(gate):
    with open(gate, "w"):
        pass


def _wait_for_first_commit(logdir):
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(logdir, "checkpoint")):  # Step 0 is committed.
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_sigterm_during_a_background_save(tmp_path):
    logdir = str(tmp_path / "run")
    gate = str(tmp_path / "gate")
    # The first checkpoint from step 10 on is held in its first fsync until the gate opens.
    proc = _start(logdir, "--gate", gate, "--gate-after-step", "10", "--step-delay", "0.05")
    lines = _read_until(proc, "STALLED")  # That save is in flight, for sure...
    proc.send_signal(signal.SIGTERM)  # ...when the signal arrives.
    _release(gate)
    out, err, code = _finish(proc)
    assert code == 0, err
    lines += out
    assert "RELEASED" in lines
    stopped, _ = _done(lines)
    assert stopped >= 10 and "Received SIGTERM: stopping at step" in err
    # The held save committed, then the final checkpoint at the step where training stopped.
    steps = _valid_checkpoints(logdir)
    assert steps[-1] == stopped
    assert CheckpointReader(latest_checkpoint(logdir)).global_step == stopped
    assert [s for s in steps if s >= 10], steps


def test_a_second_sigterm_during_the_final_checkpoint(tmp_path):
    logdir = str(tmp_path / "run")
    gate = str(tmp_path / "gate")
    # Only the step-0 checkpoint before the signal; the final one is held in its first fsync.
    proc = _start(
        logdir,
        *("--gate", gate, "--gate-on-signal", "--save-model-secs", "3600"),
        *("--step-delay", "0.05"),
    )
    _read_until(proc, "LOSS 5 ")
    _wait_for_first_commit(logdir)
    proc.send_signal(signal.SIGTERM)
    lines = _read_until(proc, "STALLED")  # The final checkpoint is being written...
    proc.send_signal(signal.SIGTERM)  # ...when the second signal arrives.
    _release(gate)
    out, err, code = _finish(proc)
    assert code == 0, err
    stopped, _ = _done(lines + out)
    assert stopped > 5
    assert err.count("Received SIGTERM: stopping at step") == 1, err
    assert _valid_checkpoints(logdir) == [0, stopped]


def test_ctrl_c_is_a_graceful_stop_by_default(tmp_path):
    logdir = str(tmp_path)
    proc = _start(logdir, "--step-delay", "0.05")  # The Supervisor's default signals.
    _read_until(proc, "LOSS 5 ")
    proc.send_signal(signal.SIGINT)
    lines, err, code = _finish(proc)
    assert code == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    stopped, _ = _done(lines)
    assert 5 < stopped < STEPS
    expected = (
        f"Received SIGINT: stopping at step {stopped} with a final checkpoint (press Ctrl-C "
        "again to abort at once)"
    )
    assert [line for line in err.splitlines() if "SIGINT" in line] == [expected]
    assert _valid_checkpoints(logdir)[-1] == stopped  # Nothing lost.


def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    logdir = str(tmp_path)
    gate = str(tmp_path / "gate")  # Never created: the final checkpoint is held forever.
    proc = _start(
        logdir,
        *("--gate", gate, "--gate-on-signal", "--save-model-secs", "3600"),
        *("--step-delay", "0.02"),
    )
    _read_until(proc, "READY")
    _wait_for_first_commit(logdir)
    # A signal before the first step would stop at step 0, whose checkpoint is committed
    # already: no final checkpoint to hold, and the worker ends (seen once in CI).
    _read_until(proc, "LOSS 2 ")
    proc.send_signal(signal.SIGINT)
    _read_until(proc, "STALLED")  # The final checkpoint is being written...
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)  # ... and the user does not want to wait.
    lines, err, code = _finish(proc)
    # By design at most ABANDONED_EXIT_WAIT_SECS (5 s) for the stuck save to clean up, then
    # the exit; waiting for the save would take the gate's 120 s. The margin is for the exit
    # of a torch process on a busy 2-core machine (16 s seen there).
    assert time.monotonic() - start < 45
    assert code != 0 and "Second interrupt: aborting now" in err
    assert not [x for x in lines if x.startswith("DONE")]
    assert _valid_checkpoints(logdir, temporaries_allowed=True) == [0]
    lines, err, code = _finish(_start(logdir, "--save-model-secs", "3600"))
    assert code == 0, err
    assert lines[0] == "READY 0"  # The restart resumes from the last commit, cleanly.
    assert _valid_checkpoints(logdir)[-1] == STEPS


def test_a_failed_final_checkpoint_after_a_signal_exits_non_zero(tmp_path):
    logdir = str(tmp_path)
    proc = _start(
        logdir, "--full-disk-on-signal", "--save-model-secs", "3600", "--step-delay", "0.02"
    )
    _read_until(proc, "READY")
    _wait_for_first_commit(logdir)
    _read_until(proc, "LOSS 5 ")
    proc.send_signal(signal.SIGTERM)
    lines, err, code = _finish(proc)
    assert code == 1, err
    stopped, _ = _done(lines) if any(x.startswith("DONE") for x in lines) else (None, None)
    assert stopped is None  # managed_session raised SystemExit: the program did not go on.
    (line,) = [x for x in err.splitlines() if "final checkpoint failed" in x]
    assert "Stopped by SIGTERM at step " in line and "No space left on device" in line
    assert f"the last committed checkpoint is step 0 ({os.path.join(logdir, 'model.ckpt-0')})" in (
        line
    )
    assert "steps will be redone" in line
    assert _valid_checkpoints(logdir) == [0]


def test_sigterm_during_startup(tmp_path):
    logdir = str(tmp_path)
    proc = _start(logdir, "--slow-start", "1.0")
    _read_until(proc, "STARTING")
    proc.send_signal(signal.SIGTERM)
    lines, err, code = _finish(proc)
    assert code == 0, err
    assert _done(lines)[0] == 0
    assert _valid_checkpoints(logdir) == [0]


def test_requeue_exit_code(tmp_path):
    logdir = str(tmp_path)
    proc = _start(logdir, "--exit-code", "75", "--step-delay", "0.01")
    _read_until(proc, "LOSS 5 ")
    proc.send_signal(signal.SIGUSR1)
    lines, err, code = _finish(proc)
    assert code == 75, err
    assert not [x for x in lines if x.startswith("DONE")]
    assert "Received SIGUSR1" in err
    assert _valid_checkpoints(logdir)[-1] > 5


def test_a_final_checkpoint_that_cannot_finish_in_time_is_abandoned_cleanly(tmp_path):
    logdir = str(tmp_path)
    # Every fsync takes 0.5 s, the grace period is 0.3 s: the final save cannot finish.
    proc = _start(
        logdir,
        *("--slow-fsync", "0.5", "--grace", "0.3", "--save-model-secs", "3600"),
        *("--step-delay", "0.05"),
    )
    # Not the state file: it is written before the save's last fsyncs (0.5 s each here), and
    # a signal in between would abandon that save instead of the final one.
    _read_until(proc, "COMMITTED 0")
    proc.send_signal(signal.SIGTERM)
    _, err, code = _finish(proc)
    assert code == 1, err  # Work was lost: never exit 0.
    assert "abandoned" in err
    assert "the final checkpoint failed (not written within the grace period: " in err
    # Only checkpoints committed before the signal remain, complete; no temporary file.
    assert _valid_checkpoints(logdir) == [0]


def test_handler_records_restores_and_needs_the_main_thread(caplog):
    previous = signal.getsignal(signal.SIGUSR1)
    handler = PreemptionHandler([signal.SIGUSR1])
    handler.install()
    try:
        assert signal.getsignal(signal.SIGUSR1) != previous
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.received == signal.SIGUSR1 and handler.count == 2
        assert handler.describe() == "SIGUSR1"
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == previous
    other = PreemptionHandler([signal.SIGUSR1])
    thread = threading.Thread(target=other.install)
    thread.start()
    thread.join(10)
    assert "not started on the main thread" in caplog.text
    assert signal.getsignal(signal.SIGUSR1) == previous


def test_managed_session_installs_and_restores_the_handlers(tmp_path):

    from torchsupervisor import Supervisor

    before = signal.getsignal(signal.SIGTERM)
    sv = Supervisor(logdir=str(tmp_path), state={"w": torch.zeros(1)}, save_summaries_secs=0)
    with sv.managed_session():
        assert signal.getsignal(signal.SIGTERM) != before
        assert not sv.should_stop()
    assert signal.getsignal(signal.SIGTERM) == before
    off = Supervisor(
        logdir=str(tmp_path / "off"), state={"w": torch.zeros(1)}, preemption_signals=()
    )
    with off.managed_session():
        assert signal.getsignal(signal.SIGTERM) == before
    assert sv.preempted is None
