"""One replica of an FSDP2 (sharded) training run for the multi-process tests.

Usage: python fsdp_worker.py LOGDIR MAX_STEPS [options]; the process group comes from the
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as ``torchrun`` sets it.

The model is sharded with ``fully_shard`` over every rank (CPU, gloo) and trained with Adam;
checkpoints are sharded (every rank writes its part). Printed lines:

* ``READY <rank> <step> <restored checkpoint basename or None> <digest>`` when the session is up;
* ``STEP <rank> <step>`` after each step;
* ``SAVE <rank> <step>`` after each committed checkpoint (periodic, explicit or final);
* ``DONE <rank> <step> <digest>`` at the end of a session that ended without an error.

``<digest>`` is a SHA-256 of every full tensor of the model and of the optimizer state
(gathered from the shards, so it does not depend on the world size).

Options:
    --step-delay SECS       sleep in every step
    --save-secs SECS        save_model_secs
    --raise-at STEP         rank --only-rank raises RuntimeError at that step (inside a step)
    --end-input-at STEP     rank --only-rank reports the end of its input (OutOfRangeError,
                            through ``sv.stop_on_exception()``) at that step
    --fail-first-save       the first shard write of rank --only-rank fails (disk full)
    --only-rank R           the rank the options above apply to (default 1)
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import hashlib
import sys
import time

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from worker_exit import run_and_exit

import torchsupervisor as ts
from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState
from torchsupervisor.core.global_step import read_step
from torchsupervisor.core.walk import walk_state
from torchsupervisor.errors import OutOfRangeError
from torchsupervisor.testing import FaultyStorage


def say(line: str) -> None:
    """Print ``line`` with one write: ranks sharing a pipe (torchrun) never mix two lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def digest(state: dict) -> str:
    """SHA-256 of the full tensors of ``state`` (a collective: every rank calls it)."""
    _, tensors = walk_state(state)
    h = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        h.update(name.encode())
        h.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def sharded_model(world: int) -> tuple[nn.Module, torch.optim.Optimizer, ts.GlobalStep]:
    """The tests' model, the same on every rank (seed 0), sharded over ``world`` ranks; its
    Adam optimizer, and a global step bound to it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    step = ts.GlobalStep()
    step.bind(optimizer)
    return model, optimizer, step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("logdir")
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--save-secs", type=float, default=0.3)
    parser.add_argument("--raise-at", type=int, default=None)
    parser.add_argument("--end-input-at", type=int, default=None)
    parser.add_argument("--fail-first-save", action="store_true")
    parser.add_argument("--only-rank", type=int, default=1)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(150, exit=True)  # Never outlive a broken test.

    ts.distributed.connect("env://", timeout_secs=60)
    rank, world = ts.distributed.rank(), ts.distributed.world_size()
    model, optimizer, step = sharded_model(world)

    class PrintingSaver(ts.Saver):
        def save(self, sess, save_path, global_step=None, **kwargs):
            prefix = super().save(sess, save_path, global_step=global_step, **kwargs)
            say(f"SAVE {rank} {read_step(global_step)}")
            return prefix

        def save_async(self, sess, save_path, global_step=None, **kwargs):
            step = read_step(global_step)
            future = super().save_async(sess, save_path, global_step=global_step, **kwargs)
            future.add_done_callback(lambda f: f.exception() or say(f"SAVE {rank} {step}"))
            return future

    state = {"model": model, "optimizer": ShardedOptimizerState(model, optimizer)}
    storage = FaultyStorage()  # Relative paths: copies of the logdir restore.
    if args.fail_first_save:
        storage.fail("write", path_contains=".data-", errno=errno.ENOSPC, rank=args.only_rank)
    sv = ts.Supervisor(
        logdir=args.logdir,
        state={**state, "global_step": step},
        saver=PrintingSaver(max_to_keep=None, save_relative_paths=True, storage=storage),
        save_model_secs=args.save_secs,
        save_summaries_secs=0,
        recovery_wait_secs=0.2,
    )

    def train_step() -> None:
        if rank == args.only_rank and step.value == args.raise_at:
            raise RuntimeError(f"rank {rank} fails at step {step.value}")
        g = torch.Generator().manual_seed(step.value)
        x = torch.randn(16, 8, generator=g)[rank::world]
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if args.step_delay:
            time.sleep(args.step_delay)

    with sv.managed_session("env://") as sess:
        restored = sess.restored_checkpoint
        name = restored.rsplit("/", 1)[-1] if restored else None
        say(f"READY {rank} {step.value} {name} {digest(state)}")
        while not sv.should_stop() and step.value < args.max_steps:
            if rank == args.only_rank and step.value == args.end_input_at:
                # As an input thread would: the stop is clean; the steps up to the agreed
                # stop step still run (the other ranks' collectives need this one).
                with sv.stop_on_exception():
                    raise OutOfRangeError(None, None, "end of input")
            sess.run(train_step)
            say(f"STEP {rank} {step.value}")
    say(f"DONE {rank} {step.value} {digest(state)}")


if __name__ == "__main__":
    run_and_exit(main)
