"""Distributed checkpoint benchmark: sharded saves by 1 and 2 ranks against plain
``torch.distributed.checkpoint.save``, DDP chief-only saves, and restores with the same and
another world size.

    python benchmarks/distributed.py                       # 50 MB, 200 MB, 1 GB
    python benchmarks/distributed.py --sizes 20MB,50MB     # quicker

The state is an MLP of square ``Linear`` layers plus its Adam state (parameters, exp_avg,
exp_avg_sq: the size given is the total). Every configuration runs in fresh processes on CPU
with gloo (the benchmark launches them itself, as ``torchrun`` would):

* ``sharded``: the model is sharded with FSDP2 (``fully_shard``) over 1 or 2 ranks, and every
  rank calls ``save_sharded`` (what ``Saver.save`` and the Supervisor do with such a state):
  each writes its own shard in parallel, the coordinator commits the manifest. The save is
  synchronous, so the *stall* (the training thread blocked) is the whole save. Reported per
  rank: the bytes it wrote, its stall, and its throughput (its bytes / its stall); and the
  aggregate throughput (all bytes / the slowest rank's stall).
* ``dcp.save`` (the baseline): in the same processes, interleaved with the sharded saves, a
  plain ``torch.distributed.checkpoint.save`` of the same state (``{"model":
  model.state_dict(), "optimizer": get_optimizer_state_dict(...)}``) to a
  ``FileSystemWriter`` directory (one file per rank, fsync on, as by default): what a user
  without torchsupervisor would write. The sharded rows print their stall relative to it
  (``x dcp``: the slowest rank's stall over DCP's slowest rank's stall; above 1 is slower).
* ``ddp chief``: the same model replicated with DDP on 2 ranks, the chief alone saving the whole
  state with ``Saver.save_async`` (what the Supervisor does with a replicated state): the stall
  is the host copy; the write runs in the background (throughput = bytes / time to commit).
  Incremental saves are off, so every save writes everything.
* ``async``: the FSDP2 state on 2 ranks saved with ``Saver.save_async`` against
  ``dcp.async_save`` in the same processes: the stall of each against one host copy of the
  rank's local shards (*memcpy*: every rank at once, after a barrier, as the ranks stage at
  the step boundary of a save; *alone*: each rank while the other waits), the time to commit,
  and training steps/s while saves persist against steps/s with none in flight. Beside them
  the *floor*: the least any asynchronous save must do (the memcpy at the step boundary, then
  an ``O_DIRECT`` write and ``fsync`` of the copies on a background thread at our writer's
  priority; no checksum, manifest or commit): ``x floor`` is our steps/s ratio over its, 1 when
  a save costs training no more than writing the bytes at all does. The three kinds of save
  take turns within each round of the steps/s measurement, so a line below the table also
  gives ours over the floor's within each round, its median and a 95% interval (the sign
  test's), which tells whether the runs' noise lets the two be told apart, and how long
  training waited, on average, for a save still running after its steps. Also on a
  state of many small tensors (``--blocks-sizes``, default 50 MB: blocks of ``LayerNorm`` +
  ``Linear`` of width 256, about 1,000 tensors), where the per-tensor work of a save (state
  dicts, flattening, one copy call each) weighs against the bytes; its memcpy is one
  ``copy_`` call per tensor too.
* ``restore``: ``load_sharded`` of the last sharded checkpoint into a freshly built model, by
  the same world size (in the processes that saved, files in the page cache) and by the other
  world size (fresh processes: 2 ranks reading a 1-rank checkpoint, 1 rank reading a 2-rank
  one, resharding).

The state column is what was written (the model is built from whole layers, so it is near,
not equal to, the size asked for).

On a machine with few cores, 2 ranks also share the CPUs (copy, CRC-32C) and the disk: the
aggregate throughput shows what parallel writing buys there. Each figure is the median of
``--repeat`` saves. It prints a table and writes JSON (``--json``, default
``benchmarks/results/distributed.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MB = 1_000_000


def parse_size(text: str) -> int:
    """Bytes of ``"50MB"``, ``"1GB"``, ``"2000000"``."""
    text = text.strip().upper()
    for suffix, factor in (("GB", 1000 * MB), ("MB", MB), ("KB", 1000)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


# ------------------------------------------------------------------------- worker side


BLOCK_WIDTH = 256
"""Width of the ``blocks`` model's layers (``--blocks-sizes``)."""


def _build(
    total_bytes: int, world_size: int, kind: str, model_kind: str = "mlp"
) -> tuple[Any, Any, dict[str, Any]]:
    """The model, its optimizer (with Adam state) and the state to save.

    ``model_kind``: ``mlp``, square ``Linear`` layers without bias (few, large tensors); or
    ``blocks``, blocks of ``LayerNorm`` + ``Linear`` of width 256 (each block 4 parameters,
    16 tensors with Adam's state: many small tensors, as a transformer's state has).
    """
    import torch
    from torch import nn

    from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState

    param_bytes = total_bytes / 3  # Parameters, exp_avg, exp_avg_sq.
    torch.manual_seed(0)
    if model_kind == "blocks":
        width = BLOCK_WIDTH
        per_block = (width * width + 3 * width) * 4
        model = nn.Sequential(
            *(
                nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width))
                for _ in range(max(1, round(param_bytes / per_block)))
            )
        )
    else:
        width = 1024 if param_bytes >= 4 * 1024 * 1024 else max(8, int(math.sqrt(param_bytes / 4)))
        width -= width % 8
        layers = max(1, round(param_bytes / (width * width * 4)))
        model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    if kind == "sharded":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    if kind == "sharded":
        return (
            model,
            optimizer,
            {"model": model, "optimizer": ShardedOptimizerState(model, optimizer)},
        )
    return model, optimizer, {"model": model.module, "optimizer": optimizer}


def _shard_bytes(prefix: str, rank: int) -> int:
    directory, base = os.path.split(prefix)
    mine = f"{base}.data-{rank:05d}-of-"
    return sum(
        os.path.getsize(os.path.join(directory, n))
        for n in os.listdir(directory)
        if n.startswith(mine)
    )


def _dcp_bytes(directory: str, rank: int) -> int:
    return sum(
        os.path.getsize(os.path.join(directory, n))
        for n in os.listdir(directory)
        if n.startswith(f"__{rank}_")
    )


def _dcp_save(state: dict[str, Any], directory: str) -> None:
    """The baseline: a plain DCP save of the state, as a user of FSDP2 alone writes it."""
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"model": state["model"].state_dict(), "optimizer": state["optimizer"].state_dict()},
        storage_writer=dcp.FileSystemWriter(directory),
    )


def _width(model: Any) -> int:
    """The input width of the model's first ``Linear`` layer (both kinds of ``_build``)."""
    from torch import nn

    return next(m for m in model.modules() if isinstance(m, nn.Linear)).in_features


def _train_step(model: Any, width: int) -> None:
    """One FSDP2 training step (its all-gathers and reduce-scatters on the default group)."""
    import torch

    model(torch.randn(64, width)).sum().backward()
    for p in model.parameters():
        p.grad = None


def _local_shards(state: dict[str, Any]) -> list[Any]:
    """The tensors a save of ``state`` copies on this rank: each DTensor's local shard."""
    from torch.distributed.tensor import DTensor

    from torchsupervisor.core.walk import walk_state

    _, tensors = walk_state(state)
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors.values()]


def _local_memcpy_secs(state: dict[str, Any], together: bool = True, before: Any = None) -> float:
    """One host copy of this rank's local shards into buffers allocated beforehand.

    ``together``: every rank copies at once, after a barrier, as every rank stages at once at
    the step boundary of a save (the ranks of a machine share its memory bandwidth); else
    each rank copies while the others wait (a rank alone). ``before``: run first on every
    rank (a training step, which leaves the caches as a save finds them).
    """
    import torch.distributed as dist

    local = _local_shards(state)
    buffers = [t.clone() for t in local]
    secs = 0.0
    for turn in [None] if together else range(dist.get_world_size()):
        if before is not None:
            before()
        dist.barrier()
        if turn is None or turn == dist.get_rank():
            start = time.perf_counter()
            for dst, src in zip(buffers, local):
                dst.copy_(src)
            secs = time.perf_counter() - start
    dist.barrier()
    return secs


def _steps_per_sec(model: Any, width: int, steps: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        _train_step(model, width)
    return steps / (time.perf_counter() - start)


class _FloorSave:
    """The least any asynchronous save of the local shards must do: the floor of the async case.

    At the step boundary, one ``copy_`` of each local shard into one page-aligned buffer kept
    across saves (the memcpy); then, on a background thread at the priority of our writer
    (``nice`` 19 and ``SCHED_IDLE``), the buffer written to a file of the rank's own with
    ``O_DIRECT`` (the device reads the buffer: no copy into the page cache; buffered where the
    file system refuses it) in 8 MiB writes, and its ``fsync``. No checksum, no manifest, no
    agreement of the ranks, no commit: a save that could not be trusted, whose cost to training
    bounds what a trustworthy one can reach on the machine. Its thread is not raised while the
    caller waits (ours is): a waiting caller leaves its core to it anyway, and ``threads.hurry``
    would raise our idle writer too.
    """

    def __init__(self, local: list[Any], directory: str, rank: int) -> None:
        import concurrent.futures
        import mmap

        import torch

        from torchsupervisor.storage.local import DIRECT_IO_ALIGNMENT as align

        self._local = local
        sizes = [t.numel() * t.element_size() for t in local]
        offsets, end = [], 0
        for size in sizes:
            offsets.append(end)
            end += -(-size // 64) * 64  # Each copy 64-byte aligned.
        self.local_bytes = sum(sizes)
        self._arena = mmap.mmap(-1, max(align, -(-end // align) * align))  # Page-aligned.
        whole = torch.frombuffer(self._arena, dtype=torch.uint8)
        self._buffers = [
            whole[at : at + size].view(t.dtype).view(t.shape)
            for t, at, size in zip(local, offsets, sizes)
        ]
        self._path = os.path.join(directory, f"floor-{rank}.bin")
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="floor-writer")

    def save(self) -> Any:
        """Copy the shards and start the write; returns its ``concurrent.futures.Future``."""
        for dst, src in zip(self._buffers, self._local):
            dst.copy_(src)
        return self._pool.submit(self._write)

    def _write(self) -> None:
        from torchsupervisor.checkpoint.engine import BACKGROUND_NICENESS, background_priority
        from torchsupervisor.core import threads

        niceness, idle = background_priority(BACKGROUND_NICENESS)  # Our writer's, exactly.
        threads.lower(niceness, idle=idle)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(self._path, flags | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError:  # tmpfs and others refuse O_DIRECT.
            fd = os.open(self._path, flags, 0o644)
        try:
            view = memoryview(self._arena)
            for start in range(0, len(view), 8 << 20):
                chunk = view[start : start + (8 << 20)]
                while chunk:
                    chunk = chunk[os.write(fd, chunk) :]
            os.ftruncate(fd, self.local_bytes)  # Less the padding to the alignment.
            os.fsync(fd)
        finally:
            os.close(fd)

    def written_bytes(self) -> int:
        """The size of the file the last save wrote."""
        return os.path.getsize(self._path)

    def close(self) -> None:
        self._pool.shutdown()


def _async_case(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    """Asynchronous sharded saves: ours (``Saver.save_async``) against ``dcp.async_save`` of
    the same state, the stall of each against one host memcpy of the local shards, and the
    training steps/s while each persists against steps/s with nothing in flight."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from torchsupervisor import Saver

    model, _, state = _build(args.bytes, world, "sharded", args.model)
    width = _width(model)

    # Each copy and each save below follows a training step, as a save at a step boundary
    # does: copied in a loop of its own, the memcpy finds its buffers in the caches and
    # varies more (2.1 and 4.0 ms at 50 MB in two runs, against 3.1-3.5 ms after a step).
    # The floor is noisy on a shared machine: 10 copies at least.
    def step() -> None:
        _train_step(model, width)

    copies = max(10, args.repeat)
    memcpy = [_local_memcpy_secs(state, before=step) for _ in range(copies)]
    memcpy_alone = [_local_memcpy_secs(state, together=False, before=step) for _ in range(copies)]
    saver = Saver(state, incremental=False, max_to_keep=1)
    dcp_group = dist.new_group(backend="gloo")  # DCP's advice for async_save's collectives.
    # DCP's default staging for a CPU state, one stager kept across saves so that it reuses
    # its host copies (as ours reuses its buffers).
    dcp_stager = DefaultStager(StagingOptions(False, False, False, False))

    def ours(i: int) -> Any:
        return saver.save_async(None, os.path.join(args.dir, "model.ckpt"), global_step=i)

    def theirs(i: int) -> Any:
        sd = {"model": state["model"].state_dict(), "optimizer": state["optimizer"].state_dict()}
        return dcp.async_save(
            sd,
            storage_writer=dcp.FileSystemWriter(os.path.join(args.dir, f"dcp-{i % 2}")),
            process_group=dcp_group,
            async_stager=dcp_stager,
        )

    local = _local_shards(state)
    floor = _FloorSave(local, args.dir, rank)

    def least(i: int) -> Any:
        return floor.save()

    _steps_per_sec(model, width, 5)  # Warm-up.
    out: dict[str, Any] = {"memcpy": memcpy, "memcpy_alone": memcpy_alone}
    out["tensors"] = len(local)
    number = iter(range(1, 1_000_000))  # Global steps of the saves.
    saves = {"ours": ours, "dcp": theirs, "floor": least}
    for name, save in saves.items():
        save(next(number)).result()  # Warm-up: buffers, groups, caches.
        stalls, totals = [], []
        for _ in range(args.repeat):
            step()
            dist.barrier()
            start = time.perf_counter()
            future = save(next(number))
            stalls.append(time.perf_counter() - start)
            future.result()
            totals.append(time.perf_counter() - start)
        # Steps/s with saves back to back (below): each save is started at a step boundary
        # and waited for (if still running) after as many steps as a save takes.
        rate = _steps_per_sec(model, width, 3)
        wanted = torch.tensor([max(1, math.ceil(rate * statistics.median(totals)))])
        dist.all_reduce(wanted, op=dist.ReduceOp.MAX)  # Every rank runs the same steps.
        out[name] = {"stalls": stalls, "totals": totals, "steps_per_save": int(wanted)}
        out[name]["rounds"] = []
    # Rounds with and without saves alternate, each busy round compared with the idle round
    # just before it, and the three kinds of save take turns within each round: the machine's
    # speed drifts (idle steps/s moved by 10% between kinds measured one after the other).
    for _ in range(args.rounds):
        for name, save in saves.items():
            per_save = out[name]["steps_per_save"]
            idle = _steps_per_sec(model, width, 2 * per_save)
            dist.barrier()
            start, waited = time.perf_counter(), 0.0
            for _ in range(2):
                future = save(next(number))
                for _ in range(per_save):
                    _train_step(model, width)
                before = time.perf_counter()
                future.result()
                waited += time.perf_counter() - before
            busy = 2 * per_save / (time.perf_counter() - start)
            out[name]["rounds"].append(
                {"idle": idle, "busy": busy, "ratio": busy / idle, "waited": waited / 2}
            )
    out["local_bytes"], out["floor_bytes"] = floor.local_bytes, floor.written_bytes()
    saver.close()
    floor.close()
    return out


def worker(args: argparse.Namespace) -> None:
    """One rank: run the configuration and print ``RESULT <json>``."""
    import torch.distributed as dist

    from torchsupervisor import Saver
    from torchsupervisor.checkpoint.sharded.collective import load_sharded, save_sharded

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {"rank": rank, "world_size": world}
    if args.mode == "save":
        _, _, state = _build(args.bytes, world, "sharded")
        stalls, written, dcp_stalls, dcp_written = [], 0, [], 0
        for i in range(args.repeat):
            prefix = os.path.join(args.dir, f"model.ckpt-{i}")
            dist.barrier()
            start = time.perf_counter()
            save_sharded(state, prefix, global_step=i, write_state=False)
            stalls.append(time.perf_counter() - start)
            written = _shard_bytes(prefix, rank)
            dist.barrier()
            if i < args.repeat - 1 and rank == 0:
                for name in os.listdir(args.dir):
                    if name.startswith(f"model.ckpt-{i}."):
                        os.remove(os.path.join(args.dir, name))
            # The baseline, interleaved so that both see the same machine and page cache.
            dcp_dir = os.path.join(args.dir, f"dcp-{i}")
            dist.barrier()
            start = time.perf_counter()
            _dcp_save(state, dcp_dir)
            dcp_stalls.append(time.perf_counter() - start)
            dcp_written = _dcp_bytes(dcp_dir, rank)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(dcp_dir, ignore_errors=True)
        result.update(dcp_stalls=dcp_stalls, dcp_bytes=dcp_written)
        _, _, fresh = _build(args.bytes, world, "sharded")
        dist.barrier()
        start = time.perf_counter()
        load_sharded(fresh, os.path.join(args.dir, f"model.ckpt-{args.repeat - 1}"))
        result.update(stalls=stalls, bytes=written, restore_secs=time.perf_counter() - start)
    elif args.mode == "async":
        result.update(_async_case(args, rank, world))
    elif args.mode == "load":
        _, _, state = _build(args.bytes, world, "sharded")
        dist.barrier()
        start = time.perf_counter()
        load_sharded(state, args.prefix)
        result.update(restore_secs=time.perf_counter() - start)
    elif args.mode == "ddp":
        _, _, state = _build(args.bytes, world, "ddp")
        saver = Saver(state, incremental=False, max_to_keep=1)
        stalls, totals, written = [], [], 0
        for i in range(args.repeat):
            dist.barrier()
            if rank == 0:
                start = time.perf_counter()
                future = saver.save_async(None, os.path.join(args.dir, "model.ckpt"), global_step=i)
                stalls.append(time.perf_counter() - start)
                future.result()
                totals.append(time.perf_counter() - start)
                written = saver.last_save.bytes_written
            dist.barrier()
        saver.close()
        result.update(stalls=stalls, totals=totals, bytes=written)
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
    # Skip the interpreter's teardown: gloo threads that release tensors while it runs abort
    # the process at random, even after destroy_process_group (a known PyTorch issue).
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world_size: int, *worker_args: str, timeout_secs: float = 1800) -> list[dict[str, Any]]:
    """Run ``world_size`` ranks of this script's worker; return each rank's result."""
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
        env.update(WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", *worker_args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout_secs)
        if proc.returncode != 0:
            for other in procs:
                other.kill()
            raise RuntimeError(f"a benchmark rank failed ({proc.returncode}):\n{err[-3000:]}")
        (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
        results.append(json.loads(line[len("RESULT ") :]))
    return sorted(results, key=lambda r: r["rank"])


def _save_row(
    case: str, size: int, world: int, ranks: list[dict[str, Any]], nbytes: str, stalls: str
) -> dict[str, Any]:
    """A table row of one kind of save (ours or DCP's), from every rank's report."""
    per_rank_stalls = [statistics.median(r[stalls]) for r in ranks]
    total = sum(r[nbytes] for r in ranks)
    return {
        "case": case,
        "size_bytes": size,
        "state_bytes": total,
        "world_size": world,
        "per_rank_bytes": [r[nbytes] for r in ranks],
        "per_rank_stall_secs": per_rank_stalls,
        "per_rank_mb_per_sec": [r[nbytes] / MB / s for r, s in zip(ranks, per_rank_stalls)],
        "aggregate_mb_per_sec": total / MB / max(per_rank_stalls),
    }


def run_size(size: int, root: str, repeat: int, rounds: int) -> list[dict[str, Any]]:
    """Every configuration for one state size; rows for the table."""
    rows: list[dict[str, Any]] = []
    dirs = {}
    common = ["--bytes", str(size), "--repeat", str(repeat), "--rounds", str(rounds)]
    for world in (1, 2):
        directory = tempfile.mkdtemp(prefix=f"sharded{world}-", dir=root)
        dirs[world] = directory
        ranks = launch(world, "--mode", "save", "--dir", directory, *common)
        plural = "s" if world > 1 else ""
        ours = _save_row(f"sharded, {world} rank{plural}", size, world, ranks, "bytes", "stalls")
        dcp = _save_row(
            f"dcp.save, {world} rank{plural}", size, world, ranks, "dcp_bytes", "dcp_stalls"
        )
        ours["restore_same_world_secs"] = max(r["restore_secs"] for r in ranks)
        ours["stall_vs_dcp"] = max(ours["per_rank_stall_secs"]) / max(dcp["per_rank_stall_secs"])
        rows += [ours, dcp]
    for saved_by, restored_by in ((2, 1), (1, 2)):
        prefix = os.path.join(dirs[saved_by], f"model.ckpt-{repeat - 1}")
        ranks = launch(restored_by, "--mode", "load", "--prefix", prefix, *common)
        saved_row = next(r for r in rows if r["case"].startswith(f"sharded, {saved_by} rank"))
        rows.append(
            {
                "case": f"restore {saved_by} -> {restored_by} rank{'s' if restored_by > 1 else ''}",
                "size_bytes": size,
                "state_bytes": saved_row["state_bytes"],
                "world_size": restored_by,
                "saved_by": saved_by,
                "restore_secs": max(r["restore_secs"] for r in ranks),
            }
        )
    ddp_dir = tempfile.mkdtemp(prefix="ddp-", dir=root)
    ranks = launch(2, "--mode", "ddp", "--dir", ddp_dir, *common)
    chief = ranks[0]
    stall, total = statistics.median(chief["stalls"]), statistics.median(chief["totals"])
    rows.append(
        {
            "case": "ddp chief-only, 2 ranks",
            "size_bytes": size,
            "state_bytes": chief["bytes"],
            "world_size": 2,
            "per_rank_bytes": [chief["bytes"], 0],
            "per_rank_stall_secs": [stall, 0.0],
            "commit_secs": total,
            "per_rank_mb_per_sec": [chief["bytes"] / MB / total, 0.0],
            "aggregate_mb_per_sec": chief["bytes"] / MB / total,
        }
    )
    rows.append(run_async(size, root, repeat, rounds))
    for directory in [*dirs.values(), ddp_dir]:
        shutil.rmtree(directory, ignore_errors=True)
    return rows


def run_async(size: int, root: str, repeat: int, rounds: int, model_kind: str = "mlp") -> dict:
    """The asynchronous case on 2 ranks (``_async_case``), ours against ``dcp.async_save``."""
    directory = tempfile.mkdtemp(prefix="async-", dir=root)
    common = ["--bytes", str(size), "--repeat", str(repeat), "--rounds", str(rounds)]
    try:
        ranks = launch(2, "--mode", "async", "--model", model_kind, "--dir", directory, *common)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return _async_row(size, ranks, model_kind)


def _async_row(size: int, ranks: list[dict[str, Any]], model_kind: str = "mlp") -> dict[str, Any]:
    """Asynchronous sharded saves on 2 ranks: stalls, totals and steps/s, ours and DCP's."""
    case = "async sharded, 2 ranks" + (", blocks" if model_kind == "blocks" else "")
    row: dict[str, Any] = {"case": case, "size_bytes": size, "world_size": 2}
    row["model"], row["tensors"] = model_kind, ranks[0]["tensors"]
    memcpy = max(statistics.median(r["memcpy"]) for r in ranks)
    row["memcpy_secs"] = memcpy
    row["memcpy_alone_secs"] = max(statistics.median(r["memcpy_alone"]) for r in ranks)
    row["local_bytes"] = [r["local_bytes"] for r in ranks]
    row["floor_bytes"] = [r["floor_bytes"] for r in ranks]  # Written by the floor's last save.
    for name in ("ours", "dcp", "floor"):
        stall = max(statistics.median(r[name]["stalls"]) for r in ranks)
        total = max(statistics.median(r[name]["totals"]) for r in ranks)
        rounds = ranks[0][name]["rounds"]  # The ranks step together: rank 0's clock.
        row[name] = {
            "stall_secs": stall,
            "total_secs": total,
            "stall_vs_memcpy": stall / memcpy,
            "stall_vs_memcpy_alone": stall / row["memcpy_alone_secs"],
            "steps_per_save": ranks[0][name]["steps_per_save"],
            "steps_per_sec_idle": statistics.median(r["idle"] for r in rounds),
            "steps_per_sec_persisting": statistics.median(r["busy"] for r in rounds),
            "steps_ratio": statistics.median(r["ratio"] for r in rounds),
            "rounds": rounds,
        }
    row["stall_vs_dcp"] = row["ours"]["stall_secs"] / row["dcp"]["stall_secs"]
    # How much of the floor's steps/s ours keeps (1: training loses no more than the least
    # an asynchronous save costs it).
    row["steps_ratio_vs_floor"] = row["ours"]["steps_ratio"] / row["floor"]["steps_ratio"]
    # The same within each round (ours and the floor's took turns in it, so the machine's
    # drift between rounds cancels), with a 95% interval for its median: how far the runs'
    # noise lets one tell ours from the floor.
    paired = [
        o["ratio"] / f["ratio"] for o, f in zip(row["ours"]["rounds"], row["floor"]["rounds"])
    ]
    row["paired_vs_floor"] = median_interval(paired)
    row["floor"]["steps_ratio_interval"] = median_interval(
        [r["ratio"] for r in row["floor"]["rounds"]]
    )
    for name in ("ours", "dcp", "floor"):
        # How long training waited, at the step boundary after a save's steps, for the save
        # to finish (0 where each save fits beside its steps).
        waits = [r["waited"] for r in row[name]["rounds"]]
        row[name]["mean_wait_secs"] = statistics.fmean(waits) if waits else 0.0
    return row


def median_interval(values: list[float], confidence: float = 0.95) -> dict[str, Any]:
    """The median of ``values`` and a distribution-free interval for it: the order
    statistics ``k``-th smallest and ``k``-th largest, with ``k`` the largest for which a
    Binomial(n, 1/2) falls below ``k`` with probability at most ``(1 - confidence) / 2``
    (the sign test). ``low`` and ``high`` are None where ``values`` are too few (n < 6 at
    95%)."""
    ordered = sorted(values)
    n = len(ordered)
    tail, k, below = (1 - confidence) / 2, 0, 0.0
    while k < n // 2 and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    return {
        "median": statistics.median(ordered) if ordered else None,
        "low": ordered[k - 1] if k else None,
        "high": ordered[n - k] if k else None,
        "n": n,
        "confidence": confidence,
    }


def print_async_table(rows: list[dict[str, Any]]) -> None:
    """Print the asynchronous sharded saves: ours against ``dcp.async_save``."""
    rows = [r for r in rows if r["case"].startswith("async")]
    if not rows:
        return
    print(
        f"\n{'async, 2 ranks':16s} {'state':>8s} {'tensors':>7s} {'memcpy s':>9s} {'alone s':>8s} "
        f"{'stall s':>8s} {'x memcpy':>9s} {'x alone':>8s} {'x dcp':>6s} {'persist s':>9s} "
        f"{'steps/s idle':>12s} "
        f"{'persisting':>10s} {'ratio':>6s} {'x floor':>7s}"
    )
    for row in rows:
        for name in ("ours", "dcp", "floor"):
            r = row[name]
            ratio = {"ours": f"{row['stall_vs_dcp']:.2f}", "dcp": "1.00"}.get(name, "")
            label = f"{name}{', blocks' if row.get('model') == 'blocks' else ''}"
            print(
                f"{label:16s} {row['size_bytes'] / MB:>6.0f}MB {row.get('tensors', 0):>7d} "
                f"{row['memcpy_secs']:>9.4f} "
                f"{row['memcpy_alone_secs']:>8.4f} {r['stall_secs']:>8.4f} "
                f"{r['stall_vs_memcpy']:>9.2f} {r['stall_vs_memcpy_alone']:>8.2f} {ratio:>6s} "
                f"{r['total_secs']:>9.3f} {r['steps_per_sec_idle']:>12.1f} "
                f"{r['steps_per_sec_persisting']:>10.1f} {r['steps_ratio']:>6.3f} "
                f"{r['steps_ratio'] / row['floor']['steps_ratio']:>7.3f}"
            )
        paired, floor = row["paired_vs_floor"], row["floor"]["steps_ratio_interval"]
        if paired["low"] is not None:
            print(
                f"  ours / floor within each round: median {paired['median']:.3f}, 95% "
                f"interval {paired['low']:.3f}-{paired['high']:.3f}; the floor's own ratio "
                f"{floor['median']:.3f} ({floor['low']:.3f}-{floor['high']:.3f}), "
                f"{paired['n']} rounds; training waited for a save after its steps "
                f"{row['ours']['mean_wait_secs'] * 1e3:.1f} ms (ours), "
                f"{row['floor']['mean_wait_secs'] * 1e3:.1f} ms (floor), on average"
            )


def print_table(rows: list[dict[str, Any]]) -> None:
    """Print the save and restore figures."""
    print(
        f"\n{'case':26s} {'state':>8s} {'per rank MB':>14s} {'stall s':>14s} "
        f"{'per rank MB/s':>16s} {'total MB/s':>10s} {'x dcp':>6s} {'restore s':>9s}"
    )
    for row in rows:
        if row["case"].startswith("async"):
            continue
        size = f"{row['state_bytes'] / MB:.0f}MB"
        if "per_rank_bytes" in row:
            per_mb = "/".join(f"{b / MB:.0f}" for b in row["per_rank_bytes"])
            stall = "/".join(f"{s:.3f}" for s in row["per_rank_stall_secs"])
            rate = "/".join(f"{r:.0f}" for r in row["per_rank_mb_per_sec"])
            restore = row.get("restore_same_world_secs")
            restore_text = f"{restore:.3f}" if restore is not None else "-"
            ratio = row.get("stall_vs_dcp")
            ratio_text = f"{ratio:.2f}" if ratio is not None else "-"
            print(
                f"{row['case']:26s} {size:>8s} {per_mb:>14s} {stall:>14s} {rate:>16s} "
                f"{row['aggregate_mb_per_sec']:>10.0f} {ratio_text:>6s} {restore_text:>9s}"
            )
        else:
            print(
                f"{row['case']:26s} {size:>8s} {'':>14s} {'':>14s} {'':>16s} {'':>10s} "
                f"{'':>6s} {row['restore_secs']:>9.3f}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--sizes", default="50MB,200MB,1GB", help="total state sizes")
    parser.add_argument("--repeat", type=int, default=3, help="saves per configuration")
    parser.add_argument(
        "--rounds", type=int, default=6, help="busy/idle rounds of the steps/s measurement"
    )
    parser.add_argument(
        "--blocks-sizes",
        default="50MB",
        help="sizes of the asynchronous case on a state of many small tensors ('' for none)",
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    parser.add_argument("--json", default=None, help="output file")
    # Worker-side options (the launcher passes them).
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="mlp", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    results_dir = os.path.join(here, "results")
    os.makedirs(results_dir, exist_ok=True)
    root = args.dir or tempfile.mkdtemp(prefix="torchsupervisor-bench-")
    os.makedirs(root, exist_ok=True)
    rows: list[dict[str, Any]] = []
    try:
        for text in args.sizes.split(","):
            rows.extend(run_size(parse_size(text), root, args.repeat, args.rounds))
        for text in filter(None, args.blocks_sizes.split(",")):
            rows.append(run_async(parse_size(text), root, args.repeat, args.rounds, "blocks"))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print_table(rows)
    print_async_table(rows)
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "repeat": args.repeat,
        "rows": rows,
    }
    out = args.json or os.path.join(results_dir, "distributed.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
