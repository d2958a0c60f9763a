"""A supervised training run for the restart-fidelity test (run as a subprocess).

    python restart_worker.py LOGDIR RUN_ID CHECKPOINT_STEP LAST_STEP [--hang]

Trains a tiny model under a ``Supervisor`` from the newest checkpoint of LOGDIR up to step
LAST_STEP, writing two series labeled with the step of the state they were computed on
(``loss`` at step ``s``: computed on the state at step ``s``, by the training step that moves
it to ``s + 1``; ``eval`` every 5 steps and at the start). The library's rule labels a step's
loss with the count it reaches (``s + 1``); this labelling logs the restored step again after
a restart, and that point replaces the earlier one (``summary/restarts.py``). Values encode
the run: ``RUN_ID * 1000 + step``. At CHECKPOINT_STEP it commits a checkpoint
(``sv.checkpoint()``). With ``--hang``, after LAST_STEP it flushes the summaries, prints
``READY`` and sleeps: the test kills it with SIGKILL, leaving summaries past the last
checkpoint on disk and no final checkpoint; without, it ends normally.
"""

from __future__ import annotations

import sys
import threading

import torch

from torchsupervisor import GlobalStep, Graph, Supervisor


def main(argv: list[str]) -> int:
    logdir, run_id, checkpoint_step, last_step = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    hang = "--hang" in argv
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = GlobalStep()
    step.bind(optimizer)
    x = torch.randn(8, 4)

    def train_step() -> None:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()

    def value(s: int) -> float:
        return float(run_id * 1000 + s)

    with Graph().as_default():
        sv = Supervisor(
            logdir=logdir,
            state={"model": model, "optimizer": optimizer, "global_step": step},
            save_model_secs=3600,  # one checkpoint at the start, then only sv.checkpoint()
            save_summaries_secs=0,
            summary_op=None,
        )
        with sv.managed_session() as sess:
            writer = sv.summary_writer
            print(f"START {step.value}", flush=True)
            writer.add_scalar("eval", value(step.value), step.value)
            while step.value < last_step and not sv.should_stop():
                current = step.value
                if current == checkpoint_step:
                    sv.checkpoint()
                sess.run(train_step)
                writer.add_scalar("loss", value(current), current)
                if step.value % 5 == 0:
                    writer.add_scalar("eval", value(step.value), step.value)
            if hang:
                writer.flush()
                print("READY", flush=True)
                threading.Event().wait()  # until SIGKILL
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
