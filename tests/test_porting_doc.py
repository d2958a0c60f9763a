"""docs/porting.md's supervised loop runs, and a stopped run resumed continues the run exactly:
the restored step, best metric, prefetched batch and random stream, with torch.compile."""

from __future__ import annotations

import os
import re

import torch

import torchsupervisor as ts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _after_block() -> str:
    with open(os.path.join(ROOT, "docs", "porting.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    (block,) = [b for b in blocks if "managed_session" in b]
    return block


def _run(directory, max_iters: int) -> dict:
    code = _after_block()
    assert "10_000, 50, 2" in code and "torch.compile(model)" in code
    code = code.replace("10_000, 50, 2", f"{max_iters}, 3, 2")
    # Inductor needs a C++ compiler; the eager backend compiles the same wrapper.
    code = code.replace("torch.compile(model)", "torch.compile(model, backend='eager')")
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        namespace: dict = {}
        exec(compile(code, "docs/porting.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    return namespace


def test_the_ported_loop_resumes_exactly_where_it_stopped(tmp_path):
    torch.manual_seed(0)
    (tmp_path / "straight").mkdir()
    straight = _run(tmp_path / "straight", 10)
    torch.manual_seed(0)
    (tmp_path / "stopped").mkdir()
    first = _run(tmp_path / "stopped", 6)
    assert first["step"].value == 6
    torch.manual_seed(123)  # A new process: another random state until the restore.
    resumed = _run(tmp_path / "stopped", 10)
    assert resumed["step"].value == straight["step"].value == 10
    assert resumed["state"]["best_val_loss"] == straight["state"]["best_val_loss"] < 1e9
    for name, value in straight["model"].state_dict().items():
        assert torch.equal(resumed["model"].state_dict()[name], value), name
    # The checkpoint of the best validation loss is kept beside the newest.
    logdir = tmp_path / "stopped" / "runs" / "gpt"
    kept = [
        ts.CheckpointReader(p).manifest
        for p in ts.get_checkpoint_state(str(logdir)).all_model_checkpoint_paths
    ]
    losses = [m.metrics["val_loss"] for m in kept if m.metrics]
    assert min(losses) == resumed["state"]["best_val_loss"]
