"""``torchsupervisor goodput LOGDIR``: how much of a run's time was productive, where the rest went.

Reads the run's goodput ledger (``LOGDIR/goodput/``, written by every rank and every restart:
``driver/goodput.py``) and prints, for one rank (``--rank``, default 0), the goodput over the
whole run (productive step time over wall time) and the badput by cause (start-up, restore,
checkpoint stalls, the final stop, steps lost to failures, time between a process's end and
the next one's start, and causes a program marked), then one line per process. ``--csv``
prints the same as CSV (a row per process and a total); ``--plot FILE.png`` draws each
process's time by cause (needs matplotlib: ``pip install 'torchsupervisor[plot]'``). Works
offline, on a local or object-store log directory.

Exit status: 0, or 1 when the log directory has no ledger for the rank.
"""

from __future__ import annotations

import argparse
import sys

from torchsupervisor.summary.goodput_report import GoodputReport, goodput_report
from torchsupervisor.summary.ledger import read_ledgers

__all__ = ["HELP", "add_arguments", "plot", "run"]

HELP = "goodput and badput by cause of a run, from its ledger; --csv, --plot out.png"

EPILOG = """examples:
  torchsupervisor goodput runs/exp
  torchsupervisor goodput runs/exp --rank 3 --csv > goodput.csv
  torchsupervisor goodput s3://bucket/runs/exp --plot goodput.png
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``goodput`` to ``parser``."""
    parser.add_argument("logdir", metavar="LOGDIR", help="the log directory (local or a URL)")
    parser.add_argument("--rank", type=int, default=0, help="the rank to report (default 0)")
    parser.add_argument("--csv", action="store_true", help="print CSV instead of a table")
    parser.add_argument(
        "--plot", metavar="FILE", help="draw each process's time by cause (needs matplotlib)"
    )


def plot(report: GoodputReport, path: str) -> None:
    """Draw a stacked bar per process: productive time and each badput cause, in seconds.

    Raises:
        ImportError: matplotlib is not installed (with how to install it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib: pip install 'torchsupervisor[plot]' (or matplotlib)"
        ) from None
    names = ["productive", *(c for c in report.causes if report.causes[c] > 0)]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(report.incarnations) + 3), 4))
    bottoms = [0.0] * len(report.incarnations)
    xs = list(range(len(report.incarnations)))
    for name in names:
        heights = [
            inc.productive if name == "productive" else inc.causes.get(name, 0.0)
            for inc in report.incarnations
        ]
        ax.bar(xs, heights, bottom=bottoms, label=name)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_xlabel("process (in start order)")
    ax.set_ylabel("seconds")
    ax.set_title(f"goodput {report.goodput:.1%} over {report.wall:.0f} s (rank {report.rank})")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Run ``torchsupervisor goodput``; returns the exit status."""
    report = goodput_report(read_ledgers(args.logdir), rank=args.rank)
    if not report.incarnations:
        print(f"No goodput ledger of rank {args.rank} in {args.logdir}", file=sys.stderr)
        return 1
    if args.plot:
        plot(report, args.plot)
        print(f"Wrote {args.plot}", file=sys.stderr)
    print(report.csv() if args.csv else report.table(), end="" if args.csv else "\n")
    return 0
