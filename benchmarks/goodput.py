"""Goodput ledger benchmark: a scripted run whose ground truth the script and the worker record,
against what ``torchsupervisor goodput`` reports from the ledger.

    python benchmarks/goodput.py                      # 8 processes: kills, preemptions
    python benchmarks/goodput.py --processes 4 --seed 1

One run of ``benchmarks/goodput_worker.py`` (a Supervisor loop of fixed 50 ms steps with a
50 MB state changed every step, a checkpoint every 2 s to storage whose fsyncs take 0.1 s,
input that waits 0.2 s every 25th batch) is stopped ``--processes - 1`` times, each stop
drawn from a seeded schedule: a kill (the worker SIGKILLs itself at a drawn step, so the step
it reached is known) or a preemption (SIGTERM at a drawn time: the final checkpoint waits for
the slow storage); between two processes the script waits a drawn 0.5-2 s (down); the last
process runs to its last step.

The truth, recorded apart from the ledger: the script's clock for each process's start and
death and for the down time; the worker's own lines for each injected input wait, each
``should_stop()`` that took a snapshot, each step with its time, the stop and the session's
end. The table compares, cause by cause, the ledger's seconds with the truth's, the
difference as a share of the wall time (the target: within 2%), and the steps lost to each
kill (the target: exact).

Writes JSON (``--json``, default ``benchmarks/results/goodput.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "goodput_worker.py")
sys.path.insert(0, os.path.dirname(HERE))

from torchsupervisor.summary.goodput_report import goodput_report  # noqa: E402
from torchsupervisor.summary.ledger import read_ledgers  # noqa: E402


def _truth_lines(path: str) -> list[list[str]]:
    try:
        with open(path) as f:
            return [line.split() for line in f if line.strip()]
    except FileNotFoundError:
        return []


def run_process(
    logdir: str, truth: str, max_steps: int, stop: tuple[str, float] | None, extra: list[str]
) -> dict[str, Any]:
    """One worker process; ``stop``: ("kill", step) or ("term", seconds after its first
    step), None: to the end. Returns its truth."""
    before = len(_truth_lines(truth))
    command = [sys.executable, WORKER, logdir, str(max_steps), "--truth", truth, *extra]
    if stop is not None and stop[0] == "kill":
        command += ["--die-at-step", str(int(stop[1]))]
    started = time.time()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(process.stderr.read()))
    reader.start()
    if stop is not None and stop[0] == "term":
        deadline = time.monotonic() + 300
        while not any(w[0] == "step" for w in _truth_lines(truth)[before:]):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start: {b''.join(err).decode()[-2000:]}")
            time.sleep(0.02)
        time.sleep(stop[1])
        process.send_signal(signal.SIGTERM)
    status = process.wait(timeout=600)
    died = time.time()
    reader.join(60)
    if stop is None and status != 0:
        raise RuntimeError(f"the worker failed ({status}): {b''.join(err).decode()[-3000:]}")
    lines = _truth_lines(truth)[before:]
    steps = [(int(w[1]), float(w[2])) for w in lines if w[0] == "step"]
    return {
        "started": started,
        "died": died,
        "status": status,
        "kind": stop[0] if stop else "end",
        "data": sum(float(w[1]) for w in lines if w[0] == "data"),
        "boundary": sum(float(w[1]) for w in lines if w[0] == "boundary"),
        "steps": steps,
        "ready": next((float(w[1]) for w in lines if w[0] == "ready"), None),
        "stop": next((float(w[1]) for w in lines if w[0] == "stop"), None),
        "end": next((float(w[1]) for w in lines if w[0] == "end"), None),
    }


def truth_of(processes: list[dict[str, Any]], step_secs: float) -> dict[str, Any]:
    """The truth's seconds by cause, and the steps lost to each kill."""
    causes = dict.fromkeys(("startup", "checkpoint", "data", "preemption", "lost", "down"), 0.0)
    lost_steps = []
    for n, p in enumerate(processes):
        resumed = p["steps"][0][0] - 1 if p["steps"] else None
        if p["ready"] is not None:  # Created to ready: import, start-up, restore or init.
            causes["startup"] += p["ready"] - p["started"]
        causes["checkpoint"] += p["boundary"]
        causes["data"] += p["data"]
        if p["stop"] is not None and p["end"] is not None:
            causes["preemption"] += p["end"] - p["stop"]
        last = p["end"] if p["end"] is not None else p["died"]
        if n + 1 < len(processes):
            causes["down"] += processes[n + 1]["started"] - last
            following = processes[n + 1]
            next_resumed = following["steps"][0][0] - 1 if following["steps"] else None
            reached = p["steps"][-1][0] if p["steps"] else resumed
            if p["kind"] == "kill" and next_resumed is not None and reached is not None:
                lost_steps.append(reached - next_resumed)
                at = dict(p["steps"])  # When each step completed.
                if next_resumed in at:
                    causes["lost"] += at[reached] - at[next_resumed]
        p["resumed"] = resumed
    wall = (processes[-1]["end"] or processes[-1]["died"]) - processes[0]["started"]
    return {"causes": causes, "lost_steps": lost_steps, "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600, help="the run's last step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "goodput.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    extra = ["--state-mb", "50", "--fsync-secs", "0.1", "--save-secs", "2"]
    with tempfile.TemporaryDirectory(prefix="goodput-bench-") as root:
        logdir, truth = os.path.join(root, "run"), os.path.join(root, "truth.txt")
        processes = []
        per_process = args.steps // args.processes
        for n in range(args.processes):
            stop: tuple[str, float] | None = None
            if n + 1 < args.processes:
                if rng.random() < 0.5:
                    stop = ("kill", per_process * (n + 1) + rng.randint(-10, 10))
                else:
                    stop = ("term", rng.uniform(2.0, 6.0))
            processes.append(run_process(logdir, truth, args.steps, stop, extra))
            if n + 1 < args.processes:
                time.sleep(rng.uniform(0.5, 2.0))
        report = goodput_report(read_ledgers(logdir))
    truth = truth_of(processes, 0.05)
    ledger = dict(report.causes)
    ledger["startup"] = sum(
        ledger.get(c, 0.0) for c in ("import", "startup", "rendezvous", "init", "restore")
    )
    ledger["preemption"] = ledger.get("preemption", 0.0) + ledger.get("final", 0.0)
    wall = truth["wall"]
    print(
        f"{len(processes)} processes ({sum(p['kind'] == 'kill' for p in processes)} kills, "
        f"{sum(p['kind'] == 'term' for p in processes)} preemptions), wall {wall:.1f} s "
        f"(ledger {report.wall:.1f} s), goodput {report.goodput:.1%}"
    )
    print(f"{'cause':<12} {'ledger s':>9} {'truth s':>9} {'diff / wall':>12}")
    rows = []
    for cause, secs in truth["causes"].items():
        diff = (ledger.get(cause, 0.0) - secs) / wall
        rows.append({"cause": cause, "ledger": ledger.get(cause, 0.0), "truth": secs, "diff": diff})
        print(f"{cause:<12} {ledger.get(cause, 0.0):>9.2f} {secs:>9.2f} {diff:>+11.2%}")
    ledger_lost = [i.lost_steps for i in report.incarnations[:-1] if not i.clean]
    print(f"steps lost per kill: ledger {ledger_lost}, truth {truth['lost_steps']}")
    worst = max(abs(r["diff"]) for r in rows)
    exact = ledger_lost == truth["lost_steps"]
    print(f"worst cause {worst:.2%} of wall (target <= 2%); steps lost exact: {exact}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {"wall": wall, "ledger_wall": report.wall, "goodput": report.goodput,
             "rows": rows, "lost_ledger": ledger_lost, "lost_truth": truth["lost_steps"],
             "worst": worst, "exact": exact, "seed": args.seed},
            f, indent=1,
        )  # fmt: skip


if __name__ == "__main__":
    main()
