"""The writer thread frees a job's tensors before it reports the job done, so that a program
that waits for its last asynchronous save and returns exits cleanly (engine.py, "at exit")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from torchsupervisor.checkpoint.engine import CheckpointEngine


def _job(tensor: torch.Tensor, fail: bool) -> int:
    held = tensor  # A local of the job's frame: an error's traceback would keep it alive.
    if fail:
        raise ValueError("the job failed")
    return int(held.numel())


@pytest.mark.parametrize("fail", [False, True], ids=["done", "failed"])
def test_a_jobs_tensors_are_freed_before_it_is_reported_done(fail):
    engine = CheckpointEngine()
    tensor = torch.zeros(3)
    alive = weakref.ref(tensor)
    future = engine.submit(_job, tensor, fail)
    del tensor
    if fail:
        error = future.exception(timeout=60)
        assert isinstance(error, ValueError) and error.__traceback__ is not None
    else:
        assert future.result(timeout=60) == 3
    # No wait: the writer thread must not be the one to free it later.
    assert alive() is None
    engine.close()


_SCRIPT = """
import sys, torch
from torch import nn
from torchsupervisor import Saver, Session

model = nn.Linear(64, 64)
optimizer = torch.optim.Adam(model.parameters())
model(torch.randn(2, 64)).sum().backward()
optimizer.step()
saver = Saver(max_to_keep=1)
saver.save_async(Session({"model": model, "optimizer": optimizer}), sys.argv[1],
                 global_step=1).result()
"""


def test_a_program_that_waits_for_its_last_async_save_exits_cleanly(tmp_path):
    # Before the fix 4 runs in 6 aborted at exit (status 134, "terminate called without an
    # active exception"): the writer freed the snapshot after the program had returned.
    for run in range(3):
        (tmp_path / f"run{run}").mkdir()
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_SCRIPT), str(tmp_path / f"run{run}" / "m")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "terminate called" not in proc.stderr
