"""The example: kill -9 mid-run, resume, and the learning rate continues from the restored step."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import torchsupervisor as ts

pytest.importorskip("sklearn")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "digits_decay_ema.py")
LR, END, DECAY_STEPS, POWER = 0.1, 0.001, 400, 2.0
ARGS = [
    "--learning-rate",
    str(LR),
    "--end-learning-rate",
    str(END),
    "--decay-steps",
    str(DECAY_STEPS),
    "--power",
    str(POWER),
    "--log-every",
    "1",
]
STEP_LINE = re.compile(r"^step (\d+) lr (\S+) loss \S+$")


def _expected_lr(step: int) -> float:
    # TF's polynomial_decay formula, by hand.
    s = min(step, DECAY_STEPS)
    return (LR - END) * (1 - s / DECAY_STEPS) ** POWER + END


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _checkpoint_step(logdir: str) -> int | None:
    path = ts.latest_checkpoint(logdir)
    return None if path is None else int(path.rsplit("-", 1)[1])


def _steps(lines: list[str]) -> list[tuple[int, float]]:
    return [(int(m[1]), float(m[2])) for m in map(STEP_LINE.match, lines) if m]


def _run_until_a_checkpoint_then_kill(logdir: str, stderr) -> list[str]:
    """Start the example, SIGKILL it once a checkpoint at step >= 20 exists; return its output."""
    first = subprocess.Popen(
        [
            *(sys.executable, EXAMPLE, "--logdir", logdir, "--max-steps", "100000", *ARGS),
            *("--step-delay-secs", "0.01", "--save-model-secs", "0.5"),
        ],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = first.stdout.readline()
            if not line:
                stderr.seek(0)
                pytest.fail(f"the example ended early:\n{lines}\n{stderr.read()}")
            lines.append(line.strip())
            saved = _checkpoint_step(logdir)
            if saved is not None and saved >= 20:
                break
            assert len(lines) < 350, "no checkpoint after many steps"
        else:
            pytest.fail("no checkpoint at step >= 20 in time")
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        first.wait(30)
    assert first.returncode == -signal.SIGKILL
    # Steps that ran between the last line read and the kill (a checkpoint may be that late).
    lines += first.stdout.read().splitlines()
    first.stdout.close()
    return lines


def test_kill_and_resume_continues_the_learning_rate_from_the_restored_step(tmp_path):
    logdir = str(tmp_path / "run")
    with open(tmp_path / "first.stderr", "w+") as stderr:
        lines = _run_until_a_checkpoint_then_kill(logdir, stderr)
    ran = _steps(lines)
    assert ran[0][0] == 0
    for step, lr in ran:  # The rate followed the schedule from the start...
        assert lr == pytest.approx(_expected_lr(step), rel=1e-12)
    restored = _checkpoint_step(logdir)  # ...and this is where the restart must continue.
    assert 20 <= restored <= ran[-1][0] + 1

    second = subprocess.run(
        [sys.executable, EXAMPLE, "--logdir", logdir, "--max-steps", str(restored + 30), *ARGS],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert second.returncode == 0, second.stderr
    out = second.stdout.splitlines()
    assert out[0].startswith(f"Resumed at step {restored} from "), out[0]
    resumed = _steps(out)
    assert [s for s, _ in resumed] == list(range(restored, restored + 30))
    for step, lr in resumed:
        assert lr == pytest.approx(_expected_lr(step), rel=1e-12)
    assert resumed[0][1] < LR  # Not the start of the schedule.

    # Evaluation with the moving averages of the final checkpoint.
    assert re.match(
        rf"^Held-out accuracy at step {restored + 30}: last weights \d+\.\d\d%, "
        r"moving averages \d+\.\d\d% \(from .*model\.ckpt-" + str(restored + 30) + r"\)$",
        out[-1],
    ), out[-1]
    final = ts.latest_checkpoint(logdir)
    names = {name for name, _ in ts.list_variables(final)}
    weights = [n for n in names if n.startswith("model/")]
    assert weights and all(n.replace("model/", "ema/", 1) in names for n in weights)
    assert not torch.equal(
        ts.load_variable(final, "ema/0.weight"), ts.load_variable(final, "model/0.weight")
    )
