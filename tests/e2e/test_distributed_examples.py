"""examples/ddp_digits.py and fsdp_digits.py under torchrun (2 CPU processes): train, resume."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from repo_paths import repo

from torchsupervisor import latest_checkpoint
from torchsupervisor.checkpoint.reader import CheckpointReader

ROOT = repo()


def _torchrun(example, logdir, max_steps):
    return subprocess.run(
        [
            sys.executable,
            *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"),
            os.path.join(ROOT, "examples", example),
            *("--logdir", str(logdir), "--max-steps", str(max_steps)),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def _replicated(logdir):
    # The chief alone wrote the final checkpoint: one shard holding the whole state.
    assert latest_checkpoint(str(logdir)) == str(logdir / "model.ckpt-20")
    assert os.path.exists(logdir / "model.ckpt-20.data-00000-of-00001")
    assert CheckpointReader(str(logdir / "model.ckpt-20")).global_step == 20


def _sharded(logdir):
    # Every rank wrote its own shard.
    assert os.path.exists(logdir / "model.ckpt-20.data-00001-of-00002")


@pytest.mark.parametrize(
    "example,check",
    [
        # The DDP example's restarts under torchrun are in the suite through
        # test_summary_steps (killed, stopped, requeued): this one in make test-slow.
        pytest.param("ddp_digits.py", _replicated, marks=pytest.mark.slow),
        ("fsdp_digits.py", _sharded),
    ],
)
def test_the_example_runs_under_torchrun_and_resumes(tmp_path, example, check):
    first = _torchrun(example, tmp_path, 20)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "rank 0: done at step 20" in first.stdout and "rank 1: done at step 20" in first.stdout
    assert "resumed" not in first.stdout
    check(tmp_path)
    second = _torchrun(example, tmp_path, 30)
    assert second.returncode == 0, second.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: resumed at step 20" in second.stdout
        assert f"rank {rank}: done at step 30" in second.stdout
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "model.ckpt-30")
