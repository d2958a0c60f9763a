"""examples/ddp_digits.py and fsdp_digits.py under torchrun (CPU processes): train, resume; a
DDP run resumed as FSDP2 at other world sizes (resharded), down to one rank with its memory
tier."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from repo_paths import repo

from torchsupervisor import latest_checkpoint
from torchsupervisor.checkpoint.reader import CheckpointReader

ROOT = repo()


def _torchrun(example, logdir, max_steps, nproc=2, *extra):
    return subprocess.run(
        [
            sys.executable,
            *("-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"),
            os.path.join(ROOT, "examples", example),
            *("--logdir", str(logdir), "--max-steps", str(max_steps), *extra),
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
        # The FSDP2 example's runs and resumes: tests/e2e/test_sharded_memory_tier.py.
        pytest.param("fsdp_digits.py", _sharded, marks=pytest.mark.slow),
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


# In make test-slow (3 ranks on 2 cores: 40 s): the suite keeps a DDP checkpoint restored into
# FSDP2 in tests/checkpoint/test_row_blocks.py (real process groups) and the FSDP2 example's
# resumes in tests/e2e/test_sharded_memory_tier.py.
@pytest.mark.slow
def test_a_ddp_run_resumes_as_fsdp2_at_3_ranks_then_at_1_with_its_memory_tier(tmp_path):
    """The DDP example's logdir (2 ranks, the chief's checkpoint: the DDP model under its
    module's names, the plain optimizer's state keyed by positions) resumed by the FSDP2
    example at 3 ranks (every rank its rows, the moments as DTensors), saved by 3, resumed by
    1 rank with the memory tier on (a sharded state at world size 1: its own shards in
    memory, its checkpoints written as by any world size)."""
    first = _torchrun("ddp_digits.py", tmp_path, 10)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "rank 1: done at step 10" in first.stdout and "resumed" not in first.stdout
    names = CheckpointReader(str(tmp_path / "model.ckpt-10")).get_variable_to_shape_map()
    assert "model/0.weight" in names  # Not "model/module.0.weight".
    second = _torchrun("fsdp_digits.py", tmp_path, 20, 3)
    assert second.returncode == 0, second.stderr[-3000:]
    for rank in (0, 1, 2):
        assert f"rank {rank}: resumed at step 10" in second.stdout
        assert f"rank {rank}: done at step 20" in second.stdout
    assert CheckpointReader(str(tmp_path / "model.ckpt-20")).manifest.world_size == 3
    assert os.path.exists(tmp_path / "model.ckpt-20.data-00002-of-00003")  # Each rank's.
    third = _torchrun("fsdp_digits.py", tmp_path, 30, 1, "--memory-every-n-steps", "1")
    assert third.returncode == 0, third.stderr[-3000:]
    assert "rank 0: resumed at step 20" in third.stdout
    assert "rank 0: done at step 30" in third.stdout
    assert CheckpointReader(str(tmp_path / "model.ckpt-30")).manifest.world_size == 1
