"""Poisoned memory snapshots are detected every time and the restart falls back to the disk:
random bit flips and truncations of any file, a slot of an older generation, another rank's
snapshot and another run's in its place (``make test-slow`` runs 200 trials; the suite a few).
"""

from __future__ import annotations

import logging
import os
import random
import shutil

import pytest
import torch

import torchsupervisor as ts
from torchsupervisor.checkpoint.run_id import read_run_id
from torchsupervisor.core.session import Session
from torchsupervisor.tiers.memory import MemoryTier

from .test_memory import Run, rank_dir

KINDS = ["bit flip", "truncation", "older generation", "another rank", "another run"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A run that failed at step 7 (memory: 6 and 7, slots=3) after a checkpoint at step 3,
    and the weights of step 3; copied afresh for each trial."""
    tmp = tmp_path_factory.mktemp("pristine")
    logdir, base = str(tmp / "logdir"), str(tmp / "shm")
    os.mkdir(base)
    config = ts.MemoryTierConfig(slots=3, root=base)
    run = Run(logdir, base, memory_tier=config)
    run.train(3, fail=True, checkpoint_at=3)
    at_3 = run.model.weight.detach().clone()
    Run(logdir, base, memory_tier=config).train(4, fail=True)
    return tmp, at_3


def _poison(kind: str, directory: str, logdir: str, base: str, rng: random.Random) -> str:
    """Poison the snapshot of step 7 (the newest) in ``directory``; return what was done."""
    seven = os.path.join(directory, "model.ckpt-7")
    files = [seven + ".index", seven + ".data-00000-of-00001"]
    if kind == "bit flip":
        path = rng.choice(files)
        offset = rng.randrange(os.path.getsize(path))
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
        return f"bit flip at {offset} of {path}"
    if kind == "truncation":
        path = rng.choice(files)
        size = rng.randrange(os.path.getsize(path))
        os.truncate(path, size)
        return f"{path} truncated to {size}"
    if kind == "older generation":
        source = os.path.join(directory, "model.ckpt-6")
    else:  # The same step, written by rank 1 of this run, or by rank 0 of another run.
        config = ts.MemoryTierConfig(root=base)
        if kind == "another rank":
            other = MemoryTier(config, logdir, read_run_id(logdir) or "", rank=1)
        else:
            other = MemoryTier(config, logdir + "-other", "1" * 32, rank=0)
        step = ts.GlobalStep(7)
        model = torch.nn.Linear(8, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = {"model": model, "optimizer": optimizer, "global_step": step}
        source = other.saver.save(Session(state), other.save_path, global_step=step)
        other.close()
    for suffix in (".index", ".data-00000-of-00001"):
        shutil.copy(source + suffix, seven + suffix)
    return f"{kind} from {source}"


def _trial(pristine, tmp, kind: str, rng: random.Random, caplog) -> None:
    source, at_3 = pristine
    shutil.copytree(source, tmp, symlinks=True)
    logdir, base = str(tmp / "logdir"), str(tmp / "shm")
    # The memory tier's directory is named after the log directory's path: move it along.
    moved = os.path.dirname(rank_dir(str(source / "logdir"), base))
    os.rename(moved, os.path.dirname(rank_dir(logdir, base)))
    what = _poison(kind, rank_dir(logdir, base), logdir, base, rng)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        out = Run(logdir, base, memory_tier=ts.MemoryTierConfig(slots=2, root=base)).train(
            0, fail=True
        )
    # Never the poisoned snapshot: the memory tier's step 6 when it is intact (the older
    # generation's step 6 *is* intact), else the disk's step 3; each with a warning.
    assert out["restored"] in (6, 3), what
    assert "model.ckpt-7" in caplog.text and "memory tier" in caplog.text, what
    if out["restored"] == 3:
        assert out["tier"] == "disk" and torch.equal(out["weight"], at_3), what


@pytest.mark.parametrize("kind", KINDS)
def test_a_poisoned_snapshot_is_detected_and_skipped(pristine, tmp_path, kind, caplog):
    _trial(pristine, tmp_path / "trial", kind, random.Random(kind), caplog)


def test_25_poisoned_snapshots_at_random(pristine, tmp_path, caplog):
    rng = random.Random(25)
    for trial in range(25):
        _trial(pristine, tmp_path / str(trial), rng.choice(KINDS), rng, caplog)


@pytest.mark.slow
def test_200_poisoned_snapshots(pristine, tmp_path, caplog):
    rng = random.Random(200)
    for trial in range(200):
        _trial(pristine, tmp_path / str(trial), rng.choice(KINDS), rng, caplog)
