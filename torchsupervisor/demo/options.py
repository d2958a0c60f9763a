"""The command-line options every demo has (each demo adds its own and its defaults)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from torchsupervisor.tiers.local_disk import LocalDiskConfig
from torchsupervisor.tiers.memory import MemoryTierConfig

__all__ = [
    "DEFAULTS",
    "Defaults",
    "add_common_arguments",
    "memory_tier",
    "resumed_from",
    "run_main",
]


@dataclasses.dataclass(frozen=True)
class Defaults:
    """The defaults of a demo's common options."""

    logdir: str
    max_steps: int
    save_model_secs: float
    save_summaries_secs: float
    batch_size: int
    learning_rate: float
    log_every: int


DEFAULTS = {
    "digits": Defaults("runs/digits", 3000, 10.0, 5.0, 64, 2e-3, 250),
    "charlm": Defaults("runs/charlm", 1200, 30.0, 10.0, 32, 1e-3, 100),
}
"""Each demo's defaults (``logdir``, ``max_steps``, save intervals, batch, rate, log)."""


def add_common_arguments(parser: argparse.ArgumentParser, demo: str) -> None:
    """Add ``--logdir``, ``--max-steps``, the save intervals, the batch size, the learning rate,
    ``--seed``, ``--log-every`` and ``--step-delay-secs`` with ``DEFAULTS[demo]``."""
    d = DEFAULTS[demo]
    logdir, max_steps, log_every = d.logdir, d.max_steps, d.log_every
    save_model_secs, save_summaries_secs = d.save_model_secs, d.save_summaries_secs
    batch_size, learning_rate = d.batch_size, d.learning_rate
    parser.add_argument("--logdir", default=logdir, help="checkpoints and events")
    parser.add_argument("--max-steps", type=int, default=max_steps, help="train up to this step")
    parser.add_argument(
        "--save-model-secs",
        type=float,
        default=save_model_secs,
        help="seconds between two checkpoints (written in the background)",
    )
    parser.add_argument(
        "--save-summaries-secs",
        type=float,
        default=save_summaries_secs,
        help="seconds between two summaries (weight histograms, global_step/sec)",
    )
    parser.add_argument("--batch-size", type=int, default=batch_size, help="examples per step")
    parser.add_argument(
        "--learning-rate", type=float, default=learning_rate, help="Adam's learning rate"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of random, numpy, torch and the data order"
    )
    parser.add_argument(
        "--log-every", type=int, default=log_every, help="progress line every N steps"
    )
    parser.add_argument(
        "--step-delay-secs",
        type=float,
        default=0.0,
        help="sleep this long in every step (to watch a slow run, or stop it mid-way)",
    )
    parser.add_argument(
        "--memory-every-n-steps",
        type=int,
        default=0,
        help="keep a snapshot in host memory (/dev/shm) every N steps, besides the "
        "checkpoints: kill -9 the demo and it resumes at the step it died (0: off)",
    )
    parser.add_argument(
        "--memory-slots",
        type=int,
        default=2,
        help="snapshots the memory tier holds at once, the one being written included",
    )
    parser.add_argument(
        "--memory-root",
        default=None,
        help="its tmpfs (None: $TORCHSUPERVISOR_MEMORY_ROOT or /dev/shm)",
    )
    parser.add_argument(
        "--local-dir",
        default=None,
        help="also copy the memory tier's snapshots to this local disk directory at their "
        "own interval: a restart after a reboot reads them",
    )
    parser.add_argument(
        "--local-every-secs",
        type=float,
        default=60.0,
        help="seconds between two copies to --local-dir (0: every snapshot)",
    )
    parser.add_argument("--local-keep", type=int, default=2, help="copies kept in --local-dir")


def memory_tier(args: argparse.Namespace) -> MemoryTierConfig | None:
    """The memory tier the options ask for (None: off)."""
    if not args.memory_every_n_steps:
        if args.local_dir:
            raise SystemExit("--local-dir copies the memory tier: give --memory-every-n-steps too")
        return None
    local = None
    if args.local_dir:
        local = LocalDiskConfig(args.local_dir, args.local_every_secs, keep=args.local_keep)
    return MemoryTierConfig(
        args.memory_every_n_steps, args.memory_slots, args.memory_root, local_disk=local
    )


def resumed_from(sess: Any) -> str | None:
    """``"<prefix> (<tier> tier)"`` of what ``sess`` was restored from; None if nothing."""
    where = sess.restored_checkpoint
    tier = getattr(sess, "restored_tier", None)
    return None if where is None else f"{where} ({tier} tier)" if tier else where


class _DefaultsAndRawDescription(
    argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter
):
    """``--help`` shows every option's default and the description as written."""


def run_main(
    prog: str,
    description: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], Any],
    argv: list[str] | None,
) -> int:
    """Parse ``argv`` with the demo's options, set up logging, run it; return 0."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(description or "").replace("``", ""),
        formatter_class=_DefaultsAndRawDescription,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    run(args)
    return 0
