"""Save cache benchmark: what each memo of a sharded asynchronous save spares, memo by memo.

    python benchmarks/save_cache.py                      # every variant, 3 rounds of 20 saves
    python benchmarks/save_cache.py --variants on,off    # the whole cache on and off only

The save cache (``torchsupervisor/checkpoint/save_cache.py``) keeps what a writer derived from
the state at one save for the next, where the state still holds the very same objects. Each
memo must spare at least 1 ms of CPU per save to stay (issue "Seams", item 4). This measures
it where the memos matter most: an FSDP2 state of 1,008 small tensors (63 blocks of
``LayerNorm`` + ``Linear`` of width 64 and their Adam state, 3.2 MB) saved with
``Saver.save_async`` by 2 ranks (gloo, CPU), one save after another, each waited for.

Variants, all in the same run, in turns (each a fresh 2-rank world):

* ``on``: the cache as shipped;
* ``off``: ``TORCHSUPERVISOR_SAVE_CACHE=0``, every memo off;
* ``no_<memo>``: the cache on but one memo off (its lookup always misses): ``no_shard``
  (``in_place.ShardMemo``: a shard's chunks and in-place layout), ``no_table``
  (``packed.TableMemo``: the coordinator's tensor table), ``no_sent`` (``packed.SentRows``:
  the rows a rank sent last), ``no_stage_table`` (``StageMemo.last``: the whole staged table),
  ``no_stage`` (``StageMemo`` entirely: the DTensors over the host copies too), ``no_laid_out``
  (``PlanCache``'s last layout of the staged table).

Reported per variant (medians over ranks' medians, in ms per save): the *stall* (the training
thread inside ``save_async``), the CPU time of the writer thread on rank 0 (the coordinator,
which also makes the manifest) and rank 1, and each against ``on`` (a difference: above 0
means that memo spares that much). It prints a table and writes JSON (``--json``, default
``benchmarks/results/save_cache.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

VARIANTS = [
    "on",
    "off",
    "no_shard",
    "no_table",
    "no_sent",
    "no_stage_table",
    "no_stage",
    "no_laid_out",
]
BLOCKS, WIDTH = 63, 64  # 63 blocks x 16 tensors (4 parameters, 8 Adam moments, 4 steps)
WARM_SAVES = 3  # The first save is planned by DCP; the memos fill at the next ones.
WRITER_THREAD = "torchsupervisor-checkpoint-writer"


def _turn_off(variant: str) -> None:
    """Make one memo miss every time (in this rank's process only)."""
    from torchsupervisor.checkpoint.sharded import in_place, packed, replay, staging

    if variant == "no_shard":
        in_place.ShardMemo.take = lambda self, *args: None
        in_place.ShardMemo.keep = lambda self, *args: None
    elif variant == "no_table":
        table = packed.TableMemo.table

        def fresh_table(self: Any, results: Any) -> Any:
            self._last = None  # Not ``forget``: the rows received stay (``SentRows``).
            return table(self, results)

        packed.TableMemo.table = fresh_table
    elif variant == "no_sent":
        pack = packed.SentRows.pack

        def send_all(self: Any, written: Any) -> Any:
            self.forget()
            return pack(self, written)

        packed.SentRows.pack = send_all
    elif variant in ("no_stage_table", "no_stage"):
        stage = staging._stage

        def stage_anew(save: Any, stager: Any, memo: Any, wait: bool) -> None:
            memo.last = None
            if variant == "no_stage":
                memo.wrapped.clear()
            stage(save, stager, memo, wait)

        staging._stage = stage_anew
    elif variant == "no_laid_out":
        replay.PlanCache._layout_of = lambda self, save: replay.layout_of(save.tensors)
    elif variant not in ("on", "off"):
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


def _writer_cpu_secs() -> float:
    return sum(
        time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        for thread in threading.enumerate()
        if thread.name == WRITER_THREAD and thread.ident is not None
    )


def run_rank(rank: int, world_size: int, directory: str, variant: str, saves: int) -> dict:
    """``saves`` asynchronous saves (after the warm ones); each rank's medians in ms."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchsupervisor import Saver, ShardedOptimizerState
    from torchsupervisor.testing import save_cache_of

    _turn_off(variant)
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)) for _ in range(BLOCKS))
    )
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, WIDTH)).sum().backward()
    optimizer.step()
    state = {"model": model, "optimizer": ShardedOptimizerState(model, optimizer)}
    saver = Saver(var_list=state, max_to_keep=2)
    prefix = os.path.join(directory, variant, "model.ckpt")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    stalls, writer = [], []
    for step in range(WARM_SAVES + saves):
        torch.distributed.barrier()
        before = _writer_cpu_secs()
        start = time.perf_counter()
        future = saver.save_async(None, prefix, global_step=step)
        stall = time.perf_counter() - start
        future.result(120)
        if step >= WARM_SAVES:
            stalls.append(stall * 1e3)
            writer.append((_writer_cpu_secs() - before) * 1e3)
    cache = save_cache_of(saver)
    replayed = cache.plans.replayed if cache is not None and cache.plans is not None else 0
    saver.close()
    return {
        "stall_ms": statistics.median(stalls),
        "writer_cpu_ms": statistics.median(writer),
        "replayed": replayed,
    }


def run_variant(variant: str, directory: str, saves: int) -> list[dict]:
    from torchsupervisor.testing import run_world

    env = {"TORCHSUPERVISOR_SAVE_CACHE": "0"} if variant == "off" else {}
    this = sys.modules[__name__]
    return run_world(this.run_rank, directory, variant, saves, env=env, timeout_secs=600)


def summarize(results: dict[str, list[list[dict]]]) -> list[dict]:
    """One row per variant: medians over the rounds, and the differences from ``on``."""
    rows = []
    for variant, rounds in results.items():
        rows.append(
            {
                "variant": variant,
                "stall_ms": statistics.median(r["stall_ms"] for ranks in rounds for r in ranks),
                "writer_cpu_ms": [
                    statistics.median(ranks[rank]["writer_cpu_ms"] for ranks in rounds)
                    for rank in range(len(rounds[0]))
                ],
                "replayed": min(r["replayed"] for ranks in rounds for r in ranks),
            }
        )
    base = next((row for row in rows if row["variant"] == "on"), None)
    for row in rows:
        if base is not None:
            row["stall_spared_ms"] = row["stall_ms"] - base["stall_ms"]
            row["writer_cpu_spared_ms"] = [
                mine - theirs for mine, theirs in zip(row["writer_cpu_ms"], base["writer_cpu_ms"])
            ]
    return rows


def print_table(rows: list[dict], saves: int, rounds: int) -> None:
    print(
        f"\nSharded save_async of {BLOCKS * 16} tensors by 2 ranks: medians of {rounds} "
        f"round(s) of {saves} saves, ms per save (spared: the variant minus 'on')"
    )
    print(
        f"{'variant':16s} {'stall':>7s} {'spared':>7s} {'writer r0':>10s} {'spared':>7s} "
        f"{'writer r1':>10s} {'spared':>7s}"
    )
    for row in rows:
        spared = row.get("writer_cpu_spared_ms", [0.0, 0.0])
        print(
            f"{row['variant']:16s} {row['stall_ms']:7.2f} {row.get('stall_spared_ms', 0.0):+7.2f} "
            f"{row['writer_cpu_ms'][0]:10.2f} {spared[0]:+7.2f} "
            f"{row['writer_cpu_ms'][1]:10.2f} {spared[1]:+7.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="which, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="turns of every variant")
    parser.add_argument("--saves", type=int, default=20, help="measured saves per world")
    parser.add_argument("--json", default=None, help="output file")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    for variant in variants:
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # Files in memory: no disk noise.
    root = tempfile.mkdtemp(prefix="torchsupervisor-bench-", dir=shm)
    results: dict[str, list[list[dict]]] = {v: [] for v in variants}
    try:
        for round_ in range(args.rounds):
            for variant in variants:
                ranks = run_variant(variant, root, args.saves)
                results[variant].append(ranks)
                stalls = ", ".join(f"{r['stall_ms']:.2f}" for r in ranks)
                cpus = ", ".join(f"{r['writer_cpu_ms']:.2f}" for r in ranks)
                print(f"round {round_}: {variant}: stall {stalls} ms, writer CPU {cpus} ms")
                shutil.rmtree(os.path.join(root, variant), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = summarize(results)
    print_table(rows, args.saves, args.rounds)
    from checkpoint import machine_facts  # benchmarks/checkpoint.py (this script's folder)

    report = {
        "machine": machine_facts(),
        "saves": args.saves,
        "rounds": args.rounds,
        "rows": rows,
    }
    here = os.path.dirname(os.path.abspath(__file__))
    out = args.json or os.path.join(here, "results", "save_cache.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
