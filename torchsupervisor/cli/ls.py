"""``torchsupervisor ls LOGDIR``: the checkpoints of a log directory, checked byte by byte.

For every committed checkpoint (a ``<prefix>.index`` file) of the directory and every snapshot
the memory tier holds for its run (``tiers/memory.py``): its tier, its global step, when it was
saved (the wall time its manifest records, in local time), its size, whether every byte
matches its checksums (``valid`` or ``CORRUPT``), why it is still on disk, and which one a
restart would restore: the first valid checkpoint in the order ``SessionManager`` tries them
(the same code runs here).

Why a checkpoint is kept:
    max_to_keep            listed in the state file: one of the newest ``max_to_keep``
                           (the newest only, when the Saver keeps everything)
    max_to_keep/best       listed, and saved with metrics: one of the newest, or one of the
                           best a ``Saver(keep_best=...)`` keeps (the METRICS column)
    unlisted               committed, older than the state file's newest entry and not
                           listed in it: the Saver never deletes it. Either
                           ``keep_checkpoint_every_n_hours`` preserved it, or the Saver keeps
                           every checkpoint (``max_to_keep=0`` or None lists only the newest),
                           or another saver, a copy by hand or a crash before its deletion
                           left it
    not yet in state file  newer than the state file's newest entry: the program stopped
                           between the commit and the state-file update (a restart tries it
                           first)
    no state file          the state file is missing or unreadable (a restart scans the
                           directory, newest first)
    memory slot            a snapshot of the memory tier (rank 0's: a restart tries it before
                           the directory's checkpoints when it is at least as new)
    another run's          a snapshot of the memory tier left by an earlier run of a log
                           directory of the same path (removed and made again): a restart
                           deletes it unread
    peer copy              a copy this node keeps of another node's snapshot of that rank
                           (the ``peer`` tier): a restart of that rank takes it when it is
                           newer than its own memory (a sharded run's ranks fetch it)
    local copy             a copy of a memory snapshot on this node's disk (the ``local``
                           tier, listed with ``--local-dir``: ``LocalDiskConfig``): a restart
                           tries it after the memory tier's snapshots of the same step
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from torchsupervisor.cli._format import human_bytes, local_time, print_table
from torchsupervisor.cli._survey import CORRUPT, Survey, survey
from torchsupervisor.cli._target import add_path_argument, resolve

__all__ = ["HELP", "add_arguments", "run"]

HELP = "list the checkpoints of a logdir: step, time, size, valid/corrupt, which one a restart uses"

EPILOG = """examples:
  torchsupervisor ls runs/exp
  torchsupervisor ls runs/exp --no-verify     # read the manifests only (fast)
  torchsupervisor ls runs/exp --json > checkpoints.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``ls`` to ``parser``."""
    add_path_argument(
        parser,
        "logdir",
        "the log directory (the Supervisor's), or a checkpoint of it (prefix or file)",
    )
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="do not read the data: skip the byte-by-byte check (status 'unchecked')",
    )
    parser.add_argument(
        "--memory-root",
        default=None,
        help="the memory tier's file system (default $TORCHSUPERVISOR_MEMORY_ROOT or /dev/shm)",
    )
    parser.add_argument(
        "--local-dir",
        default=None,
        help="the local-disk tier's directory (LocalDiskConfig.directory): list its copies too",
    )
    parser.add_argument("--json", action="store_true", help="print the listing as JSON")


def _note(info, found: Survey) -> str:
    if found.restore is info:
        return "<- a restart restores this"
    if info.format == "tf1":
        return "TF 1 checkpoint"
    if info.candidate is not None and (
        found.restore is None or info.candidate < (found.restore.candidate or 0)
    ):
        return "skipped by a restart" if info.status == CORRUPT else ""
    return ""


def _metrics(metrics: dict[str, float] | None) -> str:
    """``accuracy=0.981 loss=0.0712``, or ``-``."""
    if not metrics:
        return "-"
    return " ".join(f"{name}={value:.4g}" for name, value in sorted(metrics.items()))


def print_survey(found: Survey) -> None:
    """Print ``found`` as the table of ``torchsupervisor ls``."""
    where = found.state_file or "no state file"
    print(f"Checkpoints in {found.logdir} (state file: {where})")
    if found.state_file_error:
        print(f"  The state file is ignored: {found.state_file_error}")
    rows = []
    with_metrics = any(info.metrics for info in found.checkpoints)
    with_tiers = any(info.rank is not None for info in found.checkpoints)
    for info in found.checkpoints:
        size = human_bytes(info.size_bytes)
        if info.own_bytes != info.size_bytes:
            size += f" ({human_bytes(info.own_bytes)} own)"
        tier = info.tier if info.rank is None else f"{info.tier} (rank {info.rank})"
        rows.append(
            [
                *([tier] if with_tiers else []),
                "-" if info.step is None else str(info.step),
                local_time(info.wall_time),
                size,
                info.status.upper() if info.status == CORRUPT else info.status,
                info.kept_by,
                *([_metrics(info.metrics)] if with_metrics else []),
                info.name,
                _note(info, found),
            ]
        )
    if rows:
        header = ["STEP", "SAVED", "SIZE", "STATUS", "KEPT BY", "CHECKPOINT", ""]
        if with_metrics:
            header.insert(5, "METRICS")
        if with_tiers:  # Only when the memory tier holds snapshots of this run.
            header.insert(0, "TIER")
        print_table(header, rows, (1,) if with_tiers else (0,))
    else:
        print("  (no committed checkpoint)")
    for info in found.checkpoints:
        if info.error:
            print(f"{info.name}: {info.error}")
    for prefix in found.incomplete:
        print(
            f"{os.path.basename(prefix)}: incomplete (data files but no index: an interrupted "
            "save); a restart ignores it and removes it"
        )
    for prefix in found.shared_data:
        print(
            f"{os.path.basename(prefix)}: deleted, but its data files are kept for newer "
            "checkpoints that reuse them"
        )
    for path in found.temporaries:
        print(
            f"{os.path.basename(path)}: temporary file of an interrupted write (removed at start)"
        )
    print(restart_summary(found))


def restart_summary(found: Survey) -> str:
    """One sentence: what a restart from this directory would do."""
    text = _restart(found)
    if any(info.format == "tf1" for info in found.checkpoints):
        text += (
            " TF 1 checkpoints are read (load_checkpoint, inspect) and restored through a name "
            "map (interop.restore_tf_checkpoint), never by a restart."
        )
    return text


def _restart(found: Survey) -> str:
    if found.restore is not None:
        step = found.restore.step
        text = f"A restart restores {found.restore.name}"
        if found.restore.rank is not None:
            text += f" from the {found.restore.tier} tier"
        text += f" (step {step})." if step is not None else "."
        first = found.first_candidate
        if first is not None and first is not found.restore:
            what = "a TF 1 checkpoint" if first.format == "tf1" else first.status
            text += f" It skips {first.name}, which is {what}."
        return text
    if found.checkpoints:
        return "No valid checkpoint: a restart fails with DataLossError (nothing is restorable)."
    return "No checkpoint: a restart starts from scratch."


def run(args: argparse.Namespace) -> int:
    """Run ``torchsupervisor ls``; returns the exit status (0, or 1 for a missing logdir)."""
    found = survey(
        resolve(args.logdir).logdir,
        verify=not args.no_verify,
        memory_root=args.memory_root,
        local_dir=args.local_dir,
    )
    if args.json:
        out = dataclasses.asdict(found)
        out["restore"] = found.restore.prefix if found.restore else None
        out["first_candidate"] = found.first_candidate.prefix if found.first_candidate else None
        print(json.dumps(out, indent=1))
    else:
        print_survey(found)
    return 0
