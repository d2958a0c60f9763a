"""Chaos benchmark: a 2-rank training job under random process kills and node losses, for
each way of saving it, side by side; goodput and steps lost per failure.

    python benchmarks/chaos.py                    # 20 minutes per variant (80 in all)
    python benchmarks/chaos.py --minutes 3 --rounds 1 --kill-every 30 --node-loss-every 90

Each variant runs ``benchmarks/chaos_worker.py`` (a DDP MLP with Adam, gloo, 2 ranks) on two
"nodes" of this host for ``--minutes``: two ``torchrun --nnodes=2 --nproc_per_node=1
--max-restarts=1000`` agents, each with its own memory root, meeting at a rendezvous store
this script hosts:

* ``memory``: ours, the memory tier every step (the chief's snapshots copied to the other
  node at most every ``--peer-every-secs``, 5) and a checkpoint every ``--save-secs`` (30 s);
* ``disk``: ours, a checkpoint every 30 s;
* ``dcp``: ``torch.distributed.checkpoint.async_save`` every 30 s;
* ``torch``: ``torch.save`` by rank 0 every 30 s.

The job's step is what the memory tier's training target assumes (at least 20 copies of the
state: ``--batch-size`` 640 per rank here); the run measures one copy of the state and reports
the clean step's ratio to it (``clean_step_over_memcpy``).

Each variant's ``--minutes`` run as ``--rounds`` segments (default 4 of 5 minutes), round
robin with the other variants (each round in another order), every segment a fresh job with
a step time of the job without failures or saves measured just before it: this machine's
speed drifts by more than a failure costs, and the same drift then falls on every variant.

Failures come at exponential intervals (the same seeded schedule for every variant): a
process kill (``SIGKILL`` of a random rank; torchrun restarts the group) every
``--kill-every`` seconds on average (120), a node loss (a random node's agent and worker
killed, its memory root deleted, a new agent started there) every ``--node-loss-every``
seconds on average (360). The memory variant then resumes from what the other node holds: the
chief's own snapshots, or the peer copy of them its node sent there. A failure is only
injected once the job has completed a step since the last one.

Reported per variant, from rank 0's progress file: goodput (over the segments, the steps the
job holds at the end x the segment's clean step time, over the wall time), steps lost per
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
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "chaos_worker.py")
VARIANTS = ("memory", "disk", "dcp", "torch")
NODES = 2


@dataclass
class Failure:
    kind: str  # "kill" or "node"
    at: float  # time.time() of the injection
    reached: int  # The highest step completed since the job's last resume, before it.
    resumed: int | None = None
    recovered_at: float | None = None  # The first step completed after the resume.
    parts: dict[str, float] = field(default_factory=dict)  # The recovery's parts, seconds.


@dataclass
class Run:
    """One segment of one variant: a fresh job (a new log directory) for ``segment_secs``."""

    variant: str
    wall_secs: float = 0.0
    final_step: int = 0  # The steps the job holds at the end (its highest step completed).
    failures: list[Failure] = field(default_factory=list)
    step_secs: float | None = None  # The median time of a step between failures.
    clean_step_secs: float = 0.0  # Of the job without failures or saves, just before.


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


def _held_step(path: str) -> int:
    """The step the job holds now: the highest completed since its last resume (the step it
    resumed at if none). Not the highest ever: after a resume at an older step, the steps
    above it were lost once, and a later failure loses only what it completed since."""
    held = 0
    for kind, step, _ in _read_progress(path):
        if kind == "resume":
            held = step or 0
        elif kind == "step" and step:
            held = max(held, step)
    return held


class Node:
    """One "node": a torchrun agent with one worker, its own memory root; started again, empty,
    after a node loss."""

    def __init__(self, index: int, cluster: Cluster) -> None:
        self.index = index
        self.cluster = cluster
        self.shm = os.path.join(cluster.workdir, f"node{index}-shm")
        self.agent: subprocess.Popen | None = None

    def start(self) -> None:
        os.makedirs(self.shm, exist_ok=True)
        env = {**self.cluster.env, "TORCHSUPERVISOR_MEMORY_ROOT": self.shm}
        self.agent = subprocess.Popen(
            self.cluster.command, stdout=self.cluster.log, stderr=subprocess.STDOUT, env=env
        )

    def workers(self) -> list[int]:
        """The agent's worker processes (pids)."""
        if self.agent is None:
            return []
        try:
            children = psutil.Process(self.agent.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [p.pid for p in children if "chaos_worker.py" in " ".join(_cmdline(p))]

    def stop(self) -> None:
        if self.agent is None:
            return
        workers = self.workers()
        _kill([self.agent.pid, *workers])
        self.agent.wait(60)
        psutil.wait_procs(_processes(workers), 30)
        self.agent = None


class Cluster:
    """One variant's job: ``NODES`` torchrun agents of one worker each, meeting at a rendezvous
    store this process hosts (as a login node or etcd would: losing a node never loses it)."""

    def __init__(self, variant: str, workdir: str, args: argparse.Namespace, rdzv: str) -> None:
        import torch.distributed as dist  # Only for the store: the workers import the rest.

        self.workdir = workdir
        self.progress = os.path.join(workdir, "progress.log")
        self.log = open(os.path.join(workdir, "agents.log"), "a")  # noqa: SIM115
        port = _free_port()
        self.store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        self.command = [
            sys.executable,
            *("-m", "torch.distributed.run", f"--nnodes={NODES}", "--nproc_per_node=1"),
            f"--max-restarts={args.max_restarts}",
            *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv}"),
            # A lost node leaves the rendezvous when its heartbeats stop: after 2 s, not 15.
            "--rdzv-conf=is_host=false,keep_alive_interval=1,keep_alive_max_attempt=2",
            WORKER,
            *("--variant", variant, "--logdir", os.path.join(workdir, "logdir")),
            *("--progress", self.progress, "--save-secs", str(args.save_secs)),
            *("--hidden", str(args.hidden), "--layers", str(args.layers)),
            *("--batch-size", str(args.batch_size), "--peer-every-secs", str(args.peer_every_secs)),
        ]
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            # Else a restarted plain init_process_group finds the dead workers' keys in
            # torchrun's shared store (pytorch#135712; ours keeps attempts apart itself).
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        self.nodes = [Node(i, self) for i in range(NODES)]

    def start(self) -> None:
        for node in self.nodes:
            node.start()

    def kill_a_process(self, rng: random.Random) -> bool:
        workers = [pid for node in self.nodes for pid in node.workers()]
        if len(workers) < NODES:
            return False
        _kill([rng.choice(workers)])
        return True

    def lose_a_node(self, rng: random.Random) -> None:
        """Kill a random node's agent and worker, delete its memory, start it again empty."""
        node = rng.choice(self.nodes)
        node.stop()
        shutil.rmtree(node.shm, ignore_errors=True)
        node.start()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.log.close()
        del self.store


def _processes(pids: list[int]) -> list[psutil.Process]:
    """The processes of ``pids`` still there."""
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return found


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def segment_secs(args: argparse.Namespace) -> float:
    """The length of one segment: ``--minutes`` per variant in ``--rounds`` segments."""
    return args.minutes * 60 / args.rounds


def schedule(args: argparse.Namespace, seed: int) -> list[tuple[float, str]]:
    """The failures of one segment: (seconds after its start, kind), the same for every
    variant."""
    rng = random.Random(seed)
    events = []
    for kind, mean in (("kill", args.kill_every), ("node", args.node_loss_every)):
        t = rng.expovariate(1.0 / mean)
        while t < segment_secs(args):
            events.append((t, kind))
            t += rng.expovariate(1.0 / mean)
    return sorted(events)


def run_variant(variant: str, args: argparse.Namespace, base: str, segment: int) -> Run:
    """Segment ``segment`` of ``variant``: a fresh job under the segment's failures."""
    workdir = os.path.join(base, f"{variant}-{segment}")
    os.makedirs(workdir)
    job = Cluster(variant, workdir, args, rdzv=f"chaos-{variant}-{segment}")
    rng = random.Random(args.seed * 1000 + segment + 1)  # Which rank, which node.
    run = Run(variant)
    length = segment_secs(args)
    started = time.time()
    job.start()
    try:
        for offset, kind in schedule(args, args.seed * 1000 + segment):
            while time.time() - started < offset:
                time.sleep(0.05)
            # A failure only once the job completed a step since the last one.
            last = run.failures[-1] if run.failures else None
            while last is not None and _after(job.progress, last.at) is None:
                if time.time() - started > length:
                    break
                time.sleep(0.05)
            if time.time() - started > length:
                break
            reached = _held_step(job.progress)
            injected = time.time()
            if kind == "node":
                job.lose_a_node(rng)
            elif not job.kill_a_process(rng):
                continue
            run.failures.append(Failure(kind, injected, reached))
        while time.time() - started < length:
            time.sleep(0.1)
    finally:
        run.wall_secs = time.time() - started
        job.stop()
    run.final_step = _held_step(job.progress)
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
    clean = argparse.Namespace(**{**vars(args), "save_secs": 1e9})
    job = Cluster("torch", workdir, clean, rdzv=f"clean-{before}")
    job.start()
    try:
        deadline = time.time() + 300
        while _held_step(job.progress) < 20 + args.clean_steps and time.time() < deadline:
            time.sleep(0.2)
    finally:
        job.stop()
    progress = job.progress
    times = [t for kind, s, t in _read_progress(progress) if kind == "step" and s and s > 20]
    if len(times) < 2:
        raise RuntimeError(f"the clean run made too few steps (see {workdir})")
    return (times[-1] - times[0]) / (len(times) - 1)


def state_memcpy(args: argparse.Namespace) -> tuple[int, float]:
    """The training state's bytes (the model and Adam's moments, one rank's) and the median
    time of one copy of it into buffers allocated before (seconds): what the memory tier's
    stall is measured against, here in this process on one thread."""
    import torch

    sys.path.insert(0, HERE)
    from chaos_worker import batch, build

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build(args.hidden, args.layers)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        x, y = batch(0, 8, args.hidden)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        tensors = [p.detach() for p in model.parameters()]
        tensors += [t for s in optimizer.state.values() for t in s.values() if t.dim()]
        buffers = [torch.empty_like(t) for t in tensors]
        times = []
        for _ in range(9):
            start = time.perf_counter()
            for buffer, tensor in zip(buffers, tensors):
                buffer.copy_(tensor)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return sum(t.numel() * t.element_size() for t in tensors), statistics.median(times)


def summarize(runs: list[Run]) -> dict[str, Any]:
    """One variant's row over its segments: goodput is the productive step time (the steps
    each segment's job holds at its end x that segment's clean step time) over the wall time."""
    failures = [f for run in runs for f in run.failures]

    def lost(kind: str) -> list[int]:
        # At least 0: a step can complete (and be snapshotted) between the progress file's
        # last line and the failure.
        return [
            max(0, f.reached - f.resumed)
            for f in failures
            if f.kind == kind and f.resumed is not None
        ]

    recovery = [f.recovered_at - f.at for f in failures if f.recovered_at is not None]
    broken = [f.parts for f in failures if f.parts]
    wall = sum(run.wall_secs for run in runs)
    productive = sum(run.final_step * run.clean_step_secs for run in runs)
    speeds = [run.clean_step_secs / run.step_secs for run in runs if run.step_secs]
    return {
        "variant": runs[0].variant,
        "segments": len(runs),
        "wall_secs": round(wall, 1),
        "steps_held": [run.final_step for run in runs],
        "clean_step_secs": [round(run.clean_step_secs, 4) for run in runs],
        "goodput": round(productive / wall, 3) if wall else 0,
        # Its own steps' speed against the clean runs': what its saves cost the steps.
        "steps_per_sec_vs_clean": round(statistics.median(speeds), 3) if speeds else None,
        "kills": len([f for f in failures if f.kind == "kill"]),
        "node_losses": len([f for f in failures if f.kind == "node"]),
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
    parser.add_argument(
        "--rounds", type=int, default=4, help="segments per variant, run round robin"
    )
    parser.add_argument("--kill-every", type=float, default=120.0, help="mean seconds")
    parser.add_argument("--node-loss-every", type=float, default=360.0, help="mean seconds")
    parser.add_argument("--save-secs", type=float, default=30.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--batch-size", type=int, default=640, help="per rank (640: a step of over 20 copies)"
    )
    parser.add_argument(
        "--peer-every-secs", type=float, default=5.0, help="the memory tier's peer copies"
    )
    parser.add_argument("--clean-steps", type=int, default=100)
    parser.add_argument("--max-restarts", type=int, default=1000, help="torchrun's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="kept when given")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "chaos.json"))
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose among {list(VARIANTS)}")
    state_bytes, memcpy_secs = state_memcpy(args)
    print(f"state {state_bytes / 1e6:.1f} MB, one copy of it {memcpy_secs * 1000:.1f} ms")
    base = args.workdir or tempfile.mkdtemp(prefix="chaos-")
    os.makedirs(base, exist_ok=True)
    try:
        runs: dict[str, list[Run]] = {variant: [] for variant in variants}
        for segment in range(args.rounds):
            # Round robin, each round in another order: the machine's speed drifts.
            shift = segment % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                clean = clean_step_secs(args, base, f"{variant}-{segment}")
                run = run_variant(variant, args, base, segment)
                run.clean_step_secs = clean
                runs[variant].append(run)
                print(
                    f"segment {segment} {variant}: clean step {clean * 1000:.1f} ms, "
                    f"{run.final_step} steps held, {len(run.failures)} failures",
                    flush=True,
                )
        rows = [summarize(runs[variant]) for variant in variants]
        for row in rows:
            clean = statistics.median(row["clean_step_secs"])
            row["clean_step_over_memcpy"] = round(clean / memcpy_secs, 1)
        for row in rows:
            print(json.dumps(row), flush=True)
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
                "rounds": args.rounds,
                "kill_every": args.kill_every,
                "node_loss_every": args.node_loss_every,
                "save_secs": args.save_secs,
                "batch_size": args.batch_size,
                "peer_every_secs": args.peer_every_secs,
                "state_bytes": state_bytes,
                "memcpy_secs": round(memcpy_secs, 5),
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
