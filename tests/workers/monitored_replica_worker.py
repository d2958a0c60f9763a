"""One replica of a MonitoredTrainingSession run on 2 ranks (gloo), for the replica tests.

Usage: python monitored_replica_worker.py LOGDIR STEPS; the process group comes from the
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as ``torchrun`` sets it.

``MonitoredTrainingSession(master="env://")`` is given no ``is_chief``: rank 0 must become the
chief. Each rank seeds its model differently, so a non-chief that kept its own weights would
show. It prints ``READY <rank> <step> <digest of the weights>`` when the session is up and
``DONE <rank> <step> <digest>`` at the end.
"""

from __future__ import annotations

import hashlib
import os
import sys

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
    logdir, steps = sys.argv[1], int(sys.argv[2])
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
        checkpoint_dir=logdir,
        state=state,
        save_checkpoint_secs=3600,
        save_summaries_steps=0,
        log_step_count_steps=0,
    ) as sess:
        say(f"READY {rank} {step.value} {digest(model.module)}")
        target = step.value + steps

        def train(x: torch.Tensor) -> None:
            optimizer.zero_grad()
            model(x[rank::2]).pow(2).mean().backward()
            optimizer.step()

        while not sess.should_stop() and step.value < target:
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step.value))
            sess.run(train, feed_dict={"x": x})
    say(f"DONE {rank} {step.value} {digest(model.module)}")


if __name__ == "__main__":
    run_and_exit(main)
