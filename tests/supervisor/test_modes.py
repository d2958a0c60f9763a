"""How the Supervisor's modes start: a sharded non-chief does not sleep for nothing."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from torchsupervisor import GlobalStep, Supervisor
from torchsupervisor.supervisor.modes import OPEN_POLL_SECS
from torchsupervisor.testing import FakeClock, run_world


class _SignallingClock(FakeClock):
    """A fake clock that tells the other ranks (through the store) once this rank waits."""

    def sleep(self, secs: float) -> None:
        dist.distributed_c10d._get_default_store().set("test/rank1-waits", "1")
        super().sleep(secs)


def sharded_start_rank(rank: int, world_size: int, logdir: str) -> list[float]:
    """Rank 1 starts first and must wait for rank 0; return rank 1's sleeps (seconds)."""
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    clock = _SignallingClock() if rank == 1 else FakeClock()
    if rank == 0:  # Only once rank 1 is surely waiting for the chief.
        dist.distributed_c10d._get_default_store().wait(["test/rank1-waits"])
    sv = Supervisor(
        logdir=logdir,
        state={"model": model, "global_step": GlobalStep()},
        recovery_wait_secs=30,  # TF's default.
        save_model_secs=0,
        save_summaries_secs=0,
        clock=clock,
    )
    with sv.managed_session() as sess:
        assert sess.restored_checkpoint is None
    return clock.sleeps


def test_a_sharded_non_chief_that_starts_first_looks_often_for_the_chief(tmp_path):
    _, sleeps = run_world(sharded_start_rank, str(tmp_path))
    # It waited (the chief had not started), in short looks: not TF's 30 s recovery wait,
    # which is for a model another process initializes, not for the chief's quick clean-up.
    assert sleeps and max(sleeps) <= OPEN_POLL_SECS
