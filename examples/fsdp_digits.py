"""The digits demo with a sharded model: FSDP2 (``fully_shard``) under a Supervisor.

    torchrun --nproc_per_node=2 examples/fsdp_digits.py --logdir /tmp/fsdp-digits --max-steps 600

Every rank holds one shard of the parameters and of the Adam moments (DTensors). So, unlike
``ddp_digits.py`` where the chief restores and saves for everyone:

* every rank restores its own shards from the newest valid checkpoint of the logdir, and any
  world size resumes any checkpoint (run it again with ``--nproc_per_node=1``: the shards are
  resharded);
* every rank writes its own shard of each checkpoint, in parallel, at a step the ranks agreed
  on through the process group's store (no collective on every step); the chief then writes
  the manifest and the ``checkpoint`` state file, and the summaries.

Stop it (Ctrl-C, SIGTERM to any rank) and run the same command again: every rank resumes at
the same step from the final checkpoint. With ``--memory-every-n-steps 1`` every rank also
keeps its shards in host memory at every step: ``kill -9`` a rank under ``torchrun
--max-restarts=1`` and the restarted ranks resume from there, a step or two back. A sharded
save blocks the training threads while the shards are written (see ``docs/distributed.md``).

``--front-end monitored`` trains the same under ``MonitoredTrainingSession`` (every rank a
``ShardedSessionCreator`` and a ``ShardedCheckpointSaverHook``), with the same checkpoints,
memory tier and output.
"""

from __future__ import annotations

import argparse
import signal

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import torchsupervisor as ts
from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState
from torchsupervisor.demo.digits import DigitsData, accuracy, build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--logdir", default="/tmp/torchsupervisor-fsdp-digits")
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--save-model-secs", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=100, help="print every N steps")
    parser.add_argument(
        "--memory-every-n-steps",
        type=int,
        default=0,
        help="every rank keeps a snapshot of its shards in host memory (/dev/shm) every N "
        "steps (0: off)",
    )
    parser.add_argument(
        "--local-dir",
        default=None,
        help="with the memory tier: every rank also copies its snapshots to this directory on "
        "its local disk, every --local-every-n-steps steps (a restart after a reboot)",
    )
    parser.add_argument("--local-every-n-steps", type=int, default=10)
    parser.add_argument(
        "--front-end",
        choices=("supervisor", "monitored"),
        default="supervisor",
        help="train under a Supervisor or a MonitoredTrainingSession",
    )
    parser.add_argument("--local-keep", type=int, default=2, help="copies kept a rank")
    args = parser.parse_args()

    # Join the replicas' process group (torchrun's environment) before sharding the model.
    ts.distributed.connect("env://")
    rank, world = ts.distributed.rank(), ts.distributed.world_size()
    torch.manual_seed(args.seed)  # The same full initial model on every rank, then sharded.
    data = DigitsData.load(seed=args.seed)
    model = build_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    step = ts.GlobalStep()
    step.bind(optimizer)
    state = {
        "model": model,
        # Keyed by parameter names and sharded like the parameters: it reshards too.
        "optimizer": ShardedOptimizerState(model, optimizer),
        "global_step": step,
    }
    memory_tier = (
        ts.MemoryTierConfig(
            every_n_steps=args.memory_every_n_steps,
            local_disk=ts.LocalDiskConfig(
                args.local_dir, every_n_steps=args.local_every_n_steps, keep=args.local_keep
            )
            if args.local_dir
            else None,
        )
        if args.memory_every_n_steps
        else None
    )

    def train_step() -> torch.Tensor:
        x, y = data.batch(step.value, args.batch_size, args.seed)
        x, y = x[rank::world], y[rank::world]  # This replica's part of the global batch.
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # FSDP reduce-scatters the gradients into each rank's shard.
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    def resumed(sess: ts.Session) -> None:
        if sess.restored_checkpoint:
            tier = f" ({sess.restored_tier} tier)" if sess.restored_tier else ""
            print(
                f"rank {rank}: resumed at step {step.value} from {sess.restored_checkpoint}{tier}",
                flush=True,
            )

    def log(loss: torch.Tensor, writer: ts.SummaryWriter | None) -> None:
        if writer is not None:
            writer.add_scalar("train/loss", loss, step.value)
        if step.value % args.log_every == 0:
            # The forward pass gathers the shards: every rank evaluates, the chief prints.
            acc = accuracy(model, data.test_x, data.test_y)
            if rank == 0:
                print(f"step {step.value}: loss {loss.item():.4f}, accuracy {acc:.1%}")

    if args.front_end == "monitored":
        created = _Created()
        with ts.MonitoredTrainingSession(
            master="env://",
            checkpoint_dir=args.logdir,
            state=state,
            hooks=[created],
            save_checkpoint_secs=args.save_model_secs,
            save_summaries_steps=0,
            log_step_count_steps=0,
            memory_tier=memory_tier,
        ) as sess:
            resumed(created.session)
            writer = ts.SummaryWriterCache.get(args.logdir) if rank == 0 else None
            while not sess.should_stop() and step.value < args.max_steps:
                log(sess.run(train_step), writer)
    else:
        sv = ts.Supervisor(
            logdir=args.logdir,
            state=state,
            save_model_secs=args.save_model_secs,
            save_summaries_secs=5,
            preemption_signals=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT),
            memory_tier=memory_tier,
        )
        with sv.managed_session("env://") as sess:
            resumed(sess)
            while not sv.should_stop() and step.value < args.max_steps:
                log(sess.run(train_step), sv.summary_writer if sv.is_chief else None)
    print(f"rank {rank}: done at step {step.value}", flush=True)


class _Created(ts.SessionRunHook):
    """Keeps the session a ``MonitoredTrainingSession`` created (its restore)."""

    session: ts.Session

    def after_create_session(self, session: ts.Session, coord: object) -> None:
        self.session = session


if __name__ == "__main__":
    main()
