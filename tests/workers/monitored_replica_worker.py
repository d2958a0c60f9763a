"""One replica of a MonitoredTrainingSession run on 2 ranks (gloo), for the replica tests.

Usage: python monitored_replica_worker.py LOGDIR STEPS [options] (STEPS: that many steps, or
``=N``: until global step N); the process group comes from the environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as ``torchrun`` sets it.

Options:
    --memory-root DIR    the chief keeps a memory tier there (a snapshot every step)
    --kill-at N          rank 1 kills itself (SIGKILL) inside the step that starts at step N
    --raise-at N         rank 1 raises ``RuntimeError`` inside the step that starts at step N
    --step-delay SECS    sleep in every step (so that signals land mid-run)

``MonitoredTrainingSession(master="env://")`` is given no ``is_chief``: rank 0 must become the
chief. Each rank seeds its model differently, so a non-chief that kept its own weights would
show. Every step draws a dropout mask from each rank's own generator (so that a rank that
resumed with other streams than the run without the kill would show). It prints
``READY <rank> <step> <digest of the weights>`` when the session is up, ``STEP <rank> <step>``
after each step, and ``DONE <rank> <step> <digest>`` at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from worker_exit import run_and_exit

import torchsupervisor as ts


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for tensor in model.state_dict().values():
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("logdir")
    parser.add_argument("steps")
    parser.add_argument("--memory-root")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--raise-at", type=int)
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args()
    memory_root, steps = args.memory_root, args.steps
    rank = int(os.environ["RANK"])
    ts.distributed.connect("env://", timeout_secs=120)
    torch.manual_seed(100 + rank)  # Different initial weights on every rank.
    model = DistributedDataParallel(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = ts.GlobalStep()
    step.bind(optimizer)
    state = {"model": model, "optimizer": optimizer, "global_step": step}
    with ts.MonitoredTrainingSession(
        master="env://",
        checkpoint_dir=args.logdir,
        state=state,
        save_checkpoint_secs=3600,
        save_summaries_steps=0,
        log_step_count_steps=0,
        memory_tier=None if memory_root is None else ts.MemoryTierConfig(root=memory_root),
    ) as sess:
        say(f"READY {rank} {step.value} {digest(model.module)}")
        target = int(steps[1:]) if steps.startswith("=") else step.value + int(steps)

        def train(x: torch.Tensor) -> None:
            if rank == 1 and step.value == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 1 and step.value == args.raise_at:
                raise RuntimeError(f"rank 1 fails at step {step.value}")
            time.sleep(args.step_delay)
            optimizer.zero_grad()
            mask = (torch.rand(4, 4) > 0.3).float()  # This rank's own stream.
            model(x[rank::2] * mask).pow(2).mean().backward()
            optimizer.step()

        while not sess.should_stop() and step.value < target:
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step.value))
            sess.run(train, feed_dict={"x": x})
            say(f"STEP {rank} {step.value}")
    say(f"DONE {rank} {step.value} {digest(model.module)}")


if __name__ == "__main__":
    run_and_exit(main)
