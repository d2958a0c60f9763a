"""One process of the goodput benchmark (``benchmarks/goodput.py``): a Supervisor training loop
whose costs are injected and timed by the worker itself, apart from the ledger.

Every step is ``--step-secs`` of fixed work (``--state-mb`` of state changed in it); batches
come from a ``ResumableDataLoader`` whose dataset sleeps ``--data-secs`` for every
``--data-every``-th batch (slow input); checkpoints go to storage whose fsyncs take
``--fsync-secs`` (slow storage: the final checkpoint after a stop waits for it). The worker
appends its own truth to ``--truth`` (a line per event, flushed, so a kill leaves what came
before):

* ``data SECS``: each injected input wait, as the dataset slept it;
* ``boundary SECS``: the time ``should_stop()`` took when it took a snapshot;
* ``ready T``: the session is ready (restored or initialized);
* ``step N T``: step N completed (the global step is N) at T;
* ``stop T`` and ``end T``: when the loop saw the stop, and when the session had ended;
* ``die N``: the worker is about to SIGKILL itself at step N (``--die-at-step``).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from torch.utils.data import Dataset

import torchsupervisor as ts
from torchsupervisor.input.data import ResumableDataLoader
from torchsupervisor.testing import FaultyStorage


class SlowData(Dataset):
    def __init__(self, size: int, every: int, secs: float, truth) -> None:
        self.size, self.every, self.secs, self.truth = size, every, secs, truth

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.every and index % self.every == 0:
            time.sleep(self.secs)
            self.truth(f"data {self.secs}")
        return torch.full((4,), float(index))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("logdir")
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--truth", required=True)
    parser.add_argument("--step-secs", type=float, default=0.05)
    parser.add_argument("--data-every", type=int, default=25)
    parser.add_argument("--data-secs", type=float, default=0.2)
    parser.add_argument("--fsync-secs", type=float, default=0.0)
    parser.add_argument("--save-secs", type=float, default=2.0)
    parser.add_argument("--die-at-step", type=int, default=None)
    parser.add_argument("--state-mb", type=int, default=0, help="a tensor changed every step")
    args = parser.parse_args()
    truth_file = open(args.truth, "a", buffering=1)  # noqa: SIM115 (open for the process)

    def truth(line: str) -> None:
        truth_file.write(line + "\n")

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = ts.GlobalStep()
    step.bind(optimizer)
    loader = ResumableDataLoader(
        SlowData(10_000, args.data_every, args.data_secs, truth),
        batch_size=1,
        shuffle=False,
        global_step=step,
    )
    state = {"model": model, "optimizer": optimizer, "global_step": step, "data": loader}
    if args.state_mb:
        state["big"] = torch.zeros(args.state_mb * (1 << 18))
    storage = FaultyStorage()
    if args.fsync_secs:
        storage.delay("fsync", args.fsync_secs)
    sv = ts.Supervisor(
        logdir=args.logdir,
        state=state,
        saver=ts.Saver(storage=storage),
        save_model_secs=args.save_secs,
        save_summaries_secs=0,
        preemption_grace_secs=60,
    )
    with sv.managed_session() as sess:
        truth(f"ready {time.time()}")
        while step.value < args.max_steps:
            for x in loader:
                started = time.perf_counter()
                stop = sv.should_stop()
                took = time.perf_counter() - started
                if took > 1e-3:  # A snapshot at this boundary (µs otherwise).
                    truth(f"boundary {took}")
                if stop or step.value >= args.max_steps:
                    break

                def train_step(x: torch.Tensor = x) -> None:
                    deadline = time.perf_counter() + args.step_secs
                    optimizer.zero_grad()
                    model(x).sum().backward()
                    optimizer.step()
                    if args.state_mb:
                        state["big"].add_(1.0)
                    while time.perf_counter() < deadline:  # Fixed work, not a sleep.
                        pass

                sess.run(train_step)
                truth(f"step {step.value} {time.time()}")
                if args.die_at_step is not None and step.value >= args.die_at_step:
                    truth(f"die {step.value}")
                    os.kill(os.getpid(), signal.SIGKILL)
            if sv.should_stop():
                break
        truth(f"stop {time.time()}")
    truth(f"end {time.time()}")


if __name__ == "__main__":
    main()
