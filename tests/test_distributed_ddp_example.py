"""examples/ddp_digits.py under torchrun (2 CPU processes): trains, stops, resumes."""

from __future__ import annotations

import os
import subprocess
import sys

from torchsupervisor import latest_checkpoint
from torchsupervisor.checkpoint.reader import CheckpointReader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ddp_digits.py")


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


def test_the_ddp_example_runs_under_torchrun_and_resumes(tmp_path):
    first = _torchrun(tmp_path, 20)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "rank 0: done at step 20" in first.stdout and "rank 1: done at step 20" in first.stdout
    assert "resumed" not in first.stdout
    # The chief alone wrote the final checkpoint: one shard holding the whole state.
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "model.ckpt-20")
    assert os.path.exists(tmp_path / "model.ckpt-20.data-00000-of-00001")
    assert CheckpointReader(str(tmp_path / "model.ckpt-20")).global_step == 20
    second = _torchrun(tmp_path, 30)
    assert second.returncode == 0, second.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: resumed at step 20" in second.stdout
        assert f"rank {rank}: done at step 30" in second.stdout
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "model.ckpt-30")
