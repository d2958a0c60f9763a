"""The digits demo on several replicas: DistributedDataParallel under a Supervisor.

    torchrun --nproc_per_node=2 examples/ddp_digits.py --logdir /tmp/ddp-digits --max-steps 600

Rank 0 is the chief: it restores the newest checkpoint (or initializes), checkpoints and writes
summaries; the other ranks wait until it is ready and receive its state. Every step each rank
trains on its own part of a global batch and DDP averages the gradients. Stop it (Ctrl-C,
SIGTERM to any rank, SIGKILL) and run the same command again: every rank resumes at the same
step. Under ``torchrun --max-restarts=1`` a rank that dies makes the group restart and resume
from the last committed checkpoint by itself.
"""

from __future__ import annotations

import argparse
import inspect
import os

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torchsupervisor as ts
from torchsupervisor.demo.digits import DigitsData, accuracy, build_model


def bitwise_buckets() -> dict[str, list[int]]:
    """DDP's keyword arguments that keep a resumed run bitwise at 3 ranks or more.

    DDP reduces the gradients of the first step of a process in one bucket of every parameter,
    then rebuilds its buckets in the order the gradients became ready. Where an element sits
    in a bucket decides the order in which the all-reduce sums the ranks' values, and with 3
    ranks or more a floating-point sum depends on its order: the first step after any restart
    summed some gradients in another order than the run without the restart did at that step
    (24 of 35 tensors differed at the end, 3 ranks; 2 ranks sum alike in any order). One
    bucket per parameter puts every element at the same place in both layouts (one collective
    per parameter tensor: a few here). Where DDP does not take ``bucket_cap_mb_list`` (older
    torch), its default: bitwise at 2 ranks. See docs/distributed.md.
    """
    if "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"bucket_cap_mb_list": [0]}
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--logdir", default="/tmp/torchsupervisor-ddp-digits")
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--save-model-secs", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=100, help="print every N steps")
    parser.add_argument(
        "--memory-every-n-steps",
        type=int,
        default=0,
        help="the chief keeps a snapshot in host memory (/dev/shm) every N steps (0: off)",
    )
    args = parser.parse_args()

    # One GPU per rank when there are GPUs (the process group then uses NCCL, which only
    # moves CUDA tensors), else the CPU (gloo).
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    # Join the replicas' process group (torchrun's environment) before wrapping in DDP.
    ts.distributed.connect("env://")
    rank, world = ts.distributed.rank(), ts.distributed.world_size()
    torch.manual_seed(args.seed)
    data = DigitsData.load(seed=args.seed)
    model = DistributedDataParallel(build_model().to(device), **bitwise_buckets())
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    step = ts.GlobalStep()
    step.bind(optimizer)
    sv = ts.Supervisor(
        logdir=args.logdir,
        state={"model": model, "optimizer": optimizer, "global_step": step},
        save_model_secs=args.save_model_secs,
        save_summaries_secs=5,
        # The other ranks look for the chief's "ready" in the store this often (TF's default,
        # 30 s, makes every start of a small run wait half a minute).
        recovery_wait_secs=1,
        memory_tier=(
            ts.MemoryTierConfig(every_n_steps=args.memory_every_n_steps)
            if args.memory_every_n_steps
            else None
        ),
    )

    def train_step() -> torch.Tensor:
        x, y = data.batch(step.value, args.batch_size, args.seed)
        x, y = x[rank::world].to(device), y[rank::world].to(device)  # This replica's part.
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # DDP averages the gradients of all replicas here.
        optimizer.step()
        return loss.detach()

    with sv.managed_session("env://") as sess:
        if sess.restored_checkpoint:
            tier = f" ({sess.restored_tier} tier)" if sess.restored_tier else ""
            print(
                f"rank {rank}: resumed at step {step.value} from {sess.restored_checkpoint}{tier}",
                flush=True,
            )
        while not sv.should_stop() and step.value < args.max_steps:
            loss = sess.run(train_step)
            if sv.is_chief:
                sv.summary_writer.add_scalar("train/loss", loss, step.value)
                if step.value % args.log_every == 0:
                    acc = accuracy(model.module, data.test_x.to(device), data.test_y.to(device))
                    print(f"step {step.value}: loss {loss.item():.4f}, accuracy {acc:.1%}")
    print(f"rank {rank}: done at step {step.value}", flush=True)


if __name__ == "__main__":
    main()
