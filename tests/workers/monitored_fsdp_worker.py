"""One rank of a MonitoredTrainingSession run with a sharded (FSDP2) state, for the tests.

Usage: python monitored_fsdp_worker.py LOGDIR =N [options]: train until global step N; the
process group comes from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as
``torchrun`` sets it.

The model is sharded with ``fully_shard`` over every rank (CPU, gloo) and trained with Adam.
Every step applies a dropout mask drawn from the rank's own generator (a resumed rank that
continued other streams than the run without the stop would show). Printed lines:

* ``READY <rank> <step> <restored checkpoint basename or None> <digest> <tier or None>`` when
  the session is up;
* ``STEP <rank> <step>`` after each step;
* ``SAVE <rank> <step>`` after each checkpoint this rank committed its part of;
* ``DONE <rank> <step> <digest>`` at the end of a session that ended without an error.

``<digest>`` is fsdp_worker's: a SHA-256 of the full tensors of the model and optimizer.

Options:
    --save-steps N      save_checkpoint_steps
    --save-secs SECS    save_checkpoint_secs (default: none)
    --step-delay SECS   sleep in every step
    --raise-at STEP     rank 1 raises RuntimeError at that step (inside a step)
    --kill-at STEP      rank 1 kills itself (SIGKILL) inside the step that starts there
    --memory-root DIR   every rank keeps a memory tier there (a snapshot every step)
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import time

import torch
from fsdp_worker import digest, say, sharded_model
from worker_exit import run_and_exit

import torchsupervisor as ts
from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState
from torchsupervisor.core.global_step import read_step


class Created(ts.SessionRunHook):
    """Keeps the session the monitored session created (its ``restored_checkpoint``)."""

    def after_create_session(self, session, coord) -> None:
        self.session = session


class PrintingSaver(ts.Saver):
    """Prints ``SAVE <rank> <step>`` once this rank's part of a checkpoint is committed."""

    rank = 0

    def save(self, sess, save_path, global_step=None, **kwargs):
        prefix = super().save(sess, save_path, global_step=global_step, **kwargs)
        if prefix is not None:
            say(f"SAVE {self.rank} {read_step(global_step)}")
        return prefix

    def save_async(self, sess, save_path, global_step=None, **kwargs):
        step = read_step(global_step)
        future = super().save_async(sess, save_path, global_step=global_step, **kwargs)
        future.add_done_callback(lambda f: f.exception() or say(f"SAVE {self.rank} {step}"))
        return future


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("logdir")
    parser.add_argument("target")
    parser.add_argument("--save-steps", type=int)
    parser.add_argument("--save-secs", type=float)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--raise-at", type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--memory-root")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(150, exit=True)  # Never outlive a broken test.
    ts.distributed.connect("env://", timeout_secs=60)
    rank, world = ts.distributed.rank(), ts.distributed.world_size()
    model, optimizer, step = sharded_model(world)  # The same initial weights on every rank.
    state = {"model": model, "optimizer": ShardedOptimizerState(model, optimizer)}
    saver = PrintingSaver(max_to_keep=None)
    saver.rank = rank
    torch.manual_seed(1000 + rank)  # Each rank's own stream of dropout masks.
    created = Created()
    with ts.MonitoredTrainingSession(
        hooks=[created],
        master="env://",
        checkpoint_dir=args.logdir,
        scaffold=ts.Scaffold(saver=saver),
        state={**state, "global_step": step},
        save_checkpoint_steps=args.save_steps,
        save_checkpoint_secs=args.save_secs,
        save_summaries_steps=0,
        log_step_count_steps=0,
        memory_tier=ts.MemoryTierConfig(root=args.memory_root) if args.memory_root else None,
    ) as sess:
        restored = created.session.restored_checkpoint
        name = os.path.basename(restored) if restored else None
        tier = created.session.restored_tier
        say(f"READY {rank} {step.value} {name} {digest(state)} {tier}")
        target = int(args.target.lstrip("="))

        def train() -> None:
            if rank == 1 and step.value == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 1 and step.value == args.raise_at:
                raise RuntimeError(f"rank 1 fails at step {step.value}")
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step.value))
            mask = (torch.rand(8, 8) > 0.3).float()  # This rank's own stream.
            model(x[rank::world] * mask).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if args.step_delay:
                time.sleep(args.step_delay)

        while not sess.should_stop() and step.value < target:
            sess.run(train)
            say(f"STEP {rank} {step.value}")
    say(f"DONE {rank} {step.value} {digest(state)}")


if __name__ == "__main__":
    run_and_exit(main)
