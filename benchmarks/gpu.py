"""GPU checkpoint benchmark: the stall of a CUDA state's save and training's speed while saves
persist, ours against ``torch.distributed.checkpoint.async_save``, in the same run.

    python benchmarks/gpu.py                                  # 100 MB and 1 GB on CUDA
    python benchmarks/gpu.py --device cpu --sizes 10MB        # the same code on the CPU

The state is ``checkpoint.py``'s MLP and Adam state (parameters, ``exp_avg``, ``exp_avg_sq``)
on the device. For each size it measures:

* *memcpy*: one device-to-host copy of every tensor into host buffers allocated beforehand
  (pinned on a GPU; ``non_blocking`` copies, then one synchronization): the least a save whose
  bytes the next step must not change can block training for.
* *stall*: how long ``Saver.save_async`` blocks the training thread (steady state, median of
  ``--repeat``), and ``dcp.async_save`` with one ``DefaultStager`` kept across saves (pinned
  memory and ``non_blocking`` copies on a GPU, staging before it returns, so that the next step
  may change the state); *persist*: the time to commit (ours) or to finish (DCP's).
* *steps/s*: the state's own model trains on the device (forward, backward, Adam step on a
  random batch), saves back to back (the next one started at the first step boundary after
  the last has finished; its stall counts as training time lost), in rounds that alternate
  with rounds of as many seconds without saves; ours and DCP's take turns within each round.
  The ratio is the median over rounds of a busy round's steps/s over the idle round's just
  before it, with a 95% interval for that median (``distributed.median_interval``).

It prints a table and writes JSON (``--json``, default ``benchmarks/results/gpu.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torchsupervisor import Saver, Session

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint import MB, build_state, parse_size, state_tensors, tensor_bytes
from distributed import median_interval

BATCH = 256
"""Rows of the random batch of a training step."""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostCopy:
    """One device-to-host copy of the state into buffers allocated once (the *memcpy*)."""

    def __init__(self, state: dict[str, Any], device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        self.pairs = [
            (torch.empty(t.shape, dtype=t.dtype, pin_memory=pin), t)
            for t in state_tensors(state).values()
        ]

    def __call__(self) -> None:
        with torch.no_grad():
            for dst, src in self.pairs:
                dst.copy_(src, non_blocking=self.device.type == "cuda")
        synchronize(self.device)


class Trainer:
    """Training steps of the state's own model on the device."""

    def __init__(self, state: dict[str, Any], device: torch.device) -> None:
        self.model, self.optimizer = state["model"], state["optimizer"]
        width = self.model[0].in_features
        torch.manual_seed(2)
        self.x = torch.randn(BATCH, width, device=device)
        self.device = device

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model(self.x).pow(2).mean().backward()
        self.optimizer.step()


def to_device(state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``state`` with its model and optimizer state on ``device``."""
    state["model"].to(device)
    for per_param in state["optimizer"].state.values():
        for key, value in per_param.items():
            if torch.is_tensor(value) and value.dim() > 0:  # ``step`` stays on the CPU.
                per_param[key] = value.to(device)
    return state


def _dcp_saver(state: dict[str, Any], directory: str, device: torch.device) -> Callable[[], Any]:
    """A function that starts one ``dcp.async_save`` of ``state`` and returns its future."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    on_gpu = device.type == "cuda"
    # use_pinned_memory, use_shared_memory, use_async_staging, use_non_blocking_copy.
    stager = DefaultStager(StagingOptions(on_gpu, False, False, on_gpu))
    count = [0]

    def save() -> Any:
        count[0] += 1
        sd = {"model": state["model"].state_dict(), "optimizer": state["optimizer"].state_dict()}
        target = os.path.join(directory, f"dcp{count[0] % 2}")
        writer = dcp.FileSystemWriter(target, overwrite=True)
        return dcp.async_save(sd, storage_writer=writer, async_stager=stager)

    return save


def measure_stalls(
    start: Callable[[], Any], trainer: Trainer, repeat: int
) -> tuple[list[float], list[float]]:
    """Stalls and totals of ``repeat`` saves, each after a training step."""
    start().result()  # Warm-up: buffers, caches.
    stalls, totals = [], []
    for _ in range(repeat):
        trainer.step()
        synchronize(trainer.device)
        t0 = time.perf_counter()
        future = start()
        stalls.append(time.perf_counter() - t0)
        future.result()
        totals.append(time.perf_counter() - t0)
    return stalls, totals


def steps_per_sec(trainer: Trainer, window: float, start: Callable[[], Any] | None) -> float:
    """Steps/s over ``window`` seconds, with saves back to back if ``start`` is given."""
    steps, future = 0, None
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < window:
        if start is not None and (future is None or future.done()):
            future = start()
        trainer.step()
        steps += 1
    synchronize(trainer.device)
    elapsed = time.perf_counter() - t0
    if future is not None:
        future.result()  # The next round starts with nothing in flight.
    return steps / elapsed


def run_size(size: int, device: torch.device, root: str, repeat: int, rounds: int) -> dict:
    """Every figure for one state size."""
    state = to_device(build_state(size), device)
    trainer = Trainer(state, device)
    directory = tempfile.mkdtemp(prefix="gpu-", dir=root)
    try:
        copy = HostCopy(state, device)
        copy()
        copies = []
        for _ in range(repeat):
            trainer.step()
            synchronize(device)
            t0 = time.perf_counter()
            copy()
            copies.append(time.perf_counter() - t0)
        saver, sess = Saver(max_to_keep=1), Session(state)
        step = [0]

        prefix = os.path.join(directory, "model.ckpt")

        def ours() -> Any:
            step[0] += 1
            return saver.save_async(sess, prefix, global_step=step[0])

        saves = {"ours": ours, "dcp": _dcp_saver(state, directory, device)}
        row: dict[str, Any] = {
            "size_bytes": tensor_bytes(state_tensors(state)),
            "device": str(device),
            "memcpy_secs": statistics.median(copies),
        }
        for name, start in saves.items():
            stalls, totals = measure_stalls(start, trainer, repeat)
            row[name] = {
                "stall_secs": statistics.median(stalls),
                "total_secs": statistics.median(totals),
                "rounds": [],
            }
        window = max(0.5, 2 * max(row[n]["total_secs"] for n in saves))
        steps_per_sec(trainer, window, None)  # Warm-up.
        for _ in range(rounds):
            for name, start in saves.items():
                idle = steps_per_sec(trainer, window, None)
                busy = steps_per_sec(trainer, window, start)
                row[name]["rounds"].append({"idle": idle, "busy": busy, "ratio": busy / idle})
        for name in saves:
            figures = row[name]
            figures["stall_vs_memcpy"] = figures["stall_secs"] / row["memcpy_secs"]
            figures["steps_ratio"] = median_interval([r["ratio"] for r in figures["rounds"]])
        row["stall_vs_dcp"] = row["ours"]["stall_secs"] / row["dcp"]["stall_secs"]
        saver.close()
        return row
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'':5s} {'state MB':>8s} {'memcpy ms':>9s} {'stall ms':>8s} {'x memcpy':>8s} "
        f"{'x dcp':>6s} {'persist ms':>10s} {'steps/s ratio (95% interval)':>30s}"
    )
    for row in rows:
        for name in ("ours", "dcp"):
            r, ratio = row[name], row[name]["steps_ratio"]
            interval = (
                f"{ratio['median']:.3f} ({ratio['low']:.3f}-{ratio['high']:.3f})"
                if ratio["low"] is not None
                else f"{ratio['median']:.3f}"
            )
            x_dcp = f"{row['stall_vs_dcp']:.2f}" if name == "ours" else "1.00"
            print(
                f"{name:5s} {row['size_bytes'] / MB:>8.0f} {row['memcpy_secs'] * 1e3:>9.2f} "
                f"{r['stall_secs'] * 1e3:>8.2f} {r['stall_vs_memcpy']:>8.2f} {x_dcp:>6s} "
                f"{r['total_secs'] * 1e3:>10.1f} {interval:>30s}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--sizes", default="100MB,1GB")
    parser.add_argument("--repeat", type=int, default=10, help="saves whose stall is timed")
    parser.add_argument("--rounds", type=int, default=12, help="busy/idle rounds of steps/s")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=os.path.join("benchmarks", "results", "gpu.json"))
    args = parser.parse_args(argv)
    # DCP without a process group warns at every save, from its own thread too.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("No CUDA device: run with --device cpu for the same code on the CPU")
        return 2
    rows = [
        run_size(parse_size(s), device, args.dir or tempfile.gettempdir(), args.repeat, args.rounds)
        for s in args.sizes.split(",")
    ]
    print_table(rows)
    facts = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpus": os.cpu_count(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": facts, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
