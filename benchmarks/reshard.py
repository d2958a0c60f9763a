"""Resharding benchmark: a sharded (FSDP2) checkpoint of 2 ranks restored at another world
size, ours against ``torch.distributed.checkpoint`` in the same run.

    python benchmarks/reshard.py                        # 8 layers of 1024 x 1024, Adam
    python benchmarks/reshard.py --layers 2 --width 256

An MLP of ``--layers`` square layers of ``--width`` (float32, FSDP2 ``fully_shard`` on a CPU
gloo group, one process a rank), one Adam step taken (its moments in the state), is saved by
2 ranks twice: with ``save_sharded`` (ours, blocks of rows checksummed: ``row_blocks.py``) and
with ``dcp.save`` of ``get_state_dict`` (DCP's ``FileSystemWriter``). Each is then restored at
``--world-sizes`` (default 1, 3, 4), by fresh ranks: ``load_sharded`` (every byte read
checked) and ``dcp.load`` + ``set_state_dict`` (no checksum). For each rank: the bytes it read
(``rchar`` of ``/proc/self/io``: every byte its reads returned, the page cache's included:
data, manifest or metadata, everything) over the bytes of the state it ends up holding (the
target: at most 1.1), and the seconds of the restore. Each rank restores twice and the second
is measured (the first imports the modules a load needs); the checkpoints are in the page
cache (read once before).

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


def save_rank(rank: int, world_size: int, directory: str, layers: int, width: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from torchsupervisor.checkpoint.sharded.collective import save_sharded
    from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState

    model, optimizer = _build(world_size, layers, width, 0)
    state = {"model": model, "optimizer": ShardedOptimizerState(model, optimizer)}
    save_sharded(state, os.path.join(directory, "ours", PREFIX), global_step=1)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(directory, "dcp"))


def load_rank(
    rank: int, world_size: int, directory: str, layers: int, width: int, which: str
) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from torchsupervisor.checkpoint.sharded.collective import load_sharded
    from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState

    model, optimizer = _build(world_size, layers, width, 1)

    def load() -> None:
        if which == "ours":
            state = {"model": model, "optimizer": ShardedOptimizerState(model, optimizer)}
            load_sharded(state, os.path.join(directory, "ours", PREFIX))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--world-sizes", default="1,3,4")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "reshard.json"))
    args = parser.parse_args(argv)
    from torchsupervisor.testing import run_world

    directory = tempfile.mkdtemp(prefix="reshard-bench-")
    os.mkdir(os.path.join(directory, "ours"))
    rows = []
    try:
        run_world(save_rank, directory, args.layers, args.width, world_size=2, timeout_secs=900)
        warm_page_cache(directory)
        for world_size in map(int, args.world_sizes.split(",")):
            row: dict[str, Any] = {"world_size": world_size}
            for which in ("ours", "dcp"):
                ranks = run_world(
                    load_rank,
                    directory,
                    args.layers,
                    args.width,
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
    state_mb = 3 * args.layers * (args.width * args.width + args.width) * 4 / 1e6
    print(f"FSDP2 MLP, {args.layers} x {args.width}^2 + Adam: {state_mb:.0f} MB, saved by 2 ranks")
    print(f"{'ranks':>5} {'ours read/held':>15} {'dcp read/held':>14} {'ours':>8} {'dcp.load':>9}")
    for r in rows:
        print(
            f"{r['world_size']:>5} {r['ours']['max_read_over_held']:>15.3f} "
            f"{r['dcp']['max_read_over_held']:>14.3f} {r['ours']['secs']:>7.3f}s "
            f"{r['dcp']['secs']:>8.3f}s"
        )
    print("(read/held: the most of any rank; target for ours: at most 1.1)")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"state_mb": state_mb, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
