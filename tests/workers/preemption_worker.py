"""A training run that the preemption tests stop with signals and restart.

Usage: python preemption_worker.py LOGDIR MAX_STEPS [options]

It trains a small MLP with dropout on a fixed synthetic dataset read through a shuffled
``ResumableDataLoader`` with two worker processes, under a Supervisor (RNG state saved by
default). It prints ``READY <step>`` once the session is up, ``LOSS <step> <value>`` for every
step (the step of the state the loss was computed on, and the exact float), ``COMMITTED
<step>`` once the first checkpoint save has finished (its last fsync included), and at the end
``DONE <step> <sha256 of the parameters>``.

Options:
    --step-delay SECS      sleep in every step (so that signals land mid-run)
    --save-model-secs S    checkpoint interval (default 0.05)
    --big MB               add a frozen-free buffer of this size that changes every step, so
                           that checkpoints take a while to write
    --slow-fsync SECS      make every fsync of checkpoint files take this long
    --grace SECS           preemption_grace_secs
    --exit-code N          preemption_exit_code
    --slow-start SECS      sleep inside init_fn (SIGTERM during start-up)
    --gate PATH            hold one checkpoint write: once armed, the first fsync of checkpoint
                           files prints ``STALLED`` and waits until PATH exists, then prints
                           ``RELEASED`` (a save deterministically in flight)
    --gate-after-step N    arm the gate once the global step reaches N (default 0)
    --gate-on-signal       arm the gate only once a preemption signal was received (holds the
                           final checkpoint)
    --signals NAMES        preemption signals, comma-separated (default: the Supervisor's,
                           SIGTERM, SIGUSR1 and SIGINT)
    --full-disk-on-signal  once a preemption signal was received, every write of a checkpoint
                           file fails with ENOSPC (the final checkpoint fails)
    --scalars              write each step's loss as the scalar ``loss`` at its step
    --die-at-step N        SIGKILL itself once the global step reaches N (a crash at a known step)
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import os
import signal
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchsupervisor as ts
from torchsupervisor.input.data import ResumableDataLoader
from torchsupervisor.testing import FaultyStorage


def say(line: str) -> None:
    """Print one line with a single write (the writer thread prints too)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Trigger:
    """When the injected fault acts: a predicate set once the Supervisor exists."""

    def __init__(self) -> None:
        self.armed: Callable[[], bool] = lambda: False
        self.used = False


def fill_disk_when(trigger: Trigger) -> Callable[[str], None]:
    """A watch on writes: ENOSPC once ``trigger`` is armed."""

    def write(path: str) -> None:
        if trigger.armed():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    return write


def hold_once_when(trigger: Trigger, gate: str) -> Callable[[str], None]:
    """A watch on fsyncs: the first one after ``trigger`` is armed waits for the gate file."""

    def fsync(path: str) -> None:
        if trigger.used or not trigger.armed():
            return
        trigger.used = True
        say("STALLED")
        deadline = time.monotonic() + 120
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        say("RELEASED")

    return fsync


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("logdir")
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--save-model-secs", type=float, default=0.05)
    parser.add_argument("--big", type=int, default=0)
    parser.add_argument("--slow-fsync", type=float, default=0.0)
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("--exit-code", type=int, default=None)
    parser.add_argument("--slow-start", type=float, default=0.0)
    parser.add_argument("--gate", default=None)
    parser.add_argument("--gate-after-step", type=int, default=0)
    parser.add_argument("--gate-on-signal", action="store_true")
    parser.add_argument("--signals", default=None)
    parser.add_argument("--full-disk-on-signal", action="store_true")
    parser.add_argument("--scalars", action="store_true")
    parser.add_argument("--die-at-step", type=int, default=None)
    args = parser.parse_args()

    data = torch.Generator().manual_seed(1234)
    features = torch.randn(512, 16, generator=data)
    labels = torch.randint(0, 4, (512,), generator=data)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = ts.GlobalStep()
    step.bind(optimizer)
    loader = ResumableDataLoader(
        TensorDataset(features, labels),
        batch_size=32,
        shuffle=True,
        seed=7,
        num_workers=2,
        global_step=step,
    )
    state = {"model": model, "optimizer": optimizer, "global_step": step, "data": loader}
    if args.big:
        state["big"] = torch.zeros(args.big * 250_000)
    storage = None
    trigger = Trigger()
    if args.full_disk_on_signal or args.gate or args.slow_fsync:
        storage = FaultyStorage()
        if args.full_disk_on_signal:
            storage.watch("write", fill_disk_when(trigger))
        elif args.gate:
            storage.watch("fsync", hold_once_when(trigger, args.gate))
        if args.slow_fsync and not args.full_disk_on_signal:
            storage.delay("fsync", args.slow_fsync)
    saver = ts.Saver(storage=storage) if storage is not None else ts.Supervisor.USE_DEFAULT

    def slow_start(sess: ts.Session) -> None:
        say("STARTING")
        time.sleep(args.slow_start)

    sv = ts.Supervisor(
        logdir=args.logdir,
        state=state,
        saver=saver,
        save_model_secs=args.save_model_secs,
        save_summaries_secs=0,
        init_fn=slow_start if args.slow_start else None,
        preemption_grace_secs=args.grace,
        preemption_exit_code=args.exit_code,
        **(
            {"preemption_signals": [getattr(signal, n) for n in args.signals.split(",")]}
            if args.signals
            else {}
        ),
    )
    if args.full_disk_on_signal or (args.gate and args.gate_on_signal):
        trigger.armed = lambda: sv.preempted is not None
    elif args.gate:
        trigger.armed = lambda: step.value >= args.gate_after_step

    def train_step(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if args.big:
            state["big"].add_(1)
        if args.step_delay:
            time.sleep(args.step_delay)
        return loss.item()

    committed = False
    with sv.managed_session() as sess:
        say(f"READY {step.value}")
        while not sv.should_stop() and step.value < args.max_steps:
            for x, y in loader:
                if sv.should_stop() or step.value >= args.max_steps:
                    break
                current = step.value
                loss = sess.run(train_step, feed_dict={"x": x, "y": y})
                say(f"LOSS {current} {loss!r}")
                if args.scalars:
                    sv.summary_writer.add_scalar("loss", loss, current)
                if args.die_at_step is not None and step.value >= args.die_at_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                driver = sv.checkpoint_driver
                if not committed and driver is not None and driver.last_commit_time is not None:
                    committed = True  # The first save finished, its last fsync included.
                    say(f"COMMITTED {driver.last_step}")
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.numpy().tobytes())
    say(f"DONE {step.value} {digest.hexdigest()}")


if __name__ == "__main__":
    main()
