"""The digits training as a MonitoredTrainingSession fed by a QueueRunner (TF 1's other style).

    python examples/digits_monitored.py --logdir /tmp/digits-monitored --epochs 10

A ``DataLoader`` over the training digits fills a queue from a runner thread
(``queue_from_iterable``); the training step dequeues a batch. When the epochs are exhausted
the dequeue raises ``OutOfRangeError``, which ends the ``with`` block cleanly: the hooks'
``end()`` runs and the final checkpoint is written. ``StopAtStepHook`` bounds the step count,
``NanTensorHook`` and ``LoggingTensorHook`` watch the ``"loss"`` entry the step returns, and the
standard hooks write ``global_step/sec``, the summaries and the checkpoints to ``--logdir``
(``tensorboard --logdir`` shows them).

Run it again with the same ``--logdir``: it resumes from the newest checkpoint (the model, the
optimizer and the step; the input restarts its epochs, since a plain ``DataLoader`` has no
position to save).
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchsupervisor import GlobalStep, Graph, summary
from torchsupervisor.demo.digits import DigitsData, accuracy, build_model
from torchsupervisor.hooks import LoggingTensorHook, NanTensorHook, StopAtStepHook
from torchsupervisor.input.queue_runner import queue_from_iterable
from torchsupervisor.monitored.training_session import MonitoredTrainingSession


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--logdir", default="/tmp/torchsupervisor-digits-monitored")
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training data")
    parser.add_argument("--max-steps", type=int, default=100_000, help="stop at this step")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--save-checkpoint-secs", type=float, default=10.0)
    parser.add_argument("--save-summaries-steps", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=100, help="log the loss every N runs")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train; return the final step and held-out accuracy."""
    args = parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("torchsupervisor").setLevel(logging.INFO)
    with Graph().as_default():  # The summary ops and queue runners of this run only.
        return train(args)


def train(args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(args.seed)
    data = DigitsData.load(seed=args.seed)
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    step = GlobalStep()
    step.bind(optimizer)  # Every optimizer.step() adds 1.

    loader = DataLoader(
        TensorDataset(data.train_x, data.train_y),
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    batches = queue_from_iterable(loader, capacity=8, num_epochs=args.epochs, name="batches")

    last_loss = {"loss": torch.tensor(float("nan"))}
    # Summary ops read their source when SummarySaverHook evaluates them (after the step).
    summary.scalar("train/loss", lambda: last_loss["loss"])
    summary.scalar("eval/accuracy", lambda: accuracy(model, data.test_x, data.test_y))
    summary.histogram("weights/conv1", model[0].weight)
    loss_fn = nn.CrossEntropyLoss()

    def train_step() -> dict[str, torch.Tensor]:
        x, y = batches.dequeue()  # OutOfRangeError once the epochs are exhausted.
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        last_loss["loss"] = loss.detach()
        return last_loss

    hooks = [
        StopAtStepHook(last_step=args.max_steps),
        NanTensorHook("loss"),
        LoggingTensorHook({"step": step, "loss": "loss"}, every_n_iter=args.log_every),
    ]
    with MonitoredTrainingSession(
        checkpoint_dir=args.logdir,
        state={"model": model, "optimizer": optimizer, "global_step": step},
        hooks=hooks,
        save_checkpoint_secs=args.save_checkpoint_secs,
        save_summaries_steps=args.save_summaries_steps,
    ) as sess:
        print(f"Training from step {step.value} in {args.logdir}", flush=True)
        while not sess.should_stop():
            sess.run(train_step)
    result = {"step": float(step.value), "accuracy": accuracy(model, data.test_x, data.test_y)}
    print(
        f"Done at step {step.value}: held-out accuracy {result['accuracy']:.2%}; "
        f"checkpoints and events in {args.logdir}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
