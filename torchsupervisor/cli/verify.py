"""``torchsupervisor verify LOGDIR``: is the checkpoint a restart would use intact?

A restart tries the checkpoints of LOGDIR in a fixed order (the state file's newest entry, or
a newer committed one it does not list yet, then older ones) and restores the first whose every
byte matches its checksums. ``verify`` runs that same search and checks every byte of the
checkpoint a restart tries first.

Exit status:
    0  the checkpoint a restart tries first is valid: a restart restores it, nothing is lost
    1  it is damaged (what is wrong is printed, and which older checkpoint a restart would
       fall back to, if any), or there is no checkpoint at all, or LOGDIR does not exist
    2  usage error

With ``--all``, every committed checkpoint is checked, and the status is 0 only if all are
valid. LOGDIR may also be a checkpoint prefix (``runs/exp/model.ckpt-300``): that checkpoint
is checked.
"""

from __future__ import annotations

import argparse
import os

from torchsupervisor.checkpoint.recovery import scan_checkpoints
from torchsupervisor.cli._format import human_bytes
from torchsupervisor.cli._survey import VALID, CheckpointInfo, check, restart_order
from torchsupervisor.cli._target import add_path_argument, resolve

__all__ = ["HELP", "add_arguments", "run"]

HELP = "check every byte of the checkpoint a restart would use; exit status 0 only if valid"

EPILOG = """examples:
  torchsupervisor verify runs/exp && echo restorable
  torchsupervisor verify runs/exp --all
  torchsupervisor verify runs/exp/model.ckpt-300
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``verify`` to ``parser``."""
    add_path_argument(
        parser,
        "logdir",
        "the log directory, or one checkpoint (its prefix, .index or a .data-* file)",
    )
    parser.add_argument(
        "--all", action="store_true", help="check every committed checkpoint, not only the first"
    )


def _describe(info: CheckpointInfo) -> str:
    step = "" if info.step is None else f" (step {info.step})"
    return f"{os.path.basename(info.prefix)}{step}"


def _report(info: CheckpointInfo) -> None:
    if info.status == VALID:
        print(f"ok       {_describe(info)}: {human_bytes(info.size_bytes)}, every byte checked")
    else:
        print(f"CORRUPT  {_describe(info)}: {info.error}")


def run(args: argparse.Namespace) -> int:
    """Run ``torchsupervisor verify``; returns the exit status."""
    resolved = resolve(args.logdir)
    if resolved.prefix is not None:  # One checkpoint: its prefix or one of its files.
        info = check(resolved.prefix)
        _report(info)
        return 0 if info.status == VALID else 1
    target = resolved.logdir
    if args.all:
        prefixes = scan_checkpoints(target)
        if not prefixes:
            print(f"No checkpoint in {target}.")
            return 1
        infos = [check(prefix) for prefix in prefixes]
        for info in infos:
            _report(info)
        bad = [i for i in infos if i.status != VALID]
        print(f"{len(infos) - len(bad)} of {len(infos)} checkpoints are valid.")
        return 1 if bad else 0
    candidates = restart_order(target)
    if not candidates:
        print(f"No checkpoint in {target}: a restart starts from scratch.")
        return 1
    first = None
    for prefix in candidates:
        info = check(prefix)
        _report(info)
        if first is None:
            first = info
        if info.status == VALID:
            if info is first:
                print(f"A restart restores {_describe(info)}.")
                return 0
            print(
                f"A restart would skip {_describe(first)} and fall back to {_describe(info)}"
                + _lost(first, info)
            )
            return 1
    print(
        f"No valid checkpoint in {target}: a restart fails with DataLossError. Repair or "
        "remove the damaged checkpoints to start again from scratch."
    )
    return 1


def _lost(first: CheckpointInfo, fallback: CheckpointInfo) -> str:
    if first.step is not None and fallback.step is not None and first.step > fallback.step:
        return f", losing {first.step - fallback.step} steps."
    return "."
