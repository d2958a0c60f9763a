"""Plain-text output of the commands: sizes, times, aligned tables."""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence

__all__ = ["human_bytes", "local_time", "print_table", "short_value"]


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``; bytes below 1 KiB are shown exactly."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "TiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def local_time(seconds: float | None) -> str:
    """Seconds since the epoch as local ``YYYY-MM-DD HH:MM:SS`` (``-`` if unknown)."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    try:
        return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return "-"


def short_value(value: float) -> str:
    """A scalar for a table: up to 6 significant digits."""
    return f"{value:.6g}"


def print_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> None:
    """Print ``rows`` under ``header`` in aligned columns (``right``: right-aligned columns)."""
    widths = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(cells)
        ]
        return "  ".join(parts).rstrip()

    print(line(header))
    for row in rows:
        print(line(row))
