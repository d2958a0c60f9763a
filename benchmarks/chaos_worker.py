"""One rank of the chaos benchmark's training job (``benchmarks/chaos.py`` starts it under
``torchrun``): a replicated (DDP, gloo) MLP with Adam, its batch a function of the step, saved
by one of four ways:

* ``memory``: torchsupervisor's Supervisor, the memory tier every step and a checkpoint on
  disk every ``--save-secs``;
* ``disk``: torchsupervisor's Supervisor, a checkpoint on disk every ``--save-secs``;
* ``dcp``: ``torch.distributed.checkpoint.async_save`` every ``--save-secs`` (the chief's
  clock decides, told to every rank at each step), resumed with ``dcp.load``;
* ``torch``: ``torch.save`` of the state by rank 0 every ``--save-secs`` (a temporary file
  renamed over the last one), resumed with ``torch.load(weights_only=True)``.

Rank 0 appends to ``--progress``: ``start T`` (after the interpreter started and imported
torch), ``connected T`` (the process group joined and the model built: DDP's first use imports
``torch._dynamo``, 3 s here), ``resume STEP T`` (the state restored: the
step it resumed at; 0 for a fresh start) and ``step STEP T`` after every completed step (T:
``time.time()``).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

VARIANTS = ("memory", "disk", "dcp", "torch")


def build(hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    parts: list[nn.Module] = []
    for _ in range(layers):
        parts += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*parts, nn.Linear(hidden, 1))


def batch(step: int, size: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(size, hidden, generator=generator)
    return x, x[:, :1].clone()


class Progress:
    """Rank 0's progress file (line by line, flushed: it survives a kill)."""

    def __init__(self, path: str, rank: int) -> None:
        self.file = open(path, "a", buffering=1) if rank == 0 else None  # noqa: SIM115

    def write(self, *words: object) -> None:
        if self.file is not None:
            # A new process starts on a line of its own: the last one's may be torn by a kill.
            head = "\n" if words == ("start",) else ""
            self.file.write(head + " ".join(map(str, (*words, f"{time.time():.3f}"))) + "\n")


def train_supervised(args: argparse.Namespace, progress: Progress) -> None:
    import torchsupervisor as ts

    ts.distributed.connect("env://")
    model = nn.parallel.DistributedDataParallel(build(args.hidden, args.layers))
    progress.write("connected")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    step = ts.GlobalStep()
    step.bind(optimizer)
    sv = ts.Supervisor(
        logdir=args.logdir,
        state={"model": model.module, "optimizer": optimizer, "global_step": step},
        save_model_secs=args.save_secs,
        save_summaries_secs=0,
        recovery_wait_secs=1,
        memory_tier=ts.MemoryTierConfig(peer_every_secs=args.peer_every_secs)
        if args.variant == "memory"
        else None,
    )
    with sv.managed_session("env://"):
        progress.write("resume", step.value)
        while not sv.should_stop():
            x, y = batch(step.value, args.batch_size, args.hidden)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            progress.write("step", step.value)


def _newest(logdir: str, complete: str) -> tuple[int, str] | None:
    found = []
    for name in os.listdir(logdir):
        if name.startswith("ckpt-") and os.path.exists(os.path.join(logdir, name, complete)):
            found.append((int(name[5:]), os.path.join(logdir, name)))
    return max(found, default=None)


def train_plain(args: argparse.Namespace, progress: Progress) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.parallel.DistributedDataParallel(build(args.hidden, args.layers))
    # DCP's background save runs collectives: on a group of its own, never beside training's.
    save_group = dist.new_group(backend="gloo") if args.variant == "dcp" else None
    progress.write("connected")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    os.makedirs(args.logdir, exist_ok=True)
    step = 0
    if args.variant == "dcp":
        newest = _newest(args.logdir, ".metadata")
        if newest is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=newest[1], process_group=save_group)
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
            step = newest[0]
    else:
        path = os.path.join(args.logdir, "state.pt")
        if os.path.exists(path):
            saved = torch.load(path, weights_only=True)
            model.module.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optim"])
            step = int(saved["step"])
    progress.write("resume", step)
    last_save = time.monotonic()
    future = None
    flag = torch.zeros(1)
    while True:
        x, y = batch(step, args.batch_size, args.hidden)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        progress.write("step", step)
        # The chief's clock decides; every rank learns it (a collective of one number).
        flag.fill_(1.0 if rank == 0 and time.monotonic() - last_save >= args.save_secs else 0.0)
        dist.broadcast(flag, 0)
        if not flag.item():
            continue
        last_save = time.monotonic()
        if args.variant == "dcp":
            if future is not None:
                future.result()
            model_sd, optim_sd = get_state_dict(model, optimizer)
            target = os.path.join(args.logdir, f"ckpt-{step}")
            future = dcp.async_save(
                {"model": model_sd, "optim": optim_sd},
                checkpoint_id=target,
                process_group=save_group,
            )
        elif rank == 0:
            state = {
                "model": model.module.state_dict(),
                "optim": optimizer.state_dict(),
                "step": step,
            }
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--logdir", required=True)
    parser.add_argument("--progress", required=True)
    parser.add_argument("--save-secs", type=float, default=30.0)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=640)
    parser.add_argument("--peer-every-secs", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    progress = Progress(args.progress, int(os.environ.get("RANK", "0")))
    progress.write("start")
    if args.variant in ("memory", "disk"):
        train_supervised(args, progress)
    else:
        train_plain(args, progress)


if __name__ == "__main__":
    main()
