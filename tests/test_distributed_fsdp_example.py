"""examples/fsdp_digits.py under torchrun (2 CPU processes): trains, stops, resumes."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "fsdp_digits.py")


def _torchrun(logdir, max_steps):
    return subprocess.run(
        [
            sys.executable,
            *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"),
            *(EXAMPLE, "--logdir", str(logdir), "--max-steps", str(max_steps)),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def test_the_fsdp_example_runs_under_torchrun_and_resumes(tmp_path):
    first = _torchrun(tmp_path, 20)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "rank 0: done at step 20" in first.stdout and "rank 1: done at step 20" in first.stdout
    assert "resumed" not in first.stdout
    assert os.path.exists(tmp_path / "model.ckpt-20.data-00001-of-00002")
    second = _torchrun(tmp_path, 30)
    assert second.returncode == 0, second.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: resumed at step 20" in second.stdout
        assert f"rank {rank}: done at step 30" in second.stdout
    assert os.path.exists(tmp_path / "model.ckpt-30.index")
