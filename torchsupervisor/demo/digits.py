"""The main demo: a small CNN on scikit-learn's handwritten digits, under a Supervisor.

Real data that ships with scikit-learn (1,797 8x8 images, no download). Run it, stop it
any way you like (Ctrl-C, ``kill``, ``kill -9``), run it again with the same ``--logdir``:
it resumes from the newest complete checkpoint, and the held-out accuracy keeps improving.
TensorBoard (``tensorboard --logdir runs/digits``) shows the loss, the accuracy,
``global_step/sec``, weight histograms, and each restart.

``--seed`` makes a run deterministic: stopped with SIGTERM (any number of times) and resumed,
it ends with bitwise the same weights as an uninterrupted run with the same ``--max-steps``.

The batch of step ``s`` depends only on ``(seed, s)`` (a seeded permutation per epoch), so a
resumed run sees exactly the data an uninterrupted run would have seen from that step.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from torchsupervisor import GlobalStep, Graph, Supervisor, summary
from torchsupervisor.demo.options import add_common_arguments, memory_tier, resumed_from, run_main
from torchsupervisor.hooks.progress import Progress

__all__ = ["DigitsData", "add_arguments", "build_model", "main", "run"]

logger = logging.getLogger("torchsupervisor.demo")


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits: images ``(1797, 8, 8)`` float64 in 0..16 and labels
    ``(1797,)`` int64, as ``sklearn.datasets.load_digits`` gives them.

    Read from the data file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``),
    found without importing scikit-learn, whose import (SciPy's with it) took about 2 s of
    every demo and example process's start here; through ``load_digits`` when the file is not
    where this release keeps it.

    Raises:
        ImportError: scikit-learn is not installed, saying what to install.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ImportError(
            "the demo trains on scikit-learn's bundled digits dataset, and scikit-learn "
            'is not installed: pip install "torchsupervisor[demo]"'
        )
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
    if os.path.isfile(path):
        data = np.loadtxt(path, delimiter=",")
        return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images, digits.target


@dataclass(frozen=True)
class DigitsData:
    """The digits, split once (seeded) into training and held-out sets.

    Attributes:
        train_x: float32 [N, 1, 8, 8] in [0, 1].
        train_y: int64 [N].
        test_x: float32 [M, 1, 8, 8].
        test_y: int64 [M].
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @classmethod
    def load(cls, seed: int = 0, held_out: int = 360) -> DigitsData:
        """Load scikit-learn's bundled digits and split off ``held_out`` examples.

        Raises:
            ImportError: scikit-learn is not installed, saying what to install.
        """
        images, labels = load_digits_arrays()
        x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(labels, dtype=torch.int64)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
        test, train = order[:held_out], order[held_out:]
        return cls(x[train], y[train], x[test], y[test])

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the training batch of global step ``step`` (deterministic, resumable)."""
        n = len(self.train_y)
        per_epoch = n // batch_size
        epoch, index = divmod(step, per_epoch)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(n, generator=generator)
        rows = order[index * batch_size : (index + 1) * batch_size]
        return self.train_x[rows], self.train_y[rows]


def build_model() -> nn.Module:
    """A small CNN for 8x8 single-channel images, 10 classes (~25k parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(64, 10),
    )


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Return the fraction of ``x`` classified as ``y`` (model in eval mode meanwhile)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(dim=1) == y).sum().item()
    model.train(was_training)
    return correct / len(y)


class _Progress:
    """Prints a progress line and writes the held-out accuracy at the current step."""

    def __init__(self, model: nn.Module, data: DigitsData, writer, step: int, say) -> None:
        self._model, self._data, self._writer = model, data, writer
        self._time, self._step = time.monotonic(), step
        self._say = say

    def report(self, step: int, loss: torch.Tensor | None) -> None:
        acc = accuracy(self._model, self._data.test_x, self._data.test_y)
        self._writer.add_scalar("eval/accuracy", acc, step)
        now = time.monotonic()
        rate = (step - self._step) / max(now - self._time, 1e-9)
        rate_text = f"{rate:8.1f}" if step > self._step else "       -"
        self._time, self._step = now, step
        loss_text = "   -  " if loss is None else f"{loss.item():.4f}"
        self._say(
            f"step {step:6d}  loss {loss_text}  held-out accuracy {acc:6.2%}  {rate_text} steps/s"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's command-line options to ``parser``."""
    add_common_arguments(parser, "digits")


def run(args: argparse.Namespace) -> dict[str, float]:
    """Train with the options in ``args``; return the final step, loss and accuracy."""
    with Graph().as_default():  # Summary ops and defaults of this run only.
        return _run(args)


def _run(args: argparse.Namespace) -> dict[str, float]:
    # All three global generators, which every checkpoint saves (the "rng/" entries): the same
    # --seed gives the same states in every process, so a resumed run matches bitwise.
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    data = DigitsData.load(seed=args.seed)
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    step = GlobalStep()
    step.bind(optimizer)
    # Summary ops read their source when the summary service evaluates them.
    summary.histogram("weights/conv1", model[0].weight)
    summary.histogram("weights/fc1", model[6].weight)
    sv = Supervisor(
        logdir=args.logdir,
        state={"model": model, "optimizer": optimizer, "global_step": step},
        save_model_secs=args.save_model_secs,
        save_summaries_secs=args.save_summaries_secs,
        memory_tier=memory_tier(args),
    )
    loss_fn = nn.CrossEntropyLoss()

    def train_step() -> torch.Tensor:
        x, y = data.batch(step.value, args.batch_size, args.seed)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if args.step_delay_secs:
            time.sleep(args.step_delay_secs)
        return loss

    # Summaries are labeled with the step of the state they describe: the loss of step s is
    # computed on the state at step s, the accuracy after step s on the state at step s + 1.
    # A restart at step s writes START(s), which makes TensorBoard drop what the stopped run
    # wrote from step s on, and this run writes those points again: one continuous series.
    result = {"step": 0.0, "loss": float("nan"), "accuracy": 0.0}
    with sv.managed_session() as sess:
        writer = sv.summary_writer
        start = step.value
        if sess.restored_checkpoint:
            print(f"Resumed at step {start} from {resumed_from(sess)}", flush=True)
        else:
            print(f"Starting from scratch in {args.logdir}", flush=True)
        if start >= args.max_steps:
            print(f"Already at step {start} >= --max-steps {args.max_steps}; nothing to do.")
        # A live line on a terminal (step, steps/s, loss, ETA, checkpoints); the lines below
        # every --log-every steps either way.
        live = Progress.for_supervisor(sv, args.max_steps)
        progress = _Progress(model, data, writer, start, say=live.write)
        progress.report(step.value, None)
        loss = None
        try:
            while not sv.should_stop() and step.value < args.max_steps:
                loss = sess.run(train_step).detach()
                writer.add_scalar("train/loss", loss, step.value)  # The step-th step's loss.
                live.update(step.value, loss)
                if step.value % args.log_every == 0 or step.value == args.max_steps:
                    progress.report(step.value, loss)
        finally:
            live.close()
        result["step"] = float(step.value)
        result["accuracy"] = accuracy(model, data.test_x, data.test_y)
        if loss is not None:
            result["loss"] = loss.item()
    if sv.preempted:
        print(f"Stopped by {sv.preempted} at step {step.value}: run again to resume", flush=True)
    print(
        f"Done at step {int(result['step'])}: held-out accuracy {result['accuracy']:.2%}; "
        f"checkpoints and events in {args.logdir}",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point of ``torchsupervisor demo``."""
    return run_main("torchsupervisor demo", __doc__, add_arguments, run, argv)
