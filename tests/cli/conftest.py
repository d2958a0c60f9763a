"""Real log directories for the CLI tests, written by the library's own Saver and Supervisor."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch

from torchsupervisor import GlobalStep, Saver
from torchsupervisor.cli import main

HOUR = 3600.0


@dataclass
class Run:
    """A log directory with checkpoints saved by a ``Saver`` (max_to_keep=2, keep every hour)."""

    logdir: str
    model: torch.nn.Module
    step: GlobalStep
    saver: Saver
    weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def prefix(self, step: int) -> str:
        return os.path.join(self.logdir, f"model.ckpt-{step}")

    def save(self, step: int, write_state: bool = True) -> str:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1.0)
        self.step.assign(step)
        self.weights[step] = {k: v.clone() for k, v in self.model.state_dict().items()}
        return self.saver.save(
            None, os.path.join(self.logdir, "model.ckpt"), global_step=step, write_state=write_state
        )


@pytest.fixture
def saver_run(tmp_path, fake_clock) -> Run:
    """Checkpoints at steps 1..5, saved 0.6 h apart: steps 4 and 5 are tracked by max_to_keep,
    step 2 is preserved by keep_checkpoint_every_n_hours=1, steps 1 and 3 were deleted."""
    logdir = str(tmp_path / "run")
    os.makedirs(logdir)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    step = GlobalStep()
    saver = Saver(
        {"model": model, "global_step": step, "config": {"lr": 0.5, "name": "demo"}},
        max_to_keep=2,
        keep_checkpoint_every_n_hours=1.0,
        clock=fake_clock,
    )
    run = Run(logdir, model, step, saver)
    for s in range(1, 6):
        fake_clock.advance(0.6 * HOUR)
        run.save(s)
    assert sorted(n for n in os.listdir(logdir) if n.endswith(".index")) == [
        "model.ckpt-2.index",
        "model.ckpt-4.index",
        "model.ckpt-5.index",
    ]
    return run


def flip_byte(path: str, offset: int = -1) -> None:
    """Invert one byte of ``path`` (a bit rot)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[offset] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)


def data_file(prefix: str) -> str:
    return prefix + ".data-00000-of-00001"


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``torchsupervisor ARGV`` in-process; return (exit status, stdout, stderr)."""
    status = main(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err
