"""``InputPipelineState`` is per rank: with replicas (DDP or FSDP2) every rank reads its own
batches, before and after a restart; the chief's position is the checkpoint's."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import torchsupervisor as ts
from torchsupervisor.testing import run_world

STEPS = 4


def pipeline_rank(rank: int, world_size: int, logdir: str, sharded: bool) -> list[list[int]]:
    """Train ``STEPS`` steps on a pipeline of this rank's own (seeded by the rank)."""
    ids = torch.arange(rank * 1000, rank * 1000 + 64)
    (example,) = ts.slice_input_producer([ids], shuffle=True, seed=7 + rank)
    batch = ts.batch([example], batch_size=4, capacity=16)
    model = torch.nn.Linear(1, 1)
    if sharded:
        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    else:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = ts.GlobalStep()
    step.bind(optimizer)
    state = {"model": model, "optimizer": optimizer, "global_step": step}
    state["input"] = ts.InputPipelineState()
    sv = ts.Supervisor(
        logdir=logdir,
        state=state,
        save_model_secs=3600,
        save_summaries_secs=0,
        recovery_wait_secs=0.1,
    )
    seen = []
    with sv.managed_session() as sess:
        for _ in range(STEPS):
            (ids_batch,) = sess.run([batch])
            optimizer.zero_grad()
            model(ids_batch.float().view(-1, 1) / 1000).sum().backward()
            optimizer.step()
            seen.append(ids_batch.tolist())
    return seen


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp2"])
def test_every_rank_reads_its_own_batches_before_and_after_a_restart(tmp_path, sharded):
    first0, first1 = run_world(pipeline_rank, str(tmp_path), sharded)
    # Each rank's examples: the chief's pipeline was not broadcast over rank 1's.
    assert all(i < 1000 for b in first0 for i in b), first0
    assert all(1000 <= i < 2000 for b in first1 for i in b), first1
    second0, second1 = run_world(pipeline_rank, str(tmp_path), sharded)
    assert ts.latest_checkpoint(str(tmp_path)).endswith(f"-{2 * STEPS}")
    # The chief continues its own pipeline from the checkpoint: the next examples of its
    # epoch, none seen before ...
    assert all(i < 1000 for b in second0 for i in b)
    assert not {i for b in second0 for i in b} & {i for b in first0 for i in b}
    # ... and rank 1 reads its own again, from where its construction put it (the
    # checkpoint holds the chief's position, not rank 1's).
    assert second1 == first1
