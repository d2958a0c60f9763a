"""Per-step overhead of the Supervisor's and MonitoredSession's loops against a bare loop.

    python benchmarks/hooks.py                  # 20,000 steps, 7 repeats
    python benchmarks/hooks.py --steps 2000     # quicker

The step does almost nothing (it increments the global step), so what is measured is the
machinery around it. Loops, each timed over ``--steps`` steps and repeated ``--repeat`` times:

* ``bare loop``: ``for _ in range(n): step()``;
* ``Session.run``: the raw session (the step boundary check and the fetch dispatch);
* ``Supervisor, standard services``: ``while not sv.should_stop(): sess.run(step)`` inside
  ``managed_session()`` with the summary, step-counter and checkpoint services on their
  default intervals (SPEC target: at most 3 us over the bare loop);
* ``MonitoredSession, no hooks``: ``while not sess.should_stop(): sess.run(step)``;
* ``MonitoredTrainingSession, 4 hooks``: the same loop with the chief's default hooks
  (``StepCounterHook``, ``SummarySaverHook`` with one scalar summary, ``CheckpointSaverHook``,
  all on their default schedules: a rate and a summary every 100 steps, a checkpoint every
  600 s) plus ``StopAtStepHook``, which ends the loop: the target case (SPEC: under 20 us);
* ``... run only``: the same session, ``sess.run(step)`` without ``should_stop()``;
* ``... + Nan + Logging``: adds ``NanTensorHook("loss")`` and ``LoggingTensorHook`` (every 100
  runs), which fetch the ``"loss"`` entry of the step's result every run.

Session creation and close (the checkpoint at step 0 and the final one) are not timed. It
prints a table (median and best per step, overhead of the median over the bare loop's) and
writes the figures as JSON (``--json``, default ``benchmarks/results/hooks.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from torchsupervisor import GlobalStep, Graph, Session, SummaryWriterCache, Supervisor, summary
from torchsupervisor.hooks import LoggingTensorHook, NanTensorHook, StopAtStepHook
from torchsupervisor.monitored.creators import ChiefSessionCreator
from torchsupervisor.monitored.session import MonitoredSession
from torchsupervisor.monitored.training_session import MonitoredTrainingSession

TARGET_US = 20.0
TARGET_CASE = "MonitoredTrainingSession, 4 hooks"
SUPERVISOR_TARGET_US = 3.0
SUPERVISOR_CASE = "Supervisor, standard services"


class Work:
    """The benchmarked step: increments the global step; returns a loss mapping."""

    def __init__(self) -> None:
        self.global_step = GlobalStep()
        self.w = torch.zeros(4)
        self.result = {"loss": torch.tensor(0.5)}

    @property
    def state(self) -> dict[str, Any]:
        return {"w": self.w, "global_step": self.global_step}

    def step(self) -> dict[str, torch.Tensor]:
        self.global_step.increment()
        return self.result


def timed(loop: Callable[[], None], steps: int) -> float:
    """Seconds per step of ``loop()`` (which runs ``steps`` steps)."""
    gc.collect()
    start = time.perf_counter()
    loop()
    return (time.perf_counter() - start) / steps


def bare(steps: int, _: str) -> float:
    work = Work()
    step = work.step

    def loop() -> None:
        for _ in range(steps):
            step()

    return timed(loop, steps)


def raw_session(steps: int, _: str) -> float:
    work = Work()
    sess = Session(work.state)
    step = work.step

    def loop() -> None:
        for _ in range(steps):
            sess.run(step)

    return timed(loop, steps)


def monitored_no_hooks(steps: int, _: str) -> float:
    work = Work()
    with MonitoredSession(ChiefSessionCreator(state=work.state)) as sess:
        step = work.step

        def loop() -> None:
            for _ in range(steps):
                if sess.should_stop():
                    break
                sess.run(step)

        return timed(loop, steps)


def training_session(
    steps: int, logdir: str, *, should_stop: bool = True, watch_loss: bool = False
) -> float:
    work = Work()
    summary.scalar("w0", lambda: work.w[0])
    hooks: list[Any] = [StopAtStepHook(num_steps=steps if should_stop else 10 * steps)]
    if watch_loss:
        hooks += [NanTensorHook("loss"), LoggingTensorHook({"loss": "loss"}, every_n_iter=100)]
    with MonitoredTrainingSession(checkpoint_dir=logdir, state=work.state, hooks=hooks) as sess:
        assert len(sess._hooks) == len(hooks) + 3
        step = work.step
        if should_stop:

            def loop() -> None:
                while not sess.should_stop():
                    sess.run(step)

        else:

            def loop() -> None:
                for _ in range(steps):
                    sess.run(step)

        seconds = timed(loop, steps)
    assert work.global_step.value == steps
    return seconds


def supervisor(steps: int, logdir: str) -> float:
    """``while not sv.should_stop(): sess.run(step)`` with the services on their defaults."""
    work = Work()
    summary.scalar("w0", lambda: work.w[0])
    sv = Supervisor(logdir=logdir, state=work.state, preemption_signals=())
    with sv.managed_session() as sess:
        step = work.step
        stop_at = work.global_step.value + steps

        def loop() -> None:
            while not sv.should_stop() and work.global_step.value < stop_at:
                sess.run(step)

        seconds = timed(loop, steps)
    return seconds


CASES: list[tuple[str, Callable[[int, str], float]]] = [
    ("bare loop", bare),
    ("Session.run", raw_session),
    (SUPERVISOR_CASE, supervisor),
    ("MonitoredSession, no hooks", monitored_no_hooks),
    (TARGET_CASE, training_session),
    (TARGET_CASE + ", run only", lambda n, d: training_session(n, d, should_stop=False)),
    (TARGET_CASE + " + Nan + Logging", lambda n, d: training_session(n, d, watch_loss=True)),
]


def run_all(steps: int, repeat: int) -> list[dict[str, Any]]:
    rows = []
    for name, case in CASES:
        times = []
        for _ in range(repeat):
            with tempfile.TemporaryDirectory() as logdir:
                with Graph().as_default():
                    times.append(case(steps, logdir))
                SummaryWriterCache.clear()  # Closes the events file before it is removed.
        rows.append(
            {
                "case": name,
                "median_us": statistics.median(times) * 1e6,
                "best_us": min(times) * 1e6,
                "runs_us": [t * 1e6 for t in times],
            }
        )
    base = rows[0]["median_us"]
    for row in rows:
        row["overhead_us"] = row["median_us"] - base
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print()
    print("Per-step time (us; the step itself only increments the global step)")
    print(f"{'case':52s} {'median':>8} {'best':>8} {'overhead':>9}")
    for row in rows:
        print(
            f"{row['case']:52s} {row['median_us']:8.2f} {row['best_us']:8.2f} "
            f"{row['overhead_us']:9.2f}"
        )
    target = next(r for r in rows if r["case"] == TARGET_CASE)
    met = target["overhead_us"] < TARGET_US
    print()
    print(
        f"Target: overhead of should_stop() + run() with the 4 default hooks < {TARGET_US:g} us: "
        f"{'met' if met else 'NOT MET'} [{target['overhead_us']:.2f} us]"
    )
    sv_row = next(r for r in rows if r["case"] == SUPERVISOR_CASE)
    sv_met = sv_row["overhead_us"] <= SUPERVISOR_TARGET_US
    print(
        f"Target: overhead of sv.should_stop() + sess.run() with the standard services <= "
        f"{SUPERVISOR_TARGET_US:g} us: {'met' if sv_met else 'NOT MET'} "
        f"[{sv_row['overhead_us']:.2f} us]"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", default=None, help="output file")
    args = parser.parse_args(argv)
    logging.getLogger("torchsupervisor").setLevel(logging.WARNING)
    rows = run_all(args.steps, args.repeat)
    print_table(rows)
    target = next(r for r in rows if r["case"] == TARGET_CASE)
    sv_row = next(r for r in rows if r["case"] == SUPERVISOR_CASE)
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "steps": args.steps,
        "repeat": args.repeat,
        "target_us": TARGET_US,
        "supervisor_target_us": SUPERVISOR_TARGET_US,
        "target_overhead_us": target["overhead_us"],
        "target_met": target["overhead_us"] < TARGET_US,
        "supervisor_overhead_us": sv_row["overhead_us"],
        "supervisor_target_met": sv_row["overhead_us"] <= SUPERVISOR_TARGET_US,
        "rows": rows,
    }
    here = os.path.dirname(os.path.abspath(__file__))
    out = args.json or os.path.join(here, "results", "hooks.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
