"""``torchsupervisor preempted LOGDIR``: did the last session stop for a preemption, losing nothing?

A requeue script needs to tell a clean preemption from a crash, and the exit status of
``torchrun`` cannot: its agent, signalled along with the workers, exits 1 even when every
worker stopped cleanly with its final checkpoint. The chief records how each session ended in
``LOGDIR/last_stop.json`` (and removes the record when a session starts, so a killed session
leaves none); this command reads it and prints one line.

Exit status:
    0  the last session was stopped by a preemption signal and its final checkpoint
       committed: requeue the job, it resumes where it stopped
    1  anything else: it ended by itself, failed, lost work at its stop, was killed
       (no record), or is still running; the line says which
    2  usage error
"""

from __future__ import annotations

import argparse

from torchsupervisor.driver.stop_record import read_stop_record
from torchsupervisor.storage import storage_for

__all__ = ["HELP", "add_arguments", "run"]

HELP = "exit status 0 if the last session stopped for a preemption with its final checkpoint"

EPILOG = """examples:
  torchrun --nproc_per_node=4 train.py --logdir runs/exp
  torchsupervisor preempted runs/exp && scontrol requeue "$SLURM_JOB_ID"
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``preempted`` to ``parser``."""
    parser.add_argument("logdir", metavar="LOGDIR", help="the log directory (local or a URL)")


def run(args: argparse.Namespace) -> int:
    """Run ``torchsupervisor preempted``; returns the exit status."""
    record = read_stop_record(storage_for(args.logdir), args.logdir)
    if record is None:
        print(
            f"No record of how the last session in {args.logdir} ended: it was killed "
            "(kill -9, a lost node, or a crash before it could record anything), or it is "
            "still running"
        )
        return 1
    print(f"{record.describe()}.")
    return 0 if record.requeue else 1
