"""Memory tier benchmark: a snapshot every step, its stall and its cost to training, and the
restore from it, against the alternatives in the same run.

    python benchmarks/memory_tier.py                      # 100 MB and 500 MB states
    python benchmarks/memory_tier.py --sizes 10MB --steps 5

For each state size (an MLP plus its Adam state, as ``benchmarks/checkpoint.py`` builds it),
with the memory tier on a tmpfs (``--memory-root``, default ``/dev/shm``):

* stall: the training thread's time in the step boundary that takes the snapshot (the copy
  into host staging buffers), against one host memcpy of the state (each tensor into a
  preallocated buffer) measured between the same steps, and against ``torch.save`` of the
  state into the same tmpfs (what a naive memory tier does on the training thread);
* training: steps/s of a loop whose step takes at least ``--step-factor`` (20) times that
  memcpy (fixed compute on a small model, then the state is marked modified), with a snapshot
  every step against the same loop without the tier, alternating rounds; the ratio is the
  median over rounds (target: at least 0.95);
* restore: in a fresh process, after interpreter start and ``import torch`` (reported apart),
  the time to restore the newest snapshot into the model and optimizer (every byte checked),
  against the target 0.3 s + bytes / 2 GB/s, and ``torch.load(weights_only=True)`` +
  ``load_state_dict`` of the same state from the tmpfs;
* restore from a peer: the snapshot sent to a ``PeerServer`` in another process (a peer node),
  then, in a fresh process, fetched back over the loopback into the tmpfs and restored (every
  byte checked), against the target 1.5 x bytes / the loopback's bandwidth (one TCP
  connection between two processes, measured in the same run);
* the local-disk tier (``--local-dir``, on a disk): training with a copy of every snapshot to
  it (the worst case: copies back to back) against the same loop without any tier, in the
  same alternating rounds; one copy's time against a plain buffered write + fsync of the same
  bytes into the same directory (``benchmarks/checkpoint.py``'s raw write); and the restore of
  the copy in a fresh process from a cold page cache (the files evicted first, as after a
  reboot).

It prints a table and writes JSON (``--json``, default ``benchmarks/results/memory_tier.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

import torch

from torchsupervisor import GlobalStep, LocalDiskConfig, MemoryTierConfig, Session
from torchsupervisor.checkpoint.files import checkpoint_step
from torchsupervisor.tiers.memory import MemoryTier
from torchsupervisor.tiers.peer import send_snapshot

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from checkpoint import (  # noqa: E402 (benchmarks/checkpoint.py, this script's folder)
    MB,
    Memcpy,
    TrainingLoop,
    build_state,
    drop_from_page_cache,
    machine_facts,
    measure_raw_write,
    parse_size,
    state_tensors,
    tensor_bytes,
    timed,
    touch,
)

RUN_ID = "0" * 32


class Steps:
    """A training step of fixed work: small-model steps lasting about ``secs``, then every
    tensor of the big state marked modified (as its optimizer's step would)."""

    def __init__(self, state: dict[str, Any], secs: float) -> None:
        self.state = state
        self.loop = TrainingLoop()
        self.loop.step()
        one = min(timed(self.loop.step) for _ in range(5))
        self.count = max(1, round(secs / one))

    def __call__(self) -> None:
        for _ in range(self.count):
            self.loop.step()
        touch(self.state)


def run_loop(sess: Session, step: GlobalStep, work: Steps, n: int) -> tuple[float, list[float]]:
    """``n`` steps, each ending with ``increment`` and a step boundary (``Session.run``);
    returns the seconds of the whole and of each boundary."""
    boundaries = []
    t0 = time.perf_counter()
    for _ in range(n):
        work()
        step.increment()
        boundaries.append(timed(lambda: sess.run(lambda: None)))
    return time.perf_counter() - t0, boundaries


def measure_size(
    size_bytes: int, root: str, local: str, steps: int, rounds: int, factor: float
) -> dict:
    state = build_state(size_bytes)
    step = GlobalStep()
    state["global_step"] = step
    nbytes = tensor_bytes(state_tensors(state))
    memcpy = Memcpy(state)
    memcpy()
    copies = [timed(memcpy) for _ in range(5)]
    work = Steps(state, factor * statistics.median(copies))
    logdir = tempfile.mkdtemp(prefix="memory-tier-bench-")
    tier = MemoryTier(MemoryTierConfig(every_n_steps=1, root=root), logdir, RUN_ID)
    every = LocalDiskConfig(local, every_secs=0, every_n_steps=0, keep=1)
    copying = MemoryTier(
        MemoryTierConfig(every_n_steps=1, root=root, local_disk=every),
        logdir + "-local",
        RUN_ID,
    )
    row: dict[str, Any] = {"bytes": nbytes, "step_work_secs": timed(work)}
    try:
        on_rates, off_rates, local_rates, stalls, copies = [], [], [], [], []
        for _ in range(rounds):
            plain = Session(state)
            secs, _ = run_loop(plain, step, work, steps)
            off_rates.append(steps / secs)
            plain.close()
            for memory, rates in ((tier, on_rates), (copying, local_rates)):
                sess = Session(state)
                memory.start(sess, step)
                run_loop(sess, step, work, 1)  # The first snapshot allocates the tmpfs pages.
                secs, boundaries = run_loop(sess, step, work, steps)
                rates.append(steps / secs)
                if memory is tier:
                    stalls.extend(boundaries)
                memory.wait()
                sess.close()
            work()
            copies.append(timed(memcpy))
        row["memcpy_secs"] = statistics.median(copies)
        row["stall_secs"] = statistics.median(stalls)
        row["steps_per_sec_off"] = statistics.median(off_rates)
        row["steps_per_sec_on"] = statistics.median(on_rates)
        row["training_ratio"] = statistics.median(on / off for on, off in zip(on_rates, off_rates))
        row["torch_save_tmpfs_secs"] = _torch_save(state, root)
        newest = tier.snapshots()[0].prefix
        row["restore"] = _restore_in_fresh_process("ours", size_bytes, newest)
        row["peer_restore"] = _peer_restore(size_bytes, nbytes, root, newest)
        pt = os.path.join(root, "torch-save-bench.pt")
        torch.save(_payload(state), pt)
        try:
            row["torch_load"] = _restore_in_fresh_process("torch", size_bytes, pt)
        finally:
            os.unlink(pt)
        row["restore_target_secs"] = 0.3 + nbytes / 2e9
        row["local"] = _local_disk(copying, local_rates, off_rates, size_bytes, nbytes, local)
    finally:
        tier.close(free=True)
        copying.close(free=True)
        shutil.rmtree(logdir, ignore_errors=True)
    return row


def _local_disk(
    memory: MemoryTier,
    rates: list[float],
    off_rates: list[float],
    size_bytes: int,
    nbytes: int,
    local: str,
) -> dict[str, Any]:
    """The local-disk tier's figures (module docstring): training with a copy of every
    snapshot, one copy against a raw write of its bytes, a cold restore of the copy."""
    disk = memory.local_disk
    assert disk is not None
    newest = memory.snapshots()[0].prefix
    step = checkpoint_step(newest)
    disk.close_copier()  # The copies of the rounds are done (the loop's sessions closed).
    secs = []
    for _ in range(3):
        disk.start(step - 1, nbytes)
        t0 = time.perf_counter()
        disk.offer(newest)
        disk.close_copier(flush=True)
        secs.append(time.perf_counter() - t0)
    copy = disk.snapshots()[0].prefix
    drop_from_page_cache(disk.directory)
    return {
        "training_ratio": statistics.median(on / off for on, off in zip(rates, off_rates)),
        "copy_secs": statistics.median(secs),
        "raw_write_secs": measure_raw_write(nbytes, disk.directory, 3),
        "cold_restore": _restore_in_fresh_process("ours", size_bytes, copy),
    }


def _payload(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": state["model"].state_dict(), "opt": state["optimizer"].state_dict()}


def _torch_save(state: dict[str, Any], root: str) -> float:
    """``torch.save`` of the model and optimizer into the tmpfs: the median of 3."""
    path = os.path.join(root, "torch-save-bench.pt")
    payload = _payload(state)
    try:
        return statistics.median(timed(lambda: torch.save(payload, path)) for _ in range(3))
    finally:
        os.unlink(path)


_RESTORE = textwrap.dedent(
    """
    import sys, time
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    sys.path.insert(0, {here!r})
    from checkpoint import build_state
    from torchsupervisor import Saver, Session
    state = build_state({size})
    from torchsupervisor import GlobalStep
    state["global_step"] = GlobalStep()
    which, source = {which!r}, {source!r}
    t2 = time.perf_counter()
    if which == "peer":
        from torchsupervisor.tiers.peer import fetch_snapshot
        address, token, step, root, directory = source
        source = fetch_snapshot(address, token, 0, step, root, directory)
    t3 = time.perf_counter()
    if which == "torch":
        data = torch.load(source, weights_only=True)
        state["model"].load_state_dict(data["model"])
        state["optimizer"].load_state_dict(data["opt"])
    else:
        Saver().restore(Session(state), source)
    t4 = time.perf_counter()
    print(t1 - t0, t3 - t2, t4 - t3)
    """
)


def _restore_in_fresh_process(which: str, size_bytes: int, source: Any) -> dict[str, float]:
    """Restore in a fresh process: ``ours`` (a snapshot, every byte checked), ``torch``
    (``torch.load`` + ``load_state_dict``), ``peer`` (fetched from a ``PeerServer``, then as
    ``ours``; ``source``: its address, token, the step, the root and a directory to fetch into).
    """
    code = _RESTORE.format(here=HERE, size=size_bytes, which=which, source=source)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, check=True
    ).stdout.split()
    secs = {"import_torch_secs": float(out[0]), "restore_secs": float(out[1]) + float(out[2])}
    if which == "peer":
        secs["fetch_secs"] = float(out[1])
    return secs


# A peer node: a ``PeerServer`` in a process of its own (the copies it receives go to its
# directory on the tmpfs), until its stdin closes.
_PEER = textwrap.dedent(
    """
    import sys
    from torchsupervisor.tiers.peer import PeerServer
    server = PeerServer({root!r}, {run_dir!r}, "127.0.0.1", owners=(0,), keep=1)
    print(server.address, server.token, flush=True)
    sys.stdin.read()
    server.close(free=True)
    """
)

# The loopback's bandwidth: a process that reads ``size`` bytes from one connection into a
# reused buffer and answers when it has them all.
_SINK = textwrap.dedent(
    """
    import socket
    server = socket.create_server(("127.0.0.1", 0))
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    buffer, left = memoryview(bytearray(8 << 20)), {size}
    while left:
        got = conn.recv_into(buffer[: min(left, len(buffer))])
        if not got:
            raise SystemExit("closed early")
        left -= got
    conn.sendall(b"ok")
    """
)


def loopback_bandwidth(nbytes: int) -> float:
    """Bytes per second of one TCP connection on the loopback, another process reading
    ``nbytes`` sent from memory (the best of 3)."""
    payload = memoryview(bytearray(os.urandom(1 << 20)) * 8)
    best = float("inf")
    for _ in range(3):
        code = _SINK.format(size=nbytes)
        with subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True
        ) as sink:
            assert sink.stdout is not None
            port = int(sink.stdout.readline())
            with socket.create_connection(("127.0.0.1", port)) as conn:
                t0 = time.perf_counter()
                left = nbytes
                while left:
                    part = payload[: min(left, len(payload))]
                    conn.sendall(part)
                    left -= len(part)
                if conn.recv(2) != b"ok":
                    raise RuntimeError("the loopback sink failed")
                best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _peer_restore(size_bytes: int, nbytes: int, root: str, newest: str) -> dict[str, float]:
    """Send the snapshot ``newest`` to a peer process, then restore from its copy in a fresh
    process (fetched over the loopback into the tmpfs, every byte checked): seconds, with the
    loopback's bandwidth measured just before and the target 1.5 x bytes / that bandwidth."""
    scratch = tempfile.mkdtemp(prefix="memory-tier-peer-", dir=root)
    code = _PEER.format(root=scratch, run_dir=os.path.join(scratch, "peer-node"))
    try:
        with subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as peer:
            assert peer.stdin is not None and peer.stdout is not None
            address, token = peer.stdout.readline().split()
            send_snapshot(address, token, 0, newest)
            bandwidth = loopback_bandwidth(nbytes)
            fetched = os.path.join(scratch, "restarted", "rank-0")
            step = checkpoint_step(newest)
            row = _restore_in_fresh_process(
                "peer", size_bytes, (address, token, step, scratch, fetched)
            )
            peer.stdin.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    row["loopback_bytes_per_sec"] = bandwidth
    row["target_secs"] = 1.5 * nbytes / bandwidth
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'state':>9} {'memcpy':>9} {'stall':>9} {'stall/memcpy':>12} {'torch.save':>10} "
        f"{'train on/off':>12} {'restore':>9} {'target':>8} {'torch.load':>10} "
        f"{'from a peer':>11} {'fetch':>8} {'target':>8} {'loopback':>10}"
    )
    for r in rows:
        print(
            f"{r['bytes'] / MB:>7.0f}MB {r['memcpy_secs'] * 1e3:>7.1f}ms "
            f"{r['stall_secs'] * 1e3:>7.1f}ms {r['stall_secs'] / r['memcpy_secs']:>12.2f} "
            f"{r['torch_save_tmpfs_secs'] * 1e3:>8.1f}ms {r['training_ratio']:>12.3f} "
            f"{r['restore']['restore_secs']:>8.3f}s {r['restore_target_secs']:>7.3f}s "
            f"{r['torch_load']['restore_secs']:>9.3f}s "
            f"{r['peer_restore']['restore_secs']:>10.3f}s {r['peer_restore']['fetch_secs']:>7.3f}s "
            f"{r['peer_restore']['target_secs']:>7.3f}s "
            f"{r['peer_restore']['loopback_bytes_per_sec'] / 1e9:>6.2f}GB/s"
        )
    print(
        f"\nLocal-disk tier: {'state':>9} {'train on/off':>12} {'copy':>8} {'raw write':>9} "
        f"{'copy/raw':>8} {'cold restore':>12}"
    )
    for r in rows:
        d = r["local"]
        print(
            f"{'':>16} {r['bytes'] / MB:>7.0f}MB {d['training_ratio']:>12.3f} "
            f"{d['copy_secs']:>7.3f}s {d['raw_write_secs']:>8.3f}s "
            f"{d['copy_secs'] / d['raw_write_secs']:>8.2f} "
            f"{d['cold_restore']['restore_secs']:>11.3f}s"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100MB,500MB")
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--step-factor", type=float, default=20.0, help="a step's work in memcpys of the state"
    )
    default_root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    parser.add_argument("--memory-root", default=default_root, help="the tmpfs to use")
    parser.add_argument(
        "--local-dir", default=None, help="a directory on a disk for the local-disk tier"
    )
    parser.add_argument("--json", default=os.path.join(HERE, "results", "memory_tier.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    local = args.local_dir or tempfile.mkdtemp(prefix="memory-tier-local-")
    try:
        rows = [
            measure_size(
                parse_size(s), args.memory_root, local, args.steps, args.rounds, args.step_factor
            )
            for s in args.sizes.split(",")
        ]
    finally:
        if args.local_dir is None:
            shutil.rmtree(local, ignore_errors=True)
    print_table(rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": machine_facts(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
