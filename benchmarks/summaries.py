"""Summary benchmark: our SummaryWriter against torch.utils.tensorboard and tensorboardX, same run.

    python benchmarks/summaries.py              # about 5 minutes on 2 busy cores
    python benchmarks/summaries.py --quick      # fewer events and repeats (a smoke run)

Every writer gets the same stream, in the same process, in the same directory, repeated
``--repeat`` times in interleaved order (ours, torch, tensorboardX, ours, ...); the tables show
medians and, in the JSON, every run (so the noise of a shared machine can be judged):

* scalars, tight loop: ``add_scalar(tag, float, step)`` over 4 tags, ``--scalars`` calls in a
  row. Caller cost = time in the loop / calls (the training thread's cost, including the GIL
  time the writer thread takes meanwhile); written/s = calls / (time from the first call until
  ``close()`` returned: every event encoded, framed, written and fsynced). The events are read
  back and counted.
* scalars in a training loop: ``--steps`` steps of GIL-free work (a matrix product, as a
  training step mostly is) each followed by 10 ``add_scalar`` calls: caller cost per call
  (timed around the calls), steps/s against the same loop without summaries.
* scalar tensors: the tight loop with 0-d CPU tensors as values.
* histograms: ``add_histogram`` of a 10,000-value float32 tensor; images: ``add_image`` of a
  3x128x128 float tensor (caller cost per call, events written per second).
* our writer alone: the queue filled while the writer thread is held, then drained: the
  encode+write throughput with no producer competing for the GIL.
* our writer thread's CPU priority: the training-loop case with more summaries per step, the
  writer thread at nice 0 and at nice 19 (as the checkpoint writer runs): steps/s and the
  99th percentile of a step's time (a low-priority thread holding the GIL stalls the loop).

Our writer runs as a user creates it, ``SummaryWriter(logdir)`` (its default queue is
``DEFAULT_MAX_QUEUE``, 16384 events, as the Supervisor's: the targets are checked on that one),
and with TF's ``max_queue=10`` given explicitly; torch and tensorboardX with their defaults
(``max_queue=10``, ``flush_secs=120``). It prints the tables and writes the figures as JSON
(``--json``, default ``benchmarks/results/summaries.json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from torchsupervisor.summary import SummaryWriter, records
from torchsupervisor.summary.writer import DEFAULT_MAX_QUEUE

TAGS = ("train/loss", "train/accuracy", "train/learning_rate", "global_step/sec")
TARGET_CALLER_US = 2.0
TARGET_WRITTEN_PER_SEC = 200_000
TARGET_VS_TORCH = 10.0
OURS = "ours (defaults)"


# ------------------------------------------------------------------------------------ writers


def ours(max_queue: int | None = None, niceness: int = 0) -> Callable[[str], Any]:
    """Our writer as a user makes it (``max_queue`` None: left to its default)."""

    class Writer(SummaryWriter):
        thread_niceness = niceness

    if max_queue is None:
        return lambda logdir: Writer(logdir)
    return lambda logdir: Writer(logdir, max_queue=max_queue)


def torch_writer(logdir: str) -> Any:
    from torch.utils.tensorboard import SummaryWriter as TorchSummaryWriter

    return TorchSummaryWriter(logdir)


def tbx_writer(logdir: str) -> Any:
    import tensorboardX

    return tensorboardX.SummaryWriter(logdir)


WRITERS: dict[str, Callable[[str], Any]] = {
    OURS: ours(),
    "ours (max_queue=10, TF)": ours(10),
    "torch.utils.tensorboard": torch_writer,
    "tensorboardX": tbx_writer,
}


def count_events(logdir: str) -> int:
    """The number of records after the first (file_version) one, over all events files."""
    total = 0
    for root, _, names in os.walk(logdir):
        for name in names:
            if "tfevents" in name:
                total += sum(1 for _ in records.read_records(os.path.join(root, name))) - 1
    return total


class Dir:
    """A fresh empty directory for one run, removed afterwards."""

    def __init__(self, root: str) -> None:
        self.path = tempfile.mkdtemp(dir=root)

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


# --------------------------------------------------------------------------------- the streams


def stream_tight(make: Callable[[str], Any], root: str, n: int, values: list[Any]) -> dict:
    """``n`` add_scalar calls in a row; the values cycle through ``values``."""
    with Dir(root) as logdir:
        writer = make(logdir)
        k = len(values)
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            for i in range(n):
                writer.add_scalar(TAGS[i & 3], values[i % k], i)
            loop = time.perf_counter() - start
            writer.close()
            total = time.perf_counter() - start
        finally:
            gc.enable()
        written = count_events(logdir)
    return {
        "caller_us": loop / n * 1e6,
        "written_per_sec": n / total,
        "events_written": written,
    }


def stream_objects(
    make: Callable[[str], Any], root: str, method: str, objects: list[Any], n: int
) -> dict:
    """``n`` calls of ``add_histogram`` or ``add_image`` with pre-built tensors."""
    with Dir(root) as logdir:
        writer = make(logdir)
        add = getattr(writer, method)
        k = len(objects)
        gc.collect()
        start = time.perf_counter()
        for i in range(n):
            add("weights" if method == "add_histogram" else "samples", objects[i % k], i)
        loop = time.perf_counter() - start
        writer.close()
        total = time.perf_counter() - start
        written = count_events(logdir)
    return {"caller_us": loop / n * 1e6, "written_per_sec": n / total, "events_written": written}


class Work:
    """A GIL-free stand-in for a training step: a float32 matrix product."""

    def __init__(self, size: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.a = torch.randn(size, size, generator=gen)
        self.b = torch.randn(size, size, generator=gen)
        self.out = torch.empty(size, size)

    def __call__(self) -> None:
        torch.mm(self.a, self.b, out=self.out)


def stream_training(
    make: Callable[[str], Any] | None,
    root: str,
    steps: int,
    work: Work,
    per_step: int,
    histogram_every: int = 0,
) -> dict:
    """Training-like loop: GIL-free work, then ``per_step`` add_scalar calls per step."""
    tags = [f"metrics/m{j}" for j in range(per_step)]
    weights = torch.randn(10_000)
    with Dir(root) as logdir:
        writer = make(logdir) if make is not None else None
        step_secs = []
        call_secs = 0.0
        perf = time.perf_counter
        gc.collect()
        start = perf()
        for step in range(steps):
            t0 = perf()
            work()
            if writer is not None:
                c0 = perf()
                for j in range(per_step):
                    writer.add_scalar(tags[j], 0.25 * j + step, step)
                if histogram_every and step % histogram_every == 0:
                    writer.add_histogram("weights", weights, step)
                call_secs += perf() - c0
            step_secs.append(perf() - t0)
        loop = perf() - start
        if writer is not None:
            writer.close()
    calls = steps * per_step + (steps // histogram_every + 1 if histogram_every else 0)
    return {
        "steps_per_sec": steps / loop,
        "caller_us": call_secs / calls * 1e6 if writer is not None else 0.0,
        "step_ms_p50": float(np.percentile(step_secs, 50)) * 1e3,
        "step_ms_p99": float(np.percentile(step_secs, 99)) * 1e3,
    }


def stream_drain(root: str, n: int) -> dict:
    """Fill our queue while the writer thread is held, then time the drain alone."""
    from torchsupervisor.testing import GatedStorage

    storage = GatedStorage()
    gate = storage.hold("write", timeout_secs=600)  # The first write waits for the gate.
    with Dir(root) as logdir:
        try:
            writer = SummaryWriter(logdir, max_queue=0, storage=storage)
            writer.add_scalar(TAGS[0], 0.0, 0)
            while writer.counters().events_pending:  # the writer thread holds event 0
                time.sleep(0.001)
            for i in range(1, n):
                writer.add_scalar(TAGS[i & 3], 0.5 * i, i)
            start = time.perf_counter()
            gate.open()
            writer.close()
            secs = time.perf_counter() - start
        finally:
            gate.open()
        written = count_events(logdir)
    return {"written_per_sec": n / secs, "events_written": written}


# ------------------------------------------------------------------------------------ running


def median_of(runs: list[dict], key: str) -> float:
    return float(statistics.median(run[key] for run in runs))


def summarize(runs: list[dict]) -> dict:
    out: dict[str, Any] = {"runs": runs}
    for key in runs[0]:
        if key != "events_written":
            out[key] = median_of(runs, key)
            values = [run[key] for run in runs]
            out[key + "_spread"] = [float(min(values)), float(max(values))]
    if "events_written" in runs[0]:
        out["events_written"] = runs[0]["events_written"]
    return out


def interleaved(
    names: list[str], repeat: int, run: Callable[[str], dict], label: str
) -> dict[str, dict]:
    results: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(repeat):
        for name in names:
            print(f"  {label}: {name} (run {r + 1}/{repeat})", file=sys.stderr, flush=True)
            results[name].append(run(name))
    return {name: summarize(runs) for name, runs in results.items()}


def check_counts(section: dict[str, dict], expected: int) -> None:
    for name, row in section.items():
        for run in row["runs"]:
            if run.get("events_written", expected) != expected:
                raise AssertionError(
                    f"{name}: {run['events_written']} events written, expected {expected}"
                )


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    root = args.dir or tempfile.mkdtemp(prefix="summaries-bench-")
    os.makedirs(root, exist_ok=True)
    names = list(WRITERS)
    report: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "directory": root,
        },
        "config": vars(args).copy(),
        "targets": {
            "caller_us_max": TARGET_CALLER_US,
            "written_per_sec_min": TARGET_WRITTEN_PER_SEC,
            "caller_cost_vs_torch_min": TARGET_VS_TORCH,
            "default_max_queue": DEFAULT_MAX_QUEUE,
        },
    }
    floats = [0.5 + 1e-3 * i for i in range(1000)]
    report["scalars_tight"] = interleaved(
        names,
        args.repeat,
        lambda name: stream_tight(WRITERS[name], root, args.scalars, floats),
        "scalars, tight loop",
    )
    check_counts(report["scalars_tight"], args.scalars)

    tensors = [torch.tensor(v) for v in floats]
    n_tensors = args.scalars // 4
    report["scalars_tensor_values"] = interleaved(
        names,
        args.repeat,
        lambda name: stream_tight(WRITERS[name], root, n_tensors, tensors),
        "scalar tensors",
    )
    check_counts(report["scalars_tensor_values"], n_tensors)

    work = Work(args.work_size)
    per_step = 10
    baseline = summarize(
        [stream_training(None, root, args.steps, work, per_step) for _ in range(args.repeat)]
    )
    training = interleaved(
        names,
        args.repeat,
        lambda name: stream_training(WRITERS[name], root, args.steps, work, per_step),
        "training loop",
    )
    report["scalars_in_training_loop"] = {"no summaries": baseline, **training}

    histograms = [torch.randn(10_000) for _ in range(8)]
    report["histograms"] = interleaved(
        names,
        args.repeat,
        lambda name: stream_objects(WRITERS[name], root, "add_histogram", histograms, args.objects),
        "histograms",
    )
    check_counts(report["histograms"], args.objects)
    images = [torch.rand(3, 128, 128) for _ in range(8)]
    report["images"] = interleaved(
        names,
        args.repeat,
        lambda name: stream_objects(WRITERS[name], root, "add_image", images, args.objects),
        "images",
    )
    check_counts(report["images"], args.objects)

    report["our_writer_alone"] = summarize(
        [stream_drain(root, args.scalars) for _ in range(args.repeat)]
    )

    priority = {
        "nice 0": ours(None, 0),
        "nice 19": ours(None, 19),
    }
    heavy = interleaved(
        list(priority),
        args.repeat,
        lambda name: stream_training(
            priority[name], root, args.steps, work, 100, histogram_every=10
        ),
        "writer priority",
    )
    heavy_baseline = summarize(
        [stream_training(None, root, args.steps, work, 100) for _ in range(args.repeat)]
    )
    report["writer_thread_priority"] = {"no summaries": heavy_baseline, **heavy}
    report["verdict"] = verdict(report)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return report


def verdict(report: dict[str, Any]) -> dict[str, Any]:
    tight = report["scalars_tight"]
    ours_row = tight[OURS]
    torch_row = tight["torch.utils.tensorboard"]
    loop = report["scalars_in_training_loop"]
    return {
        "caller_us": ours_row["caller_us"],
        "caller_us_in_training_loop": loop[OURS]["caller_us"],
        "written_per_sec": ours_row["written_per_sec"],
        "caller_cost_vs_torch": torch_row["caller_us"] / ours_row["caller_us"],
        "caller_cost_vs_torch_in_training_loop": loop["torch.utils.tensorboard"]["caller_us"]
        / loop[OURS]["caller_us"],
        "met": {
            "caller_us": ours_row["caller_us"] <= TARGET_CALLER_US,
            "written_per_sec": ours_row["written_per_sec"] >= TARGET_WRITTEN_PER_SEC,
            "vs_torch": torch_row["caller_us"] / ours_row["caller_us"] >= TARGET_VS_TORCH,
        },
    }


# ----------------------------------------------------------------------------------- printing


def spread(row: dict, key: str) -> str:
    low, high = row[key + "_spread"]
    return f"{low:.3g}-{high:.3g}"


def print_section(title: str, section: dict[str, dict], columns: list[tuple[str, str, str]]):
    print(f"\n{title}")
    header = f"  {'writer':<28}" + "".join(f"{label:>22}" for label, _, _ in columns)
    print(header)
    for name, row in section.items():
        cells = []
        for _, key, fmt in columns:
            if key not in row:
                cells.append(f"{'-':>22}")
                continue
            cells.append(f"{format(row[key], fmt):>12} ({spread(row, key):>8})")
        print(f"  {name:<28}" + "".join(f"{c:>22}" for c in cells))


def print_report(report: dict[str, Any]) -> None:
    caller = ("caller us/call", "caller_us", ".3f")
    written = ("written/s", "written_per_sec", ",.0f")
    print(f"median of {report['config']['repeat']} runs (min-max in parentheses)")
    print_section(
        f"Scalars, tight loop ({report['config']['scalars']:,} add_scalar calls)",
        report["scalars_tight"],
        [caller, written],
    )
    print_section(
        "Scalars with 0-d CPU tensor values", report["scalars_tensor_values"], [caller, written]
    )
    print_section(
        f"Scalars in a training loop ({report['config']['steps']} steps, 10 scalars per step)",
        report["scalars_in_training_loop"],
        [caller, ("steps/s", "steps_per_sec", ",.0f"), ("step p99 ms", "step_ms_p99", ".3f")],
    )
    print_section("Histograms (10,000 values)", report["histograms"], [caller, written])
    print_section("Images (3x128x128 float)", report["images"], [caller, written])
    print_section("Our writer alone (drain)", {"ours": report["our_writer_alone"]}, [written])
    print_section(
        "Our writer thread's priority (100 scalars + 1/10 histogram per step)",
        report["writer_thread_priority"],
        [caller, ("steps/s", "steps_per_sec", ",.0f"), ("step p99 ms", "step_ms_p99", ".3f")],
    )
    v = report["verdict"]
    print(
        f"\nTargets ({OURS}: SummaryWriter(logdir)): caller {v['caller_us']:.3f} us "
        f"(<= {TARGET_CALLER_US}: {v['met']['caller_us']}), written {v['written_per_sec']:,.0f}/s "
        f"(>= {TARGET_WRITTEN_PER_SEC:,}: {v['met']['written_per_sec']}), "
        f"{v['caller_cost_vs_torch']:.0f}x lower caller cost than torch "
        f"(>= {TARGET_VS_TORCH:.0f}x: {v['met']['vs_torch']}; "
        f"{v['caller_cost_vs_torch_in_training_loop']:.0f}x in the training loop)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scalars", type=int, default=100_000, help="add_scalar calls per run")
    parser.add_argument("--objects", type=int, default=200, help="histograms/images per run")
    parser.add_argument("--steps", type=int, default=1000, help="steps of the training loop")
    parser.add_argument("--work-size", type=int, default=192, help="matrix size of a step")
    parser.add_argument("--repeat", type=int, default=5, help="runs per writer (median)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few events, 2 runs")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="output file")
    args = parser.parse_args(argv)
    if args.quick:
        args.scalars, args.objects, args.steps, args.repeat = 20_000, 40, 200, 2
    report = run_all(args)
    print_report(report)
    results_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    out = args.json or os.path.join(results_dir, "summaries.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
