"""A training process with the memory tier on, which the memory-tier tests kill with SIGKILL.

Usage: python memory_tier_worker.py LOGDIR MEMORY_BASE MAX_STEPS FRONT_END [SAVE_MODEL_SECS]

It trains a small MLP on batches drawn from torch's generator (so a resumed run is bitwise
equal to an uninterrupted one only if the state, the optimizer and the generators are all
restored), with a memory-tier snapshot every step, under a ``Supervisor`` (FRONT_END
``supervisor``) or a ``MonitoredTrainingSession`` (``monitored``). The disk tier checkpoints
every SAVE_MODEL_SECS (default 3600: in practice only at the start and the end).

It prints ``RESUMED <step> <tier>`` first, ``STEP <n>`` once step n is complete (before its
step boundary), and at the end ``DONE <step> <sha256 of every tensor of the state>``.
"""

from __future__ import annotations

import hashlib
import sys

import torch

import torchsupervisor as ts


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for tensor in model.state_dict().values():
        h.update(tensor.numpy().tobytes())
    for state in optimizer.state_dict()["state"].values():
        for value in state.values():
            h.update(torch.as_tensor(value).numpy().tobytes())
    return h.hexdigest()


class Created(ts.SessionRunHook):
    """Keeps the session the monitored session created (its ``restored_tier``)."""

    def after_create_session(self, session, coord) -> None:
        self.session = session


def main() -> None:
    logdir, base, max_steps, front_end = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    save_secs = float(sys.argv[5]) if len(sys.argv) > 5 else 3600.0
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = ts.GlobalStep()
    state = {"model": model, "optimizer": optimizer, "global_step": step}
    memory = ts.MemoryTierConfig(every_n_steps=1, root=base)

    def train_step() -> None:
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step.increment()

    if front_end == "supervisor":
        sv = ts.Supervisor(
            logdir=logdir,
            state=state,
            save_model_secs=save_secs,
            save_summaries_secs=0,
            memory_tier=memory,
        )
        with sv.managed_session() as sess:
            print(f"RESUMED {step.value} {sess.restored_tier}", flush=True)
            while not sv.should_stop() and step.value < max_steps:
                sess.run(train_step)
                print(f"STEP {step.value}", flush=True)
    else:
        created = Created()
        with ts.MonitoredTrainingSession(
            hooks=[created],
            checkpoint_dir=logdir,
            state=state,
            save_checkpoint_secs=save_secs,
            save_summaries_steps=None,
            log_step_count_steps=None,
            memory_tier=memory,
        ) as sess:
            print(f"RESUMED {step.value} {created.session.restored_tier}", flush=True)
            while not sess.should_stop() and step.value < max_steps:
                sess.run(train_step)
                print(f"STEP {step.value}", flush=True)
    print(f"DONE {step.value} {digest(model, optimizer)}", flush=True)


if __name__ == "__main__":
    main()
