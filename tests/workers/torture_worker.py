"""A training process for the crash-torture test: checkpoints constantly, gets killed at random.

Usage: python torture_worker.py LOGDIR [MAX_STEPS]

The state is a weight vector whose every element equals the global step (each step adds 1 to
both), plus a large buffer stamped with the step, so a checkpoint mixing two steps or holding
half-written bytes is detectable. It checkpoints every 20 ms in the background, so a kill at a
random moment often lands inside a save. On start it prints ``RESTORED <step> <ok>`` where
``ok`` says whether the restored state is exactly the state of that step, then ``TRAINING``,
then trains until killed (or stopped by a signal, or up to MAX_STEPS), and prints
``STOPPED <step>`` when it ends cleanly.
"""

from __future__ import annotations

import sys

import torch

import torchsupervisor as ts


def main() -> None:
    logdir = sys.argv[1]
    max_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10**9
    weight = torch.zeros(1000)
    stamp = torch.zeros(4_000_000)  # 16 MB: saves take a while.
    step = ts.GlobalStep()
    sv = ts.Supervisor(
        logdir=logdir,
        state={"w": weight, "stamp": stamp, "global_step": step},
        save_model_secs=0.02,
        save_summaries_secs=0,
    )

    def train_step() -> None:
        weight.add_(1)
        stamp.fill_(float(step.value + 1))
        step.increment()

    with sv.managed_session() as sess:
        expected = float(step.value)
        ok = bool((weight == expected).all() and (stamp == expected).all())
        print(f"RESTORED {step.value} {ok}", flush=True)
        print("TRAINING", flush=True)
        while not sv.should_stop() and step.value < max_steps:
            sess.run(train_step)
    print(f"STOPPED {step.value}", flush=True)


if __name__ == "__main__":
    main()
