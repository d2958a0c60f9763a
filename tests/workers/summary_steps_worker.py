"""The documented training loops, logging a loss every step, for the summary-step tests.

Usage: python summary_steps_worker.py LOGDIR LOOP MAX_STEPS

LOOP is one of:

* ``readme``: the README's loop (``sess.run(train_step)``, then ``add_scalar`` at
  ``step.value``);
* ``quickstart``: the quickstart's loop (the step inline between two ``should_stop()``);
* ``monitored``: ``MonitoredTrainingSession`` with its hooks (a summary op written by
  ``SummarySaverHook`` every step as ``hook/loss``, ``StepCounterHook``,
  ``CheckpointSaverHook``) and the loop's own ``add_scalar`` after ``sess.run``.

Every loop checkpoints every 0.3 s and prints ``STEP <n>`` once it has logged step ``n``,
``RESTORED <n>`` at the start and ``DONE <n>`` at the end. A step takes at least 20 ms.
"""

from __future__ import annotations

import sys
import time

import torch

import torchsupervisor as ts

SAVE_SECS = 0.3
STEP_SECS = 0.02


def main(logdir: str, loop: str, max_steps: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(10, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = ts.GlobalStep()
    step.bind(optimizer)  # every optimizer.step() adds 1
    x = torch.randn(32, 10)

    def train_step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        time.sleep(STEP_SECS)
        return loss.detach()

    state = {"model": model, "optimizer": optimizer, "global_step": step}
    if loop == "monitored":
        last = {"loss": 0.0}
        ts.summary.scalar("hook/loss", lambda: last["loss"])
        with ts.MonitoredTrainingSession(
            checkpoint_dir=logdir,
            state=state,
            hooks=[ts.StopAtStepHook(last_step=max_steps)],
            save_checkpoint_secs=SAVE_SECS,
            save_summaries_steps=1,
            log_step_count_steps=50,
        ) as sess:
            print(f"RESTORED {step.value}", flush=True)
            writer = ts.SummaryWriterCache.get(logdir)
            while not sess.should_stop():
                loss = sess.run(train_step)
                last["loss"] = float(loss)
                writer.add_scalar("loss", loss, step.value)
                print(f"STEP {step.value}", flush=True)
    else:
        sv = ts.Supervisor(logdir=logdir, state=state, save_model_secs=SAVE_SECS)
        with sv.managed_session() as sess:
            print(f"RESTORED {step.value}", flush=True)
            while not sv.should_stop() and step.value < max_steps:
                if loop == "readme":
                    loss = sess.run(train_step)
                else:  # The quickstart: the step inline.
                    optimizer.zero_grad()
                    loss = model(x).pow(2).mean()
                    loss.backward()
                    optimizer.step()
                    time.sleep(STEP_SECS)
                sv.summary_writer.add_scalar("loss", loss, step.value)
                print(f"STEP {step.value}", flush=True)
    print(f"DONE {step.value}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
