"""A MonitoredTrainingSession training run that the preemption tests stop with signals.

Usage: python monitored_preemption_worker.py LOGDIR MAX_STEPS [options]

It trains a small MLP with dropout (so the RNG state matters) on fixed synthetic data, the
batch chosen by the global step, under ``MonitoredTrainingSession`` with a
``StopAtStepHook(last_step=MAX_STEPS)``. It prints ``READY <step>`` once the session is up,
``LOSS <step> <value>`` for every step (the step of the state the loss was computed on, and
the exact float), and after the ``with`` block ``DONE <step> <sha256 of the parameters>``.

Options:
    --step-delay SECS    sleep in every step (so that signals land mid-run)
    --save-steps N       save_checkpoint_steps (default 25)
    --slow-fsync SECS    make every fsync of checkpoint files take this long
    --exit-code N        preemption_exit_code
    --slow-start SECS    print STARTING, then sleep inside init_fn (a signal during start-up)
    --wait-go            print LOADED, then wait for a line on stdin before creating the
                         session (tests start workers early, so imports overlap)
    --summaries          a ``loss`` summary op written every step (save_summaries_steps=1),
                         the events flushed after every step
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import torch
from torch import nn

import torchsupervisor as ts
from torchsupervisor.testing import FaultyStorage

BATCHES = 16
BATCH_SIZE = 32


def slow_storage(delay_secs: float) -> FaultyStorage:
    storage = FaultyStorage()
    storage.delay("fsync", delay_secs)
    return storage


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("logdir")
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--save-steps", type=int, default=25)
    parser.add_argument("--slow-fsync", type=float, default=0.0)
    parser.add_argument("--exit-code", type=int, default=None)
    parser.add_argument("--slow-start", type=float, default=0.0)
    parser.add_argument("--wait-go", action="store_true")
    parser.add_argument("--summaries", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # Several workers share the CPU; same numbers in every run.

    data = torch.Generator().manual_seed(1234)
    features = torch.randn(BATCHES * BATCH_SIZE, 16, generator=data)
    labels = torch.randint(0, 4, (BATCHES * BATCH_SIZE,), generator=data)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = ts.GlobalStep()
    step.bind(optimizer)
    state = {"model": model, "optimizer": optimizer, "global_step": step}

    def slow_start(scaffold: ts.Scaffold, sess: ts.Session) -> None:
        print("STARTING", flush=True)
        time.sleep(args.slow_start)

    saver = ts.Saver(storage=slow_storage(args.slow_fsync)) if args.slow_fsync else None
    scaffold = ts.Scaffold(init_fn=slow_start if args.slow_start else None, saver=saver)

    last = {"loss": 0.0}
    if args.summaries:
        ts.summary.scalar("loss", lambda: last["loss"])

    def train_step() -> float:
        start = step.value % BATCHES * BATCH_SIZE
        x, y = features[start : start + BATCH_SIZE], labels[start : start + BATCH_SIZE]
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if args.step_delay:
            time.sleep(args.step_delay)
        last["loss"] = loss.item()
        return last["loss"]

    if args.wait_go:
        print("LOADED", flush=True)
        if not sys.stdin.readline():
            return
    with ts.MonitoredTrainingSession(
        checkpoint_dir=args.logdir,
        scaffold=scaffold,
        state=state,
        hooks=[ts.StopAtStepHook(last_step=args.max_steps)],
        save_checkpoint_steps=args.save_steps,
        save_summaries_steps=1 if args.summaries else 0,
        log_step_count_steps=0,
        preemption_exit_code=args.exit_code,
    ) as sess:
        print(f"READY {step.value}", flush=True)
        while not sess.should_stop():
            current = step.value
            loss = sess.run(train_step)
            print(f"LOSS {current} {loss!r}", flush=True)
            if args.summaries:
                ts.SummaryWriterCache.get(args.logdir).flush()
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.numpy().tobytes())
    print(f"DONE {step.value} {digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
