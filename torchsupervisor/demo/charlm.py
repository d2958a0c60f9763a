"""A longer demo: a character-level transformer language model on Python's own source code.

The text is the source of the Python standard library found on the machine (the ``.py``
files at the top of the stdlib directory, about 5 MB: real text, no download). A small causal
transformer learns to predict the next byte; the demo reports the training and validation loss
and samples text now and then. At its defaults (1,200 steps) a step costs about 0.6 s of CPU
time, so the run takes about ten minutes on two idle CPU cores (2 to 3 steps/s), more on a
busy machine; ``--max-steps`` or a smaller model (``--layers``, ``--d-model``) shortens it.

It runs under a Supervisor like the digits demo: stop it any way you like and run it again
with the same ``--logdir`` to resume. ``--seed`` makes a run deterministic: a run stopped with
SIGTERM (any number of times) and resumed ends with bitwise the same weights as an
uninterrupted run (batches are a function of the seed and the step, dropout draws from the
global generator, which is saved in every checkpoint, and samples use their own generator).
"""

from __future__ import annotations

import argparse
import glob
import logging
import math
import os
import random
import sysconfig
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from torchsupervisor import GlobalStep, Graph, Supervisor
from torchsupervisor.demo.options import add_common_arguments, memory_tier, resumed_from, run_main

__all__ = ["CharLM", "Corpus", "add_arguments", "main", "run"]

logger = logging.getLogger("torchsupervisor.demo")

VOCAB = 256  # Bytes.


@dataclass(frozen=True)
class Corpus:
    """The standard library's source as bytes, split into training and validation parts."""

    train: torch.Tensor  # uint8 [N]
    valid: torch.Tensor  # uint8 [M]
    files: int

    @classmethod
    def load(cls, valid_fraction: float = 0.05) -> Corpus:
        """Read the top-level ``.py`` files of the stdlib directory, in name order.

        Raises:
            FileNotFoundError: If the directory has no Python files.
        """
        stdlib = sysconfig.get_paths()["stdlib"]
        paths = sorted(glob.glob(os.path.join(stdlib, "*.py")))
        if not paths:
            raise FileNotFoundError(f"no Python source files in {stdlib}")
        chunks = []
        for path in paths:
            with open(path, "rb") as f:
                chunks.append(b"# file: " + os.path.basename(path).encode() + b"\n" + f.read())
        data = torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8)
        split = int(len(data) * (1 - valid_fraction))
        return cls(data[:split].clone(), data[split:].clone(), len(paths))

    def batch(
        self, step: int, batch_size: int, context: int, seed: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(inputs, targets)`` int64 [batch_size, context] for this step (seeded)."""
        data = self.train if split == "train" else self.valid
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=generator)
        rows = torch.stack([data[s : s + context + 1] for s in starts.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]


class CharLM(nn.Module):
    """A decoder-only transformer over bytes (pre-norm, learned positions)."""

    def __init__(self, context: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(VOCAB, d_model)
        self.position = nn.Embedding(context, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.1, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return logits [batch, length, 256] for int64 tokens [batch, length]."""
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(length))
        x = self.blocks(x, mask=self.mask[:length, :length], is_causal=True)
        return self.head(self.norm(x))

    @torch.no_grad()
    def sample(self, prompt: bytes, length: int, seed: int, temperature: float = 0.8) -> str:
        """Continue ``prompt`` by ``length`` bytes (own generator: the global RNG is untouched)."""
        was_training = self.training
        self.eval()
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.tensor(list(prompt), dtype=torch.long)[None]
        for _ in range(length):
            logits = self(tokens[:, -self.context :])[0, -1] / temperature
            token = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            tokens = torch.cat([tokens, token[None]], dim=1)
        self.train(was_training)
        return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's command-line options to ``parser``."""
    add_common_arguments(parser, "charlm")
    parser.add_argument("--context", type=int, default=128, help="bytes per sequence")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--sample-every", type=int, default=500, help="sample text every N steps")


def run(args: argparse.Namespace) -> dict[str, float]:
    """Train with the options in ``args``; return the final step and losses."""
    with Graph().as_default():
        return _run(args)


def _evaluate(model: CharLM, corpus: Corpus, args: argparse.Namespace) -> float:
    was_training = model.training
    model.eval()
    losses = []
    with torch.no_grad():
        for i in range(4):  # Fixed validation batches.
            x, y = corpus.batch(i, args.batch_size, args.context, args.seed, split="valid")
            logits = model(x)
            losses.append(nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    model.train(was_training)
    return sum(losses) / len(losses)


def _run(args: argparse.Namespace) -> dict[str, float]:
    # All three global generators, which every checkpoint saves (the "rng/" entries): the same
    # --seed gives the same states in every process, so a resumed run matches bitwise.
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    corpus = Corpus.load()
    model = CharLM(args.context, args.d_model, args.layers, args.heads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    step = GlobalStep()
    step.bind(optimizer)
    sv = Supervisor(
        logdir=args.logdir,
        state={"model": model, "optimizer": optimizer, "global_step": step},
        save_model_secs=args.save_model_secs,
        save_summaries_secs=args.save_summaries_secs,
        memory_tier=memory_tier(args),
    )

    def train_step() -> torch.Tensor:
        x, y = corpus.batch(step.value, args.batch_size, args.context, args.seed)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if args.step_delay_secs:
            time.sleep(args.step_delay_secs)
        return loss.detach()

    params = sum(p.numel() for p in model.parameters())
    result = {"step": 0.0, "loss": math.nan, "valid_loss": math.nan}
    with sv.managed_session() as sess:
        writer = sv.summary_writer
        where = resumed_from(sess)
        print(
            f"{f'Resumed at step {step.value} from {where}' if where else 'Starting'}: "
            f"{params:,} parameters, {len(corpus.train):,} training bytes from {corpus.files} "
            f"stdlib files",
            flush=True,
        )
        t0, s0 = time.monotonic(), step.value
        loss = None
        while not sv.should_stop() and step.value < args.max_steps:
            loss = sess.run(train_step)
            writer.add_scalar("train/loss", loss, step.value)  # The loss of the step-th step.
            if step.value % args.log_every == 0 or step.value == args.max_steps:
                valid = _evaluate(model, corpus, args)
                writer.add_scalar("valid/loss", valid, step.value)
                now = time.monotonic()
                rate = (step.value - s0) / max(now - t0, 1e-9)
                t0, s0 = now, step.value
                print(
                    f"step {step.value:6d}  loss {loss.item():.3f}  valid {valid:.3f} "
                    f"({valid / math.log(2):.2f} bits/byte)  {rate:6.2f} steps/s",
                    flush=True,
                )
            if args.sample_every and step.value % args.sample_every == 0:
                text = model.sample(b"def ", 120, seed=step.value)
                print("  sample: " + text.replace("\n", "\n          "), flush=True)
        result["step"] = float(step.value)
        result["valid_loss"] = _evaluate(model, corpus, args)
        if loss is not None:
            result["loss"] = loss.item()
    if sv.preempted:
        print(f"Stopped by {sv.preempted} at step {step.value}: run again to resume", flush=True)
    else:
        print(
            f"Done at step {int(result['step'])}: validation loss {result['valid_loss']:.3f}",
            flush=True,
        )
    return result


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point of ``torchsupervisor demo charlm``."""
    return run_main("torchsupervisor demo charlm", __doc__, add_arguments, run, argv)
