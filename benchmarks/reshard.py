"""Resharding benchmark: a checkpoint of 2 ranks (FSDP2, or DDP) restored into an FSDP2 model
at another world size, ours against ``torch.distributed.checkpoint`` in the same run.

    python benchmarks/reshard.py                        # 8 layers of 1024 x 1024, Adam
    python benchmarks/reshard.py --layers 2 --width 256 --sources ddp

An MLP of ``--layers`` square layers of ``--width`` (float32, one process a rank on a CPU gloo
group), one Adam step taken (its moments in the state), is saved by 2 ranks twice, for each of
``--sources``: ``fsdp2`` (``fully_shard``; ours ``save_sharded``, every rank its shard) or
``ddp`` (``DistributedDataParallel``; ours ``Saver`` on the chief, the plain optimizer's state
keyed by positions), and ``dcp.save`` of ``get_state_dict`` (DCP's ``FileSystemWriter``;
DDP's replicated tensors spread between the ranks by its planner). Both keep blocks of rows
checksummed (``row_blocks.py``). Each is then restored into an FSDP2 model at
``--world-sizes`` (default 1, 3, 4), by fresh ranks: ``Saver.restore`` (``load_sharded``:
every byte read checked) and ``dcp.load`` + ``set_state_dict`` (no checksum). For each rank:
the bytes it read (``rchar`` of ``/proc/self/io``: every byte its reads returned, the page
cache's included: data, manifest or metadata, everything) over the bytes of the state it ends
up holding (the target: at most 1.1), and the seconds of the restore. Each rank restores
twice and the second is measured (the first imports the modules a load needs); the
checkpoints are in the page cache (read once before).

It prints a table and writes JSON (``--json``, default ``benchmarks/results/reshard.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from checkpoint import warm_page_cache  # noqa: E402 (benchmarks/checkpoint.py, this folder)

PREFIX = "model.ckpt-1"


def _read_chars() -> int:
    """Bytes this process's reads returned so far (``rchar``)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def _build(world_size: int, layers: int, width: int, seed: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _held(model: Any, optimizer: Any) -> int:
    from torch.distributed.tensor import DTensor

    tensors = [*model.parameters()]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(
        (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors
    )


def _build_ddp(layers: int, width: int, seed: int) -> tuple[Any, Any, Any]:
    """A DDP model (the module, its wrapper) and its optimizer, one step taken."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ddp(torch.randn(4, width)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, ddp, optimizer


def save_rank(
    rank: int, world_size: int, directory: str, layers: int, width: int, source: str
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from torchsupervisor import Saver
    from torchsupervisor.checkpoint.sharded.collective import save_sharded
    from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState

    if source == "ddp":
        model, wrapped, optimizer = _build_ddp(layers, width, 0)
        if rank == 0:  # The chief saves the replicated state (ReplicatedMode).
            Saver({"model": model, "optimizer": optimizer}).save(
                None, os.path.join(directory, "ours", PREFIX.split("-")[0]), global_step=1
            )
    else:
        model, optimizer = _build(world_size, layers, width, 0)
        state = {"model": model, "optimizer": ShardedOptimizerState(model, optimizer)}
        save_sharded(state, os.path.join(directory, "ours", PREFIX), global_step=1)
        wrapped = model
    model_sd, optim_sd = get_state_dict(wrapped, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(directory, "dcp"))


def load_rank(
    rank: int, world_size: int, directory: str, layers: int, width: int, which: str
) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from torchsupervisor import Saver
    from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState

    model, optimizer = _build(world_size, layers, width, 1)

    def load() -> None:
        if which == "ours":
            state = {"model": model, "optimizer": ShardedOptimizerState(model, optimizer)}
            Saver(state).restore(None, os.path.join(directory, "ours", PREFIX))
            return
        model_sd, optim_sd = get_state_dict(model, optimizer)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=os.path.join(directory, "dcp"))
        set_state_dict(
            model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
        )

    load()  # Once before: the modules a first load imports are not counted.
    torch.distributed.barrier()
    before, t0 = _read_chars(), time.perf_counter()
    load()
    secs = time.perf_counter() - t0
    read = _read_chars() - before
    return {"read_bytes": read, "held_bytes": _held(model, optimizer), "secs": secs}


def _measure(source: str, layers: int, width: int, world_sizes: Any) -> list[dict[str, Any]]:
    """Save with 2 ranks of ``source``, restore at each world size: a row each."""
    from torchsupervisor.testing import run_world

    directory = tempfile.mkdtemp(prefix="reshard-bench-")
    os.mkdir(os.path.join(directory, "ours"))
    rows = []
    try:
        run_world(save_rank, directory, layers, width, source, world_size=2, timeout_secs=900)
        warm_page_cache(directory)
        for world_size in world_sizes:
            row: dict[str, Any] = {"source": source, "world_size": world_size}
            for which in ("ours", "dcp"):
                ranks = run_world(
                    load_rank,
                    directory,
                    layers,
                    width,
                    which,
                    world_size=world_size,
                    timeout_secs=900,
                )
                row[which] = {
                    "ranks": ranks,
                    "max_read_over_held": max(r["read_bytes"] / r["held_bytes"] for r in ranks),
                    "secs": max(r["secs"] for r in ranks),
                }
            rows.append(row)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--world-sizes", default="1,3,4")
    parser.add_argument("--sources", default="fsdp2,ddp", help="fsdp2, ddp or both")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "reshard.json"))
    args = parser.parse_args(argv)

    rows = []
    for source in args.sources.split(","):
        rows += _measure(source, args.layers, args.width, map(int, args.world_sizes.split(",")))
    state_mb = 3 * args.layers * (args.width * args.width + args.width) * 4 / 1e6
    print(f"MLP, {args.layers} x {args.width}^2 + Adam: {state_mb:.0f} MB, saved by 2 ranks")
    print(
        f"{'saved by':>8} {'ranks':>5} {'ours read/held':>15} {'dcp read/held':>14} "
        f"{'ours':>8} {'dcp.load':>9}"
    )
    for r in rows:
        print(
            f"{r['source']:>8} {r['world_size']:>5} {r['ours']['max_read_over_held']:>15.3f} "
            f"{r['dcp']['max_read_over_held']:>14.3f} {r['ours']['secs']:>7.3f}s "
            f"{r['dcp']['secs']:>8.3f}s"
        )
    print("(restored into FSDP2; read/held: the most of any rank; target for ours: at most 1.1)")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"state_mb": state_mb, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
