"""Rank 0 dies (SIGKILL) right after joining, as a rank killed in the first seconds of a
start; rank 1 waits for its word, as a non-chief at a start does. Run under ``torchrun``
(its agent hosts the store, which outlives rank 0).

Usage: torchrun --standalone --nproc_per_node=2 startup_death_worker.py

With ``before-group`` (started as 2 plain processes: rank 0 hosts the store), rank 1 dies
right after joining, before it makes any ``ReplicaGroup`` (as a rank killed while it builds
its model), and rank 0 waits for its post in an agreement; rank 0 prints ``GONE`` as above.

Rank 1 keeps running through torchrun's SIGTERM (as under a Supervisor, whose handler
records the signal and lets the wait go on) and prints ``GONE <seconds waited> <ranks>``
when its wait ends because rank 0 is gone, or ``READY`` (never: rank 0 dies first).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torchsupervisor as ts
from torchsupervisor.distributed.replicas import ReplicaGroup
from torchsupervisor.errors import ReplicaGoneError


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM", flush=True))
    ts.distributed.connect("env://")
    if sys.argv[1:] == ["before-group"]:
        if ts.distributed.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        group = ReplicaGroup(1)
        group.post("x", 1)
        started = time.monotonic()
        try:
            group.gather("x", 120, what="Agreeing")
        except ReplicaGoneError as e:
            print(f"GONE {time.monotonic() - started:.1f} {e.ranks}", flush=True)
            sys.exit(3)
        print("READY", flush=True)
        return
    group = ReplicaGroup(1)
    if group.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        group.wait_ready(0.05, 120)
    except ReplicaGoneError as e:
        print(f"GONE {time.monotonic() - started:.1f} {e.ranks}", flush=True)
        sys.exit(3)
    print("READY", flush=True)


if __name__ == "__main__":
    main()
