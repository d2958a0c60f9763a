"""A training process that the crash tests kill with SIGKILL at a chosen point.

Usage: python crash_worker.py LOGDIR STAGE

It trains a model whose weight equals the global step, under a Supervisor. It checkpoints at
step 10 normally, then arms a file system that stops at ``STAGE`` (e.g. ``write:1`` = the first
write of the next save, ``rename:2`` = the index rename) and checkpoints at step 20. At the
armed stage it prints ``STALLED`` and sleeps until killed. With ``STAGE`` ``none`` it trains to
step 20 and exits. It always prints ``RESTORED <step>`` first.
"""

from __future__ import annotations

import sys
import time

import torch

import torchsupervisor as ts
from torchsupervisor.testing import FaultyStorage


def stall(path: str) -> None:
    print("STALLED", flush=True)
    while True:
        time.sleep(1)


def main() -> None:
    logdir, stage = sys.argv[1], sys.argv[2]
    weight = torch.zeros(1000)
    step = ts.GlobalStep()
    storage = FaultyStorage()
    sv = ts.Supervisor(
        logdir=logdir,
        state={"w": weight, "global_step": step},
        saver=ts.Saver(storage=storage),
        save_model_secs=3600,
        save_summaries_secs=0,
    )

    def train_step() -> None:
        weight.add_(1)
        step.increment()

    with sv.managed_session() as sess:
        print(f"RESTORED {step.value} {int(weight[0])}", flush=True)
        while step.value < 10:
            sess.run(train_step)
        sv.checkpoint()
        if stage != "none":  # Stop (and wait for the kill) at that stage of the next save.
            operation, _, nth = stage.partition(":")
            storage.fail(operation, nth=int(nth or 1), before=stall)
        while step.value < 20:
            sess.run(train_step)
        sv.checkpoint()


if __name__ == "__main__":
    main()
