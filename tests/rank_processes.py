"""Start a script as the ranks of a process group (as ``torchrun`` would: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port of 127.0.0.1) and collect
what each printed."""

from __future__ import annotations

import os
import subprocess
import sys

from free_ports import free_port


def start_ranks(script: str, *args: object, world_size: int = 2) -> list[subprocess.Popen]:
    """Start ``python script args...`` as ``world_size`` ranks (text pipes for stdout and
    stderr); return the processes, by rank."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
        env.update(WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *map(str, args)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def run_ranks(
    script: str, *args: object, world_size: int = 2, timeout: float = 180
) -> list[tuple[str, str, int]]:
    """Run ``python script args...`` as ``world_size`` ranks; return each rank's stdout,
    stderr and exit status, by rank (after at most ``timeout`` seconds each)."""
    procs = start_ranks(script, *args, world_size=world_size)
    return [(*p.communicate(timeout=timeout), p.returncode) for p in procs]
