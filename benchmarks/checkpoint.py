"""Checkpoint benchmark: our stall, throughput and restore against the alternatives, same run.

    python benchmarks/checkpoint.py                      # 10 MB, 100 MB, 500 MB, 2 GB
    python benchmarks/checkpoint.py --sizes 10MB,100MB   # quicker
    python benchmarks/checkpoint.py --load 1             # + training speed beside a CPU hog
    python benchmarks/checkpoint.py --blocks-sizes ''    # without the many-tensor case

For each state size (an MLP plus its Adam state: parameters, exp_avg, exp_avg_sq) it measures,
on the same machine and the same directory:

* stall: how long the training thread is blocked per checkpoint: ours (``Saver.save_async``,
  steady state), one host memcpy of the state (each tensor copied into a preallocated buffer),
  ``torch.save`` + fsync, ``safetensors.torch.save_file`` + fsync, and
  ``torch.distributed.checkpoint.async_save`` (until it returns);
* training speed: steps/s of a training loop while our writer persists the state (saves back
  to back), against steps/s with no checkpoint in flight (the loop trains its own small model,
  so that the state size does not change the step); the ratio is the median, over rounds, of a
  busy round's rate over that of the idle rounds beside it; with ``--load N``, the same with
  N CPU-bound processes running beside the loop (a machine that is not idle), and a control
  run without saves that shows how much the loaded loop's speed moves by itself;
* persist throughput: bytes per second of our background write (commit protocol, CRC-32C,
  fsync) against a raw sequential write of the same bytes with fsync in the same directory;
* restore: ``Saver.restore`` into the model and optimizer against ``torch.load(weights_only=
  True)`` + ``load_state_dict``, each in a fresh process (a restart), with the files in the
  page cache (a restart on the same machine) and evicted from it (a restart on another
  machine; on a virtual machine the host's own cache makes these noisy: see
  ``measure_restore``);
* incremental: bytes written by a checkpoint of a model whose backbone (the state above) is
  frozen and only a small head trains, against the full checkpoint: one incremental save, and
  the average over a whole cycle of saves (incremental saves plus the full save that the
  saver makes regularly, so that the kept checkpoints hold two independent copies of every
  tensor).

Then, for a state of many small tensors (``--blocks-sizes``, default 50 MB: ``LayerNorm`` +
``Linear`` blocks of width 256 and Adam, 16 tensors a block, 1,008 at 50 MB, as a
transformer's state is mostly small tensors), the stall against the memcpy (one ``copy_`` per
tensor) and ``dcp.async_save``, and the training speed while it persists: there the
per-tensor work, not the bytes, decides the stall.

It prints a table and writes the figures as JSON (``--json``, default
``benchmarks/results/checkpoint.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from torchsupervisor import Saver, Session
from torchsupervisor.checkpoint.policy import default_full_save_interval
from torchsupervisor.core.state import flatten_state

MB = 1_000_000


def parse_size(text: str) -> int:
    """``"500MB"`` -> 500_000_000; ``"2GB"`` -> 2_000_000_000."""
    text = text.strip().upper()
    for unit, factor in (("GB", 1000 * MB), ("MB", MB), ("KB", 1000)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def build_state(size_bytes: int) -> dict[str, Any]:
    """An MLP and Adam state of about ``size_bytes`` (12 bytes per parameter)."""
    params = max(size_bytes // 12, 1)
    width = 1024 if params < 60_000_000 else 2048
    layers = max(1, round(params / (width * width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # Creates exp_avg and exp_avg_sq.
    optimizer.zero_grad(set_to_none=True)
    return {"model": model, "optimizer": optimizer}


BLOCK_WIDTH = 256
"""The width of the ``blocks`` state's layers (``build_blocks_state``)."""


def build_blocks_state(size_bytes: int) -> dict[str, Any]:
    """Blocks of ``LayerNorm`` + ``Linear`` (width ``BLOCK_WIDTH``) and Adam, about
    ``size_bytes`` (12 bytes per parameter): 16 tensors a block, most of them small."""
    per_block = BLOCK_WIDTH * BLOCK_WIDTH + 3 * BLOCK_WIDTH
    blocks = max(1, round(size_bytes / (12 * per_block)))
    torch.manual_seed(0)
    model = nn.Sequential(
        *[
            nn.Sequential(nn.LayerNorm(BLOCK_WIDTH), nn.Linear(BLOCK_WIDTH, BLOCK_WIDTH))
            for _ in range(blocks)
        ]
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # Creates exp_avg, exp_avg_sq and step.
    optimizer.zero_grad(set_to_none=True)
    return {"model": model, "optimizer": optimizer}


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def state_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return flatten_state(state)[1]


def touch(state: dict[str, Any]) -> None:
    """Mark every tensor as modified (as a training step would), without changing values."""
    with torch.no_grad():
        for t in state_tensors(state).values():
            t.add_(0)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_from_page_cache(directory: str) -> None:
    """Evict a directory's files from the page cache (so restores read from the disk)."""
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm_page_cache(directory: str) -> None:
    """Read a directory's files once, so that a restore reads them from memory."""
    for root, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                while f.read(64 << 20):
                    pass


def best(times: list[float]) -> float:
    return min(times)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class TrainingLoop:
    """A small training loop on the main thread whose speed we watch."""

    def __init__(self) -> None:
        torch.manual_seed(1)
        self.model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(256, 512)

    def step(self) -> None:
        self.opt.zero_grad()
        self.model(self.x).pow(2).mean().backward()
        self.opt.step()

    def steps_per_sec(self, duration_secs: float, until: Callable[[], bool] | None = None) -> float:
        steps, t0 = 0, time.perf_counter()
        while True:
            self.step()
            steps += 1
            elapsed = time.perf_counter() - t0
            if (until is not None and until()) or (until is None and elapsed >= duration_secs):
                return steps / elapsed


def between_checkpoints(state, loop: TrainingLoop, until: Callable[[], bool] | None = None) -> None:
    """What happens between two checkpoints: training steps, then the state changes.

    Timings taken right after a blocking wait are inflated by a cold core (a sleeping vCPU
    wakes up slowly), so every stall, ours and the baselines', is measured after real work.
    """
    while until is not None and not until():
        loop.step()
    for _ in range(3):
        loop.step()
    touch(state)


class Memcpy:
    """One host memcpy of the state: every tensor copied into a preallocated buffer, each at a
    64-byte boundary (a copy into a destination off its cache lines is slower)."""

    def __init__(self, state) -> None:
        tensors = state_tensors(state)
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        starts = [0, *itertools.accumulate(-(-n // 64) * 64 for n in sizes)]  # Whole lines.
        raw = torch.empty(starts[-1] + 64, dtype=torch.uint8)
        self.buffer = raw[-raw.data_ptr() % 64 :]
        self.views = [
            (self.buffer[at : at + n].view(t.dtype).view(t.shape), t)
            for t, at, n in zip(tensors.values(), starts, sizes)
        ]

    def __call__(self) -> None:
        for dst, src in self.views:
            dst.copy_(src)


def measure_stall_and_persist(
    state, loop: TrainingLoop, directory: str, repeat: int
) -> dict[str, float]:
    """Our stall and the memcpy baseline, measured alternately under the same conditions."""
    memcpy = Memcpy(state)
    memcpy()
    saver = Saver(max_to_keep=2)
    sess = Session(state)
    path = os.path.join(directory, "ours", "model.ckpt")
    os.makedirs(os.path.dirname(path))
    first_stall = timed(lambda: saver.save_async(sess, path, global_step=0).result())
    copies, stalls, commits, totals = [], [], [], []
    for step in range(1, repeat + 1):
        between_checkpoints(state, loop)
        copies.append(timed(memcpy))
        between_checkpoints(state, loop)
        t0 = time.perf_counter()
        future = saver.save_async(sess, path, global_step=step)
        stalls.append(time.perf_counter() - t0)
        future.result()
        commits.append(saver.last_save.commit_secs)
        totals.append(saver.last_save.total_secs)
    return {
        "memcpy_secs": statistics.median(copies),
        "stall_secs": statistics.median(stalls),
        "first_stall_secs": first_stall,
        "commit_secs": statistics.median(commits),
        "total_secs": statistics.median(totals),
        "bytes": saver.last_save.bytes_written,
        "prefix": f"{path}-{repeat}",
    }


def measure_torch_save(state, directory: str, repeat: int) -> tuple[float, str]:
    path = os.path.join(directory, "torch_save.pt")

    def save() -> None:
        sd = {"model": state["model"].state_dict(), "optimizer": state["optimizer"].state_dict()}
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())

    return best([timed(save) for _ in range(repeat)]), path


def measure_safetensors(state, directory: str, repeat: int) -> float:
    path = os.path.join(directory, "weights.safetensors")
    tensors = {k: v.contiguous() for k, v in state_tensors(state).items()}

    def save() -> None:
        safetensors.torch.save_file(tensors, path)
        fsync_path(path)

    return best([timed(save) for _ in range(repeat)])


def measure_dcp(state, directory: str, repeat: int) -> dict[str, float]:
    stalls, totals = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(repeat):
            _dcp_once(state, os.path.join(directory, f"dcp{i}"), stalls, totals)
    return {"stall_secs": best(stalls), "total_secs": best(totals)}


def _dcp_once(state, target: str, stalls: list[float], totals: list[float]) -> None:
    sd = {"model": state["model"].state_dict(), "optimizer": state["optimizer"].state_dict()}
    t0 = time.perf_counter()
    future = dcp.async_save(sd, checkpoint_id=target)
    t1 = time.perf_counter()
    future.result()
    totals.append(time.perf_counter() - t0)
    stalls.append(t1 - t0)
    shutil.rmtree(target)


def measure_raw_write(nbytes: int, directory: str, repeat: int) -> float:
    """Buffered sequential write of ``nbytes`` + fsync (what ``dd conv=fsync`` does).

    The median of ``repeat`` writes, like our commit time it is compared with (the
    alternatives' stalls are their best runs instead: the comparison favours them).
    """
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    view = memoryview(data.numpy())
    path = os.path.join(directory, "raw.bin")
    chunk = 16 << 20

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for start in range(0, nbytes, chunk):
                os.write(fd, view[start : start + chunk])
            os.fsync(fd)
        finally:
            os.close(fd)

    secs = statistics.median([timed(write) for _ in range(repeat)])
    os.remove(path)
    return secs


def measure_training(state, directory: str, rounds: int) -> dict[str, float]:
    """Steps/s of the loop while our writer persists the state, and with nothing in flight.

    Alternating rounds of the same length (at least 0.5 s, and at least two persists): in a
    busy round, a save is started at the step boundary after the previous one committed, so a
    checkpoint is being written during the whole round; the snapshots themselves (the stall,
    reported on its own) are left out of the time, as are the idle rounds' loop overheads: both
    rates are steps over the time spent in steps. The medians of ``rounds`` alternations (12 or
    more: on a shared virtual machine the speed of the loop itself drifts by several percent
    between seconds).
    """
    path = os.path.join(directory, "training", "model.ckpt")
    os.makedirs(os.path.dirname(path))
    return measure_training_at(state, path, rounds)


@contextlib.contextmanager
def cpu_load(processes: int) -> Iterator[list[subprocess.Popen]]:
    """``processes`` CPU-bound processes at normal priority beside the benchmark: a machine
    that is not idle (another job, data-loader workers). Yields them; killed on exit."""
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)
    ]
    try:
        yield burners
    finally:
        for burner in burners:
            burner.kill()
        for burner in burners:
            burner.wait()


def measure_training_loaded(state, directory: str, rounds: int, load: int) -> dict[str, Any]:
    """``measure_training`` with ``load`` CPU-bound processes beside the loop in every round.

    Also a control: the same alternation with no save in the busy rounds either, which shows
    how far the loaded loop's speed moves between rounds by itself.
    """
    path = os.path.join(directory, "training-loaded", "model.ckpt")
    os.makedirs(os.path.dirname(path))
    with cpu_load(load):
        saving = measure_training_at(state, path, rounds)
        control = measure_training_at(state, path, rounds, save=False)
    return {**saving, "control_paired_ratio": control["paired_ratio"], "load_processes": load}


def measure_training_at(state, path: str, rounds: int, save: bool = True) -> dict[str, float]:
    """``measure_training`` with checkpoints saved to ``path`` (a prefix; a URL too).

    ``save`` False: no save in the busy rounds either (a control of the alternation itself).
    """
    loop = TrainingLoop()
    loop.steps_per_sec(0.5)  # Warm-up.
    saver = Saver(max_to_keep=1)
    sess = Session(state)
    t0 = time.perf_counter()
    saver.save(sess, path, global_step=0)  # Allocates the staging buffers.
    window = max(0.5, 2 * (time.perf_counter() - t0))
    step = 0

    def timed_steps(keep_saving: bool) -> float:
        nonlocal step
        steps, secs, future = 0, 0.0, None
        start = time.perf_counter()
        while time.perf_counter() - start < window:
            if keep_saving and (future is None or future.done()):
                # No touch(): trainable tensors are copied at every save anyway.
                step += 1
                future = saver.save_async(sess, path, global_step=step)
            t = time.perf_counter()
            loop.step()
            secs += time.perf_counter() - t
            steps += 1
        if future is not None:
            future.result()  # The idle round starts with nothing in flight.
        return steps / secs

    busy, idle = [], []
    for _ in range(rounds):
        busy.append(timed_steps(save))
        idle.append(timed_steps(False))
    idle.append(timed_steps(False))
    # Each busy round against the idle rounds on either side of it: the machine's own speed
    # drifts between seconds, and pairing neighbours cancels most of it.
    paired = [b / ((idle[i - 1] + idle[i]) / 2) if i else b / idle[0] for i, b in enumerate(busy)]
    return {
        "steps_per_sec_idle": statistics.median(idle),
        "steps_per_sec_persisting": statistics.median(busy),
        "paired_ratio": statistics.median(paired),
        "paired_ratios": paired,
        "saves": step,
    }


def _restore_in_fresh_process(which: str, size_bytes: int, source: str, cold: bool) -> float:
    """Time one restore in a new process (a restart): build the model, then load into it."""
    code = f"""
import sys, time
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import torch
from checkpoint import build_state, drop_from_page_cache, warm_page_cache
from torchsupervisor import Saver, Session
from torchsupervisor.checkpoint.policy import default_full_save_interval
state = build_state({size_bytes})
(drop_from_page_cache if {cold} else warm_page_cache)({os.path.dirname(source)!r})
t0 = time.perf_counter()
if {which!r} == "ours":
    Saver().restore(Session(state), {source!r})
else:
    sd = torch.load({source!r}, weights_only=True)
    state["model"].load_state_dict(sd["model"])
    state["optimizer"].load_state_dict(sd["optimizer"])
print(time.perf_counter() - t0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def measure_restore(
    size_bytes: int, ours_prefix: str, torch_path: str, repeat: int
) -> dict[str, float]:
    """Restore time in fresh processes, cold and warm page cache, alternating ours/baseline.

    Both files are read once first. "Cold" means: not in this machine's page cache (each file
    is fsynced and evicted with ``POSIX_FADV_DONTNEED`` in the fresh process, before the
    clock starts): a restart on another machine, the common case after a preemption. On a
    virtual machine the host has its own cache, which this machine cannot drop: a cold read
    may come from the host's memory or from its disk, depending on what the host read last
    (the same file, cold, took 0.3 s or 1.4 s depending on what the previous process read).
    So the order alternates (ours first in even rounds, ``torch.load`` first in odd ones) and
    the figures are medians of ``repeat`` rounds.
    """
    for path in (ours_prefix, torch_path):
        warm_page_cache(os.path.dirname(path))
    results: dict[str, list[float]] = {}
    for cold in (True, False):
        for round_ in range(repeat):
            pair = [("ours", ours_prefix), ("torch_load", torch_path)]
            for which, source in pair if round_ % 2 == 0 else pair[::-1]:
                key = f"{which}_{'cold' if cold else 'warm'}_secs"
                secs = _restore_in_fresh_process(which, size_bytes, source, cold)
                results.setdefault(key, []).append(secs)
    return {key: statistics.median(values) for key, values in results.items()}


def measure_incremental(size_bytes: int, directory: str) -> dict[str, Any]:
    """A frozen backbone (the state above) and a trainable head: bytes of each save.

    With the default ``max_to_keep=5`` the saves go full, full, then a cycle of three
    incremental saves and a full one. Measured: the first incremental save (the third save)
    and the average over one cycle in steady state (saves 2 to ``K + 1``: one full save and
    ``K - 1`` incremental ones, ``K`` being the saver's full-save interval).
    """
    torch.manual_seed(0)
    backbone = build_state(size_bytes)["model"].requires_grad_(False)
    width = backbone[0].in_features
    head = nn.Linear(width, 10)
    model = nn.Sequential(backbone, head)
    opt = torch.optim.Adam(head.parameters(), lr=1e-3)
    state = {"model": model, "optimizer": opt}
    saver = Saver(max_to_keep=5)
    interval = default_full_save_interval(5)  # Saves per chain: 4.
    sess = Session(state)
    path = os.path.join(directory, "incremental", "model.ckpt")
    os.makedirs(os.path.dirname(path))

    def train() -> None:
        opt.zero_grad()
        model(torch.randn(4, width)).pow(2).mean().backward()
        opt.step()

    written = []
    secs = []
    for step in range(1, interval + 2):
        train()
        t0 = time.perf_counter()
        saver.save(sess, path, global_step=step)
        secs.append(time.perf_counter() - t0)
        written.append(saver.last_save.bytes_written)
    cycle = written[1:]
    return {
        "full_bytes": written[0],
        "incremental_bytes": written[2],
        "secs": secs[2],
        "cycle_saves": len(cycle),
        "cycle_average_bytes": sum(cycle) / len(cycle),
        "bytes_per_save": written,
    }


def stall_row(state, label: str, directory: str, repeat: int) -> dict[str, Any]:
    """A row of results begun: the state's size and tensors, our stall and the memcpy."""
    tensors = state_tensors(state)
    nbytes = tensor_bytes(tensors)
    print(f"{label} {nbytes / MB:,.0f} MB ({len(tensors)} tensors)", file=sys.stderr)
    row: dict[str, Any] = {"state_bytes": nbytes, "tensors": len(tensors)}
    row["ours"] = measure_stall_and_persist(state, TrainingLoop(), directory, repeat)
    row["memcpy_secs"] = row["ours"].pop("memcpy_secs")
    return row


def run_size(size_bytes: int, root: str, repeat: int, load: int = 0) -> dict[str, Any]:
    directory = tempfile.mkdtemp(prefix="ckpt-bench-", dir=root)
    try:
        state = build_state(size_bytes)
        small = (
            tensor_bytes(state_tensors(state)) < 200 * MB
        )  # Short timings: more rounds for a stable median.
        row = stall_row(state, "state", directory, repeat * (4 if small else 1))
        row["torch_save_secs"], torch_path = measure_torch_save(state, directory, repeat)
        row["safetensors_secs"] = measure_safetensors(state, directory, repeat)
        row["dcp"] = measure_dcp(state, directory, repeat)
        row["raw_write_secs"] = measure_raw_write(
            row["ours"]["bytes"], directory, repeat * (4 if small else 1)
        )
        row["training"] = measure_training(state, directory, rounds=max(12, repeat))
        if load:
            row["training_loaded"] = measure_training_loaded(
                state, directory, max(24, repeat), load
            )
        row["restore"] = measure_restore(size_bytes, row["ours"]["prefix"], torch_path, repeat)
        del state
        gc.collect()
        row["incremental"] = measure_incremental(size_bytes, directory)
        return row
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_blocks(
    size_bytes: int, root: str, repeat: int, rounds: int | None = None
) -> dict[str, Any]:
    """The many-tensor case: stall against the memcpy and ``dcp.async_save``, training speed
    while it persists (``rounds`` busy/idle rounds; None: 12 or ``repeat``)."""
    directory = tempfile.mkdtemp(prefix="ckpt-bench-blocks-", dir=root)
    try:
        state = build_blocks_state(size_bytes)
        row = stall_row(state, "blocks state", directory, 4 * repeat)
        row["dcp"] = measure_dcp(state, directory, repeat)
        row["training"] = measure_training(state, directory, rounds or max(12, repeat))
        return row
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def blocks_ratios(row: dict[str, Any]) -> dict[str, float]:
    ours = row["ours"]
    return {
        "stall_vs_memcpy": ours["stall_secs"] / row["memcpy_secs"],
        "stall_vs_dcp": ours["stall_secs"] / row["dcp"]["stall_secs"],
        "steps_per_sec_ratio": row["training"]["paired_ratio"],
    }


def print_blocks_table(rows: list[dict[str, Any]]) -> None:
    print()
    print("Many small tensors (LayerNorm + Linear blocks and Adam): stall in ms, training speed")
    print(
        f"{'state MB':>9} {'tensors':>8} {'memcpy':>8} {'ours':>8} {'ratio':>6} "
        f"{'dcp async':>9} {'x dcp':>6} {'steps/s':>8} {'while':>8} {'ratio':>6}"
    )
    for row in rows:
        r, training = blocks_ratios(row), row["training"]
        print(
            f"{row['state_bytes'] / MB:9.0f} {row['tensors']:8d} "
            f"{row['memcpy_secs'] * 1000:8.1f} {row['ours']['stall_secs'] * 1000:8.1f} "
            f"{r['stall_vs_memcpy']:6.2f} {row['dcp']['stall_secs'] * 1000:9.1f} "
            f"{r['stall_vs_dcp']:6.2f} {training['steps_per_sec_idle']:8.1f} "
            f"{training['steps_per_sec_persisting']:8.1f} {r['steps_per_sec_ratio']:6.2f}"
        )


def ratios(row: dict[str, Any]) -> dict[str, float]:
    ours = row["ours"]
    training = row["training"]
    return {
        "stall_vs_memcpy": ours["stall_secs"] / row["memcpy_secs"],
        # The median of busy rounds over their idle neighbours (see measure_training).
        "steps_per_sec_ratio": training["paired_ratio"],
        "persist_vs_raw_write": row["raw_write_secs"] / ours["commit_secs"],
        "restore_vs_torch_load": row["restore"]["ours_warm_secs"]
        / row["restore"]["torch_load_warm_secs"],
        "restore_vs_torch_load_cold": row["restore"]["ours_cold_secs"]
        / row["restore"]["torch_load_cold_secs"],
        "incremental_fraction": row["incremental"]["incremental_bytes"]
        / row["incremental"]["full_bytes"],
        "incremental_cycle_fraction": row["incremental"]["cycle_average_bytes"]
        / row["incremental"]["full_bytes"],
    }


TARGETS = {
    "stall_vs_memcpy": ("<=", 1.5, 0),
    "steps_per_sec_ratio": (">=", 0.95, 0),
    "persist_vs_raw_write": (">=", 0.80, 0),
    "restore_vs_torch_load": ("<=", 1.2, 0),
    "restore_vs_torch_load_cold": ("<=", 1.0, 400 * MB),  # Issue 16: at 500 MB and 2 GB.
    "incremental_fraction": ("<", 0.10, 0),
}
"""Each ratio's target: (comparison, bound, the smallest state in bytes it is checked at)."""


def print_table(rows: list[dict[str, Any]]) -> None:
    def ms(secs: float) -> str:
        return f"{secs * 1000:9.1f}"

    print()
    print("Stall per checkpoint (ms; the training thread is blocked this long)")
    print(
        f"{'state MB':>9} {'memcpy':>9} {'ours':>9} {'ratio':>6} {'torch.save':>10} "
        f"{'safetens.':>9} {'dcp async':>9}"
    )
    for row in rows:
        r = ratios(row)
        print(
            f"{row['state_bytes'] / MB:9.0f} {ms(row['memcpy_secs'])} "
            f"{ms(row['ours']['stall_secs'])} {r['stall_vs_memcpy']:6.2f} "
            f"{ms(row['torch_save_secs']):>10} "
            f"{ms(row['safetensors_secs'])} {ms(row['dcp']['stall_secs'])}"
        )
    print()
    print("Background persist, training speed, restore, incremental")
    print(
        f"{'state MB':>9} {'ours MB/s':>10} {'raw MB/s':>9} {'ratio':>6} {'steps/s':>8} "
        f"{'while':>8} {'ratio':>6} {'restore ms':>10} {'torch.load':>10} {'ratio':>6} "
        f"{'incr. %':>8}"
    )
    for row in rows:
        r = ratios(row)
        ours, training, restore = row["ours"], row["training"], row["restore"]
        print(
            f"{row['state_bytes'] / MB:9.0f} {ours['bytes'] / ours['commit_secs'] / MB:10.0f} "
            f"{ours['bytes'] / row['raw_write_secs'] / MB:9.0f} {r['persist_vs_raw_write']:6.2f} "
            f"{training['steps_per_sec_idle']:8.1f} {training['steps_per_sec_persisting']:8.1f} "
            f"{r['steps_per_sec_ratio']:6.2f} {ms(restore['ours_warm_secs']):>10} "
            f"{ms(restore['torch_load_warm_secs']):>10} {r['restore_vs_torch_load']:6.2f} "
            f"{100 * r['incremental_fraction']:8.2f}"
        )
    loaded = [row for row in rows if "training_loaded" in row]
    if loaded:
        print()
        print("Training speed beside CPU-bound processes (control: no saves in either round)")
        print(
            f"{'state MB':>9} {'load':>5} {'steps/s':>8} {'while':>8} {'ratio':>6} "
            f"{'saves':>6} {'control':>8}"
        )
        for row in loaded:
            t = row["training_loaded"]
            print(
                f"{row['state_bytes'] / MB:9.0f} {t['load_processes']:5d} "
                f"{t['steps_per_sec_idle']:8.1f} {t['steps_per_sec_persisting']:8.1f} "
                f"{t['paired_ratio']:6.2f} {t['saves']:6d} {t['control_paired_ratio']:8.2f}"
            )
    print()
    print("Incremental checkpoints of a frozen backbone (bytes written, % of a full save)")
    print(f"{'state MB':>9} {'full MB':>9} {'incr. %':>8} {'cycle':>6} {'cycle avg %':>11}")
    for row in rows:
        r, incremental = ratios(row), row["incremental"]
        print(
            f"{row['state_bytes'] / MB:9.0f} {incremental['full_bytes'] / MB:9.1f} "
            f"{100 * r['incremental_fraction']:8.2f} {incremental['cycle_saves']:6d} "
            f"{100 * r['incremental_cycle_fraction']:11.2f}"
        )
    print()
    print("Restore from a cold page cache (ms, medians; see the note in measure_restore)")
    print(f"{'state MB':>9} {'ours':>9} {'torch.load':>10} {'ratio':>6}")
    for row in rows:
        restore = row["restore"]
        print(
            f"{row['state_bytes'] / MB:9.0f} {ms(restore['ours_cold_secs'])} "
            f"{ms(restore['torch_load_cold_secs']):>10} "
            f"{ratios(row)['restore_vs_torch_load_cold']:6.2f}"
        )
    print()
    print("Targets (SPEC section 7, issue 16) at every size (cold restore: from 400 MB):")
    for key, (op, bound, min_bytes) in TARGETS.items():
        values = [ratios(row)[key] for row in rows if row["state_bytes"] >= min_bytes]
        ok = all(
            (v <= bound) if op == "<=" else (v >= bound) if op == ">=" else (v < bound)
            for v in values
        )
        shown = ", ".join(f"{v:.3f}" for v in values)
        print(f"  {key:24s} {op} {bound:<5} {'met' if ok else 'NOT MET':8s} [{shown}]")


def machine_facts() -> dict[str, Any]:
    """What a report says of the machine it ran on."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10MB,100MB,500MB,2GB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: benchmarks/results)")
    parser.add_argument("--json", default=None, help="output file")
    parser.add_argument(
        "--load",
        type=int,
        default=0,
        help="also measure training speed with this many CPU-bound processes beside it",
    )
    parser.add_argument(
        "--blocks-sizes",
        default="50MB",
        help="sizes of the case of a state of many small tensors ('' for none)",
    )
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    results_dir = os.path.join(here, "results")
    os.makedirs(results_dir, exist_ok=True)
    root = args.dir or results_dir
    sizes = [s for s in args.sizes.split(",") if s]
    rows = [run_size(parse_size(s), root, args.repeat, args.load) for s in sizes]
    blocks = [
        run_blocks(parse_size(s), root, args.repeat) for s in args.blocks_sizes.split(",") if s
    ]
    if rows:
        print_table(rows)
    if blocks:
        print_blocks_table(blocks)
    report = {
        "machine": machine_facts(),
        "rows": [{**row, "ratios": ratios(row)} for row in rows],
        "blocks_rows": [{**row, "ratios": blocks_ratios(row)} for row in blocks],
    }
    out = args.json or os.path.join(results_dir, "checkpoint.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
