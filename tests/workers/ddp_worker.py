"""One replica of a DDP training run for the multi-process tests (launched 2x or by torchrun).

Usage: python ddp_worker.py LOGDIR MAX_STEPS [options]; the process group comes from the
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as ``torchrun`` sets it, or from a
``ClusterSpec`` (``--cluster``).

Every step: the parameters move (DDP averages the gradients of both ranks) and the global step
advances. It prints ``READY <rank> <step> <restored checkpoint>`` when the session is up, then
``RAND <rank> <torch.rand(1) as repr>`` (the rank's first draw from the global generator),
``STEP <rank> <step>`` after each step, and at the end ``DONE <rank> <step> <param digest>``.
After a torchrun restart it first prints ``LATEST <rank> <newest checkpoint in LOGDIR>`` (what
the previous attempt committed). ``--raise-at`` prints ``FAIL <rank> <time.time()>`` first.

Options:
    --step-delay SECS     sleep in every step
    --max-wait SECS       timeout of joining the process group
    --raise-at STEP       this rank (see --only-rank) raises RuntimeError at that step
    --kill-at STEP        this rank kills itself with SIGKILL at that step (first attempt only)
    --only-rank R         the rank --raise-at / --kill-at apply to (default 1)
    --init-sleep SECS     the chief's init_fn sleeps (when nothing is restored)
    --session-wait SECS   open the session with prepare_or_wait_for_session(max_wait_secs=SECS)
                          (a non-chief's wait for the chief) and stop at once
    --cluster A,B         join through Server(ClusterSpec({"worker": [A, B]}), "worker", RANK)
                          and its target instead of env://
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from worker_exit import run_and_exit

import torchsupervisor as ts


def say(line: str) -> None:
    """Print ``line`` with one write: ranks sharing a pipe (torchrun) never mix two lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("logdir")
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--max-wait", type=float, default=120.0)
    parser.add_argument("--raise-at", type=int, default=None)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--only-rank", type=int, default=1)
    parser.add_argument("--init-sleep", type=float, default=0.0)
    parser.add_argument("--session-wait", type=float, default=None)
    parser.add_argument("--cluster", default=None)
    args = parser.parse_args()

    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if not first_attempt:
        say(f"LATEST {os.environ['RANK']} {ts.latest_checkpoint(args.logdir)}")
    master = "env://"
    if args.cluster:
        cluster = ts.ClusterSpec({"worker": args.cluster.split(",")})
        master = ts.Server(cluster, "worker", int(os.environ["RANK"]), start=False).target
    ts.distributed.connect(master, timeout_secs=args.max_wait)
    rank = ts.distributed.rank()
    torch.manual_seed(100 + rank)  # Different initial weights: the chief's must win.
    model = DistributedDataParallel(nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = ts.GlobalStep()
    step.bind(optimizer)
    sv = ts.Supervisor(
        logdir=args.logdir,
        state={"model": model, "optimizer": optimizer, "global_step": step},
        save_model_secs=0.2,
        save_summaries_secs=0,
        recovery_wait_secs=0.2,
        init_fn=(lambda sess: time.sleep(args.init_sleep)) if args.init_sleep else None,
    )

    def train_step() -> None:
        if rank == args.only_rank and step.value == args.raise_at:
            say(f"FAIL {rank} {time.time()!r}")
            raise RuntimeError(f"rank {rank} fails at step {step.value}")
        if rank == args.only_rank and step.value == args.kill_at and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(step.value)
        x = torch.randn(16, 8, generator=g)[rank::2]
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        if args.step_delay:
            time.sleep(args.step_delay)

    if args.session_wait is not None:
        sess = sv.prepare_or_wait_for_session(master, max_wait_secs=args.session_wait)
        say(f"READY {rank} {step.value} {sess.restored_checkpoint}")
        sv.stop()
        return
    with sv.managed_session(master, config=None) as sess:
        say(f"READY {rank} {step.value} {sess.restored_checkpoint}")
        say(f"RAND {rank} {torch.rand(1).item()!r}")
        while not sv.should_stop() and step.value < args.max_steps:
            sess.run(train_step)
            say(f"STEP {rank} {step.value}")
    digest = hashlib.sha256()
    for tensor in model.module.state_dict().values():
        digest.update(tensor.numpy().tobytes())
    say(f"DONE {rank} {step.value} {digest.hexdigest()}")


if __name__ == "__main__":
    run_and_exit(main)
