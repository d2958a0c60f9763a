"""One rank of a ``torch.distributed.checkpoint`` save of an FSDP2 model and its Adam state.

Usage: python dcp_save_worker.py OUT_DIR; the process group comes from the environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The layers' first dimensions (5, 3, 7) do not
divide by 2: the ranks' chunks are uneven. Every rank prints ``SAVED <rank>`` at the end.
"""

from __future__ import annotations

import faulthandler
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    out = sys.argv[1]
    faulthandler.dump_traceback_later(120, exit=True)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3), nn.Linear(3, 7))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(6, 4)).sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "epoch": 2}, checkpoint_id=out)
    print(f"SAVED {dist.get_rank()}", flush=True)
    # Both ranks done with the group before either tears it down: without it, a rank exiting
    # while the other still used the group aborted at exit, 1 run in 20 ("terminate called
    # without an active exception", a torch thread destroyed unjoined).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
