"""After a SIGKILL and a resume, TensorBoard shows one continuous series per tag.

A supervised run writes summaries past its last checkpoint and is killed (SIGKILL, no final
checkpoint, no STOP). The resumed run restores the checkpoint and writes those steps again,
the restored step included (its series are labelled with the step before each training step:
the resumed run's points at the restored step replace the killed run's). TensorBoard must
show each step once, with the resumed run's values from the checkpoint on: checked with
TensorBoard's ``EventAccumulator`` and with a real ``tensorboard`` server queried over its
HTTP data API.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error

import pytest
from repo_paths import worker
from tensorboard.backend.event_processing import event_accumulator
from tensorboard_server import get_json, serve

from torchsupervisor import CheckpointReader, summary_iterator

WORKER = worker("restart_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKPOINT_STEP, KILLED_AT, LAST_STEP = 20, 30, 40


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _worker(logdir: str, run_id: int, checkpoint_step: int, last_step: int, *extra: str):
    cmd = [sys.executable, WORKER, logdir, str(run_id), str(checkpoint_step), str(last_step)]
    return [*cmd, *extra]


def _expected(tag_steps: list[int]) -> list[tuple[int, float]]:
    """Run 1's values before the checkpoint, run 2's from the checkpoint on."""
    return [(s, float((1 if s < CHECKPOINT_STEP else 2) * 1000 + s)) for s in tag_steps]


LOSS_STEPS = list(range(LAST_STEP))
EVAL_STEPS = list(range(0, LAST_STEP + 1, 5))


@pytest.fixture(scope="module")
def resumed_logdir(tmp_path_factory) -> str:
    logdir = str(tmp_path_factory.mktemp("restart") / "run")
    killed = subprocess.Popen(
        _worker(logdir, 1, CHECKPOINT_STEP, KILLED_AT, "--hang"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        assert killed.stdout.readline().strip() == "START 0"
        assert killed.stdout.readline().strip() == "READY"
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    steps = sorted(
        CheckpointReader(os.path.join(logdir, n[: -len(".index")])).global_step
        for n in os.listdir(logdir)
        if n.endswith(".index")
    )
    assert steps == [0, CHECKPOINT_STEP]  # nothing was saved past the checkpoint
    (crashed,) = [n for n in os.listdir(logdir) if "tfevents" in n]
    stale = [
        e.step
        for e in summary_iterator(os.path.join(logdir, crashed))
        for v in e.summary.value
        if v.tag == "loss" and e.step >= CHECKPOINT_STEP
    ]
    assert stale == list(range(CHECKPOINT_STEP, KILLED_AT))  # summaries past the checkpoint

    resumed = subprocess.run(
        _worker(logdir, 2, -1, LAST_STEP),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines()[0] == f"START {CHECKPOINT_STEP}"
    assert len([n for n in os.listdir(logdir) if "tfevents" in n]) == 2
    return logdir


def test_event_accumulator_shows_one_continuous_series(resumed_logdir):
    acc = event_accumulator.EventAccumulator(resumed_logdir, size_guidance={"scalars": 0})
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert loss == _expected(LOSS_STEPS)
    evals = [(e.step, e.value) for e in acc.Scalars("eval")]
    assert evals == _expected(EVAL_STEPS)


def test_tensorboard_server_shows_one_continuous_series(resumed_logdir, tmp_path):
    with serve(resumed_logdir, str(tmp_path), env=_env()) as server:
        deadline = time.monotonic() + 540  # A busy machine starts TensorBoard slowly.
        loss = evals = None
        while time.monotonic() < deadline:
            assert server.process.poll() is None, server.log()
            try:
                if "." in get_json(f"{server.base}/data/runs"):
                    loss, evals = server.scalars("loss"), server.scalars("eval")
                    if len(loss) >= len(LOSS_STEPS) and len(evals) >= len(EVAL_STEPS):
                        break
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass  # not listening, or not loaded yet
            time.sleep(0.5)
        assert loss == _expected(LOSS_STEPS)
        assert evals == _expected(EVAL_STEPS)
        steps = [step for step, _ in loss]
        assert len(steps) == len(set(steps))  # no duplicate step
