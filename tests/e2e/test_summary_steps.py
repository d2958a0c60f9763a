"""Every logged step shows exactly once after restarts, on the documented paths.

The rule (``summary/restarts.py``): a summary's step is the number of training steps done.
The README's loop, the quickstart's loop, ``MonitoredTrainingSession`` with its hooks and
``examples/ddp_digits.py`` are each killed with SIGKILL after a checkpoint, resumed, stopped
with SIGTERM, and resumed to the end; TensorBoard's own loader (``EventAccumulator``, which
purges at ``SessionLog.START``) and ``torchsupervisor events`` must then show the loss at
every step from 1 to the last, once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from process_tree import signal_tree, wait_gone
from repo_paths import repo, worker
from tensorboard.backend.event_processing import event_accumulator

from torchsupervisor import summary_iterator
from torchsupervisor.cli.events import read_runs
from torchsupervisor.errors import DataLossError

WORKER = worker("summary_steps_worker.py")
# The worker's lines, and the DDP example's (its chief's).
_RESTORED = re.compile(r"^(?:RESTORED |rank 0: resumed at step )(\d+)")
_STEP = re.compile(r"^(?:STEP |step )(\d+)")
LINE_TIMEOUT_SECS = 300  # A busy machine starts torchrun's workers slowly.
REQUEUE = 42  # The preemptible script's exit status after a clean preemption.


def _checkpoint_step(logdir: str) -> int:
    """The step of the newest committed checkpoint (its index written), or -1."""
    names = [n for n in os.listdir(logdir) if n.endswith(".index")]
    return max((int(n[: -len(".index")].rsplit("-", 1)[1]) for n in names), default=-1)


class Run:
    """A training process whose ``STEP <n>`` lines are followed."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.restored: int | None = None
        self.step = 0

    def until(self, done, what: str) -> None:
        """Read lines until ``done()`` holds after one (bounded in lines and time)."""
        deadline = time.monotonic() + LINE_TIMEOUT_SECS
        for _ in range(100_000):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(60)
                pytest.fail(f"ended before {what}: {self.proc.stderr.read()[-3000:]}")
            restored, step = _RESTORED.match(line), _STEP.match(line)
            if restored:
                self.restored = int(restored[1])
            elif step:
                self.step = int(step[1])
            if done():
                return
        pytest.fail(f"no {what} in 100,000 lines")

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process and its descendants (torchrun's workers too)."""
        signal_tree(self.proc.pid, sig)

    def stop(self, sig: int, *, tree: bool = True) -> int:
        """Signal the process tree (``tree``; else the process alone, as a scheduler signals
        a batch shell); wait for the process and every descendant to end."""
        if tree:
            descendants = signal_tree(self.proc.pid, sig)
        else:
            descendants = signal_tree(self.proc.pid, 0)  # Who to wait for; no signal.
            self.proc.send_signal(sig)
        self.stdout, self.stderr = self.proc.communicate(timeout=180)
        wait_gone(descendants)
        return self.proc.returncode

    def kill_past_a_checkpoint(self, logdir: str, tag: str) -> int:
        """SIGKILL the run once its events files hold points of ``tag`` after its newest
        checkpoint, for sure: it is frozen (SIGSTOP) while that is checked, and let go on if
        a save just caught up. Returns the last step of ``tag`` on disk."""
        for _ in range(20):
            self.until(
                lambda: _last_on_disk(logdir, tag) > max(3, _checkpoint_step(logdir)),
                "points logged past a checkpoint",
            )
            self.signal(signal.SIGSTOP)
            logged = _last_on_disk(logdir, tag)
            if _checkpoint_step(logdir) < logged:
                assert self.stop(signal.SIGKILL) == -signal.SIGKILL
                return logged
            self.signal(signal.SIGCONT)
        pytest.fail("every pause found a checkpoint at the last step logged")


def _last_on_disk(logdir: str, tag: str) -> int:
    """The last step of ``tag`` in the events files now (-1: none); a file being written
    may end in a partial record."""
    last = -1
    for name in os.listdir(logdir):
        if "tfevents" in name:
            try:
                for event in summary_iterator(os.path.join(logdir, name)):
                    if any(v.tag == tag for v in event.summary.value):
                        last = max(last, event.step)
            except DataLossError:
                pass
    return last


def _kill_then_terminate_then_finish(
    start, logdir: str, tag: str, extra_steps: int, *, batch_shell: bool = False
) -> tuple[int, list[Run]]:
    """Run 1 is SIGKILLed after steps past its last checkpoint, run 2 stopped with SIGTERM after
    a checkpoint of its own (``batch_shell``: to the process alone, a batch script that
    forwards it), run 3 trains ``extra_steps`` more; return the last step and the runs."""
    first = start(100_000)
    first.until(lambda: _checkpoint_step(logdir) >= 0, "the first checkpoint")
    logged = first.kill_past_a_checkpoint(logdir, tag)

    second = start(100_000)
    second.until(lambda: second.restored is not None, "the restore")
    assert second.restored < logged  # A lost segment to remove.
    second.until(
        lambda: _checkpoint_step(logdir) > second.restored and second.step >= logged + 5,
        "a checkpoint of the second run",
    )
    second.stop(signal.SIGTERM, tree=not batch_shell)
    stopped = _checkpoint_step(logdir)  # The final checkpoint of the SIGTERM stop.
    assert stopped >= second.step

    last = stopped + extra_steps
    third = start(last)
    third.until(lambda: third.restored is not None, "the restore")
    assert third.restored == stopped
    third.stdout, err = third.proc.communicate(timeout=300)
    assert third.proc.returncode == 0, err[-3000:]
    return last, [first, second, third]


def _steps_shown(logdir: str, tag: str) -> tuple[list[int], list[int]]:
    """The steps of ``tag``: by TensorBoard's loader, and by ``torchsupervisor events``."""
    acc = event_accumulator.EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    loader = [e.step for e in acc.Scalars(tag)]
    (run,) = read_runs(logdir)
    (series,) = [s for s in run.series if s.tag == tag]
    return loader, series.steps


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "loop",
    # The quickstart's loop is the README's with more around it: make test-slow.
    ["readme", pytest.param("quickstart", marks=pytest.mark.slow), "monitored"],
)
def test_each_step_once_after_a_sigkill_and_a_sigterm_restart(tmp_path, loop):
    logdir = str(tmp_path)

    def start(max_steps: int) -> Run:
        return Run([sys.executable, WORKER, logdir, loop, str(max_steps)])

    last, _ = _kill_then_terminate_then_finish(start, logdir, "loss", extra_steps=5)
    tags = ["loss", "hook/loss"] if loop == "monitored" else ["loss"]
    for tag in tags:
        loader, listed = _steps_shown(logdir, tag)
        assert loader == list(range(1, last + 1)), tag
        assert listed == loader, tag
    (run,) = read_runs(logdir)
    assert len(run.restarts) == 2  # Both restarts recorded, at their restored steps.
    assert run.restarts[0][1] > 0  # The first lost logged steps.


@pytest.mark.timeout(600)
def test_the_ddp_example_shows_each_step_once_after_restarts_and_requeues_a_preemption(tmp_path):
    # The requeue recipe of docs/distributed.md too: a batch script runs torchrun
    # (examples/preemptible_torchrun.sh) and a scheduler signals the script alone. torchrun
    # exits 1 even though every worker stopped cleanly with its final checkpoint; the script
    # asks the log directory (torchsupervisor preempted) and exits with the requeue status.
    logdir = str(tmp_path)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHON=sys.executable,
        REQUEUE_STATUS=str(REQUEUE),
    )

    def start(max_steps: int) -> Run:
        cmd = [
            *("bash", repo("examples", "preemptible_torchrun.sh"), logdir, "--standalone"),
            *("--nproc_per_node=2", repo("examples", "ddp_digits.py"), "--logdir", logdir),
            *("--max-steps", str(max_steps), "--save-model-secs", "0.3", "--log-every", "1"),
        ]
        return Run(cmd, env)

    last, (_, preempted, ended) = _kill_then_terminate_then_finish(
        start, logdir, "train/loss", extra_steps=5, batch_shell=True
    )
    loader, listed = _steps_shown(logdir, "train/loss")
    assert loader == list(range(1, last + 1))
    assert listed == loader
    # What the script told its scheduler: the preemption is requeued, the last run ended by
    # itself (a killed session leaves no record: tests/driver/test_stop_record.py).
    assert preempted.proc.returncode == REQUEUE, preempted.stderr[-3000:]
    assert "The last session stopped by SIGTERM at step" in preempted.stdout
    assert "ended cleanly" in ended.stdout
