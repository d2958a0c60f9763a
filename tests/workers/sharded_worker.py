"""One rank of a sharded-checkpoint test: an FSDP2 model and its Adam state on CPU with gloo.

Usage: python sharded_worker.py SCENARIO DIR RANK WORLD_SIZE [ARG]

The ranks meet through the file store ``DIR/store-<SCENARIO>-<WORLD_SIZE>``. Scenarios:

* ``save``: train 3 steps, ``save_sharded`` as ``DIR/model.ckpt-3`` (the file system prints
  ``CREATED <name>`` for every file this rank creates), then rank 0 writes the full value of
  every tensor of the state to ``DIR/reference.safetensors``. Prints ``SAVED <is_sharded>``.
* ``load``: build the model with other values, ``load_sharded`` ``DIR/model.ckpt-3``, compare
  every full tensor with the reference, train one more step. Prints ``MATCH <n> <step>``.
* ``load-error``: ``load_sharded`` and print ``ERROR <type> <path> <own|copy>`` for the error
  raised (``copy``: another rank's error, sent to this one).
* ``save-fail``: the file system of rank ``ARG`` fails its first shard write with ENOSPC;
  print ``ERROR <type> <message>`` for the error raised by ``save_sharded``.
* ``index-fail``: the coordinator fails to write ``P.index``; print as ``save-fail``.
"""

from __future__ import annotations

import datetime
import errno
import faulthandler
import os
import sys

import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from worker_exit import run_and_exit

from torchsupervisor.checkpoint.sharded.collective import load_sharded, save_sharded
from torchsupervisor.checkpoint.sharded.plan import (
    ShardedOptimizerState,
    flatten_sharded_state,
    is_sharded,
)
from torchsupervisor.testing import FaultyStorage


def recording_storage(fail: str | None = None) -> FaultyStorage:
    """Prints the files this rank creates; optionally fails its shard or index write."""
    storage = FaultyStorage()
    storage.fail("open", times=None, errno=None, before=created)
    if fail == "index":
        storage.fail("open", path_contains=".index.tmp", errno=errno.EIO)
    if fail == "shard":
        storage.fail("write", errno=errno.ENOSPC)
    return storage


def created(path: str) -> None:
    print("CREATED", os.path.basename(path), flush=True)


def build(seed: int, world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3), torch.nn.Tanh()
    )
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 if seed == 0 else 0.5)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 6, generator=generator)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def make_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {
        "model": model,
        "optimizer": ShardedOptimizerState(model, optimizer),
        "global_step": step,
        "extra": {"tag": "run-a" if step else "", "blob": b"\x00\xff" if step else b""},
    }


def full_tensors(state: dict) -> dict[str, torch.Tensor]:
    _, tensors = flatten_sharded_state(state)
    out = {}
    for name in sorted(tensors):  # The same order on every rank: full_tensor is a collective.
        tensor = tensors[name]
        out[name] = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return {name: t.contiguous().clone() for name, t in out.items()}


def main() -> int:
    scenario, directory, rank, world_size = sys.argv[1:5]
    arg = sys.argv[5] if len(sys.argv) > 5 else None
    rank, world_size = int(rank), int(world_size)
    faulthandler.dump_traceback_later(240, exit=True)  # Never outlive a broken test.
    store = os.path.join(directory, f"store-{scenario}-{world_size}")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=90),
    )
    print("READY", flush=True)
    prefix = os.path.join(directory, "model.ckpt-3")
    try:
        if scenario == "save":
            model, optimizer = build(0, world_size)
            for step in range(3):
                train_step(model, optimizer, step)
            state = make_state(model, optimizer, 3)
            save_sharded(state, prefix, global_step=3, storage=recording_storage())
            reference = full_tensors(state)
            if rank == 0:
                path = os.path.join(directory, "reference.safetensors")
                safetensors.torch.save_file(reference, path)
            print("SAVED", is_sharded(state), flush=True)
        elif scenario == "load":
            model, optimizer = build(1, world_size)
            state = make_state(model, optimizer, 0)
            manifest = load_sharded(state, prefix)
            restored = full_tensors(state)
            reference = safetensors.torch.load_file(
                os.path.join(directory, "reference.safetensors")
            )
            assert sorted(restored) == sorted(reference), (sorted(restored), sorted(reference))
            for name, tensor in reference.items():
                assert torch.equal(restored[name], tensor), name
            assert state["global_step"] == 3 and state["extra"]["tag"] == "run-a"
            assert state["extra"]["blob"] == b"\x00\xff"
            assert optimizer.param_groups[0]["lr"] == 0.01
            train_step(model, optimizer, 3)
            print("MATCH", len(reference), manifest.global_step, flush=True)
        elif scenario == "load-error":
            model, optimizer = build(1, world_size)
            try:
                load_sharded(make_state(model, optimizer, 0), prefix)
            except Exception as e:
                origin = "copy" if getattr(e, "__notes__", None) else "own"
                print("ERROR", type(e).__name__, getattr(e, "path", None), origin, flush=True)
            else:
                print("NOERROR", flush=True)
        elif scenario in ("save-fail", "index-fail"):
            model, optimizer = build(0, world_size)
            train_step(model, optimizer, 0)
            fail = None
            if scenario == "save-fail" and rank == int(arg):
                fail = "shard"
            if scenario == "index-fail" and rank == 0:
                fail = "index"
            try:
                save_sharded(
                    make_state(model, optimizer, 3), prefix, storage=recording_storage(fail)
                )
            except Exception as e:
                print("ERROR", type(e).__name__, str(e).replace("\n", " "), flush=True)
            else:
                print("NOERROR", flush=True)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_and_exit(main)
