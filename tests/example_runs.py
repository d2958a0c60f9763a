"""The distributed examples under ``torchrun --standalone`` for the end-to-end tests: started
with their output in ``<workdir>/out.log`` and their memory tier in ``<workdir>/shm``, waited
for to the end, their ranks signalled."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from process_tree import children, rank_of
from repo_paths import repo


def start_example(
    example: str, logdir, workdir, *args: str, restarts: int = 0, nproc: int = 2
) -> subprocess.Popen:
    """Start ``examples/<example> --logdir logdir args...`` on ``nproc`` ranks (appending to
    ``out.log``; ``TORCHSUPERVISOR_MEMORY_ROOT`` is ``<workdir>/shm``)."""
    (workdir / "shm").mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        *("-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"),
        f"--max-restarts={restarts}",
        repo("examples", example),
        *("--logdir", str(logdir), *args),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCHSUPERVISOR_MEMORY_ROOT": str(workdir / "shm"),
    }
    log = open(workdir / "out.log", "a")  # noqa: SIM115 (the child holds it; closed on exit)
    try:
        return subprocess.Popen(
            command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, text=True, env=env
        )
    finally:
        log.close()


def finish(process: subprocess.Popen, workdir, timeout: float = 300) -> str:
    """Wait for ``process`` to end with status 0 (killed if it does not); return its log."""
    try:
        assert process.wait(timeout) == 0, (workdir / "out.log").read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    return (workdir / "out.log").read_text()


def signal_rank(process: subprocess.Popen, rank: int, sig: int) -> None:
    """Send ``sig`` to the worker of ``rank`` among ``process``'s children."""
    os.kill(next(p for p in children(process.pid) if rank_of(p) == rank), sig)


def wait_until(process: subprocess.Popen, workdir, ready, what: str, timeout: float = 180) -> None:
    """Wait until ``ready()`` (looked at every 20 ms); if ``process`` ends first or ``timeout``
    seconds pass, kill it and fail with ``what`` and the log's end."""
    deadline = time.monotonic() + timeout
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            ended = process.poll()
            if ended is None:
                process.kill()
                process.wait(30)
            log = (workdir / "out.log").read_text()[-3000:]
            raise AssertionError(f"{what} in {timeout:g} s (exit status {ended}):\n{log}")
        time.sleep(0.02)
