"""Chaos benchmark: a 2-rank training job under random process kills and node losses, for
each way of saving it, side by side; goodput and steps lost per failure.

    python benchmarks/chaos.py                    # 20 minutes per variant (80 in all)
    python benchmarks/chaos.py --minutes 3 --kill-every 30 --node-loss-every 90

Each variant runs ``benchmarks/chaos_worker.py`` (a DDP MLP with Adam, gloo, 2 ranks) under
``torchrun --standalone --nproc_per_node=2 --max-restarts=1000`` for ``--minutes``:

* ``memory``: ours, the memory tier every step and a checkpoint every ``--save-secs`` (30 s);
* ``disk``: ours, a checkpoint every 30 s;
* ``dcp``: ``torch.distributed.checkpoint.async_save`` every 30 s;
* ``torch``: ``torch.save`` by rank 0 every 30 s.

Failures come at exponential intervals (the same seeded schedule for every variant): a
process kill (``SIGKILL`` of a random rank; torchrun restarts the group) every
``--kill-every`` seconds on average (120), a node loss (the torchrun agent and its workers
killed, the node's memory root deleted, a new agent started) every ``--node-loss-every``
seconds on average (360). A failure is only injected once the job has completed a step since
the last one.

Reported per variant, from rank 0's progress file: goodput (the steps the job holds at the
end x the step time of a run without failures or saves, over the wall time), steps lost per
process kill and per node loss (the highest step completed before the failure less the step
the job resumed at), and the time from each failure to the next completed step.

It prints a table and writes JSON (``--json``, default ``benchmarks/results/chaos.json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "chaos_worker.py")
VARIANTS = ("memory", "disk", "dcp", "torch")


@dataclass
class Failure:
    kind: str  # "kill" or "node"
    at: float  # time.time() of the injection
    reached: int  # The highest step completed before it.
    resumed: int | None = None
    recovered_at: float | None = None  # The first step completed after the resume.
    parts: dict[str, float] = field(default_factory=dict)  # The recovery's parts, seconds.


@dataclass
class Run:
    variant: str
    wall_secs: float = 0.0
    final_step: int = 0
    failures: list[Failure] = field(default_factory=list)
    step_secs: float | None = None  # The median time of a step between failures.


def _read_progress(path: str) -> list[tuple[str, int | None, float]]:
    events: list[tuple[str, int | None, float]] = []
    try:
        with open(path) as f:
            text = f.read()
        lines = text.splitlines()
    except FileNotFoundError:
        return events
    if lines and not text.endswith("\n"):
        lines.pop()  # Unfinished: a kill, or a line being written now.
    for line in lines:
        words = line.split()
        try:
            if words[0] in ("start", "connected") and len(words) == 2:
                event: tuple[str, int | None, float] = (words[0], None, float(words[1]))
            elif words[0] in ("resume", "step") and len(words) == 3:
                event = (words[0], int(words[1]), float(words[2]))
            else:
                continue
        except (IndexError, ValueError):
            continue  # A line torn by a kill.
        if events and event[2] < events[-1][2]:
            continue  # Torn inside its time (a prefix of a number is smaller).
        events.append(event)
    return events


def _highest_step(path: str) -> int:
    return max((s for kind, s, _ in _read_progress(path) if kind == "step" and s), default=0)


class Job:
    """One variant's torchrun agent (the "node"), started again after a node loss."""

    def __init__(self, variant: str, workdir: str, args: argparse.Namespace) -> None:
        self.variant = variant
        self.workdir = workdir
        self.args = args
        self.shm = os.path.join(workdir, "shm")
        self.progress = os.path.join(workdir, "progress.log")
        self.agent: subprocess.Popen | None = None
        self.log = open(os.path.join(workdir, "agents.log"), "a")  # noqa: SIM115

    def start(self) -> None:
        os.makedirs(self.shm, exist_ok=True)
        command = [
            sys.executable,
            *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"),
            "--max-restarts=1000",
            WORKER,
            *("--variant", self.variant, "--logdir", os.path.join(self.workdir, "logdir")),
            *("--progress", self.progress, "--save-secs", str(self.args.save_secs)),
            *("--hidden", str(self.args.hidden), "--layers", str(self.args.layers)),
        ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TORCHSUPERVISOR_MEMORY_ROOT": self.shm,
            # Else a restarted plain init_process_group finds the dead workers' keys in
            # torchrun's shared store (pytorch#135712; ours keeps attempts apart itself).
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        self.agent = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def workers(self) -> list[int]:
        """The agent's worker processes (pids)."""
        if self.agent is None:
            return []
        return [pid for pid in _children(self.agent.pid) if "chaos_worker.py" in _cmdline(pid)]

    def kill_a_process(self, rng: random.Random) -> bool:
        workers = self.workers()
        if len(workers) < 2:
            return False
        _kill([rng.choice(workers)])
        return True

    def lose_the_node(self) -> None:
        self.stop()
        shutil.rmtree(self.shm, ignore_errors=True)
        self.start()

    def stop(self) -> None:
        if self.agent is None:
            return
        workers = self.workers()
        _kill([self.agent.pid, *workers])
        self.agent.wait(60)
        _wait_gone(workers, 30)
        self.agent = None


def _children(pid: int) -> list[int]:
    """The living children of ``pid`` (from ``/proc``)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == pid:
                found.append(int(entry))
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_gone(pids: list[int], timeout_secs: float) -> None:
    deadline = time.monotonic() + timeout_secs
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.05)


def schedule(args: argparse.Namespace, seed: int) -> list[tuple[float, str]]:
    """The failures of one run: (seconds after the start, kind), the same for every variant."""
    rng = random.Random(seed)
    events = []
    for kind, mean in (("kill", args.kill_every), ("node", args.node_loss_every)):
        t = rng.expovariate(1.0 / mean)
        while t < args.minutes * 60:
            events.append((t, kind))
            t += rng.expovariate(1.0 / mean)
    return sorted(events)


def run_variant(variant: str, args: argparse.Namespace, base: str) -> Run:
    workdir = os.path.join(base, variant)
    os.makedirs(workdir)
    job = Job(variant, workdir, args)
    rng = random.Random(args.seed + 1)
    run = Run(variant)
    started = time.time()
    job.start()
    try:
        for offset, kind in schedule(args, args.seed):
            while time.time() - started < offset:
                time.sleep(0.05)
            # A failure only once the job completed a step since the last one.
            last = run.failures[-1] if run.failures else None
            while last is not None and _after(job.progress, last.at) is None:
                if time.time() - started > args.minutes * 60:
                    break
                time.sleep(0.05)
            if time.time() - started > args.minutes * 60:
                break
            reached = _highest_step(job.progress)
            injected = time.time()
            if kind == "node":
                job.lose_the_node()
            elif not job.kill_a_process(rng):
                continue
            run.failures.append(Failure(kind, injected, reached))
        while time.time() - started < args.minutes * 60:
            time.sleep(0.1)
    finally:
        run.wall_secs = time.time() - started
        job.stop()
        job.log.close()
    run.final_step = _highest_step(job.progress)
    _account(run, _read_progress(job.progress))
    return run


def _after(progress: str, moment: float) -> float | None:
    """The time of the first step completed after ``moment``, or None."""
    return next(
        (t for kind, _, t in _read_progress(progress) if kind == "step" and t > moment), None
    )


PARTS = ("launch", "rendezvous", "restore", "first step")
"""A recovery's parts: to the new process's ``start`` (torchrun's restart, the interpreter,
``import torch``), to ``connected`` (the process group, and the model built), to ``resume``
(the state restored), to the first step completed."""


def _account(run: Run, events: list[tuple[str, int | None, float]]) -> None:
    steps = [(s, t) for kind, s, t in events if kind == "step"]
    gaps = [t2 - t1 for (s1, t1), (s2, t2) in itertools.pairwise(steps) if s2 == s1 + 1]
    run.step_secs = statistics.median(gaps) if gaps else None
    for failure in run.failures:
        resumes = [(s, t) for kind, s, t in events if kind == "resume" and t > failure.at]
        if resumes:
            failure.resumed = resumes[0][0]
        steps = [t for kind, _, t in events if kind == "step" and t > failure.at]
        if steps:
            failure.recovered_at = steps[0]
        marks, moment = [failure.at], failure.at
        for kind in ("start", "connected", "resume", "step"):
            moment = next((t for k, _, t in events if k == kind and t > moment), None)
            if moment is None:
                break
            marks.append(moment)
        if len(marks) == len(PARTS) + 1:
            failure.parts = {p: b - a for p, a, b in zip(PARTS, marks, marks[1:])}


def clean_step_secs(args: argparse.Namespace, base: str, before: str) -> float:
    """Seconds per step of the job with no failure and no save (``torch`` variant, no save),
    measured just before the variant ``before`` (the machine's speed drifts)."""
    workdir = os.path.join(base, f"clean-before-{before}")
    os.makedirs(workdir)
    progress = os.path.join(workdir, "progress.log")
    command = [
        sys.executable,
        *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER),
        *("--variant", "torch", "--logdir", os.path.join(workdir, "logdir")),
        *("--progress", progress, "--save-secs", "1e9"),
        *("--hidden", str(args.hidden), "--layers", str(args.layers)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(os.path.join(workdir, "agent.log"), "w") as log:
        agent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.time() + 300
            while _highest_step(progress) < 20 + args.clean_steps and time.time() < deadline:
                time.sleep(0.2)
        finally:
            workers = _children(agent.pid)
            _kill([agent.pid, *workers])
            agent.wait(60)
            _wait_gone(workers, 30)
    times = [t for kind, s, t in _read_progress(progress) if kind == "step" and s and s > 20]
    if len(times) < 2:
        raise RuntimeError(f"the clean run made too few steps (see {workdir})")
    return (times[-1] - times[0]) / (len(times) - 1)


def summarize(run: Run, step_secs: float) -> dict[str, Any]:
    def lost(kind: str) -> list[int]:
        return [
            f.reached - f.resumed for f in run.failures if f.kind == kind and f.resumed is not None
        ]

    recovery = [f.recovered_at - f.at for f in run.failures if f.recovered_at is not None]
    broken = [f.parts for f in run.failures if f.parts]
    return {
        "variant": run.variant,
        "wall_secs": round(run.wall_secs, 1),
        "final_step": run.final_step,
        "clean_step_secs": round(step_secs, 4),
        "goodput": round(run.final_step * step_secs / run.wall_secs, 3) if run.wall_secs else 0,
        # Its own steps' speed against the clean run's: what its saves cost the steps.
        "steps_per_sec_vs_clean": round(step_secs / run.step_secs, 3) if run.step_secs else None,
        "kills": len([f for f in run.failures if f.kind == "kill"]),
        "node_losses": len([f for f in run.failures if f.kind == "node"]),
        "lost_per_kill": lost("kill"),
        "lost_per_node_loss": lost("node"),
        "recovery_secs_median": round(statistics.median(recovery), 2) if recovery else None,
        "recovery_parts_median": {
            part: round(statistics.median(b[part] for b in broken), 2) for part in PARTS
        }
        if broken
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=20.0, help="per variant")
    parser.add_argument("--kill-every", type=float, default=120.0, help="mean seconds")
    parser.add_argument("--node-loss-every", type=float, default=360.0, help="mean seconds")
    parser.add_argument("--save-secs", type=float, default=30.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--clean-steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="kept when given")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "chaos.json"))
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose among {list(VARIANTS)}")
    base = args.workdir or tempfile.mkdtemp(prefix="chaos-")
    os.makedirs(base, exist_ok=True)
    try:
        rows = []
        for variant in variants:
            step_secs = clean_step_secs(args, base, variant)
            print(f"step time without failures or saves: {step_secs * 1000:.1f} ms", flush=True)
            row = summarize(run_variant(variant, args, base), step_secs)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        if args.workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    print()
    print(
        f"{'variant':8} {'goodput':>8} {'steps/s':>8} {'kills':>6} {'lost/kill (max, mean)':>22} "
        f"{'nodes':>6} {'lost/node (max, mean)':>22} {'recovery s':>10}  "
        "launch / rendezvous / restore / first step (medians, s)"
    )
    for row in rows:

        def stats(values: list[int]) -> str:
            return f"{max(values)}, {statistics.mean(values):.1f}" if values else "-"

        print(
            f"{row['variant']:8} {row['goodput']:8.3f} {row['steps_per_sec_vs_clean'] or 0:8.3f} "
            f"{row['kills']:6d} "
            f"{stats(row['lost_per_kill']):>22} {row['node_losses']:6d} "
            f"{stats(row['lost_per_node_loss']):>22} {row['recovery_secs_median'] or '-':>10}  "
            + (
                " / ".join(f"{row['recovery_parts_median'][p]:.2f}" for p in PARTS)
                if row["recovery_parts_median"]
                else "-"
            )
        )
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "minutes": args.minutes,
                "kill_every": args.kill_every,
                "node_loss_every": args.node_loss_every,
                "save_secs": args.save_secs,
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
