"""Counts of the adversarial trials (``tests/test_adversarial.py``), printed at the end.

``make test-slow`` shows one line per class: trials run and trials that failed. A failed
trial's description is kept for the report; the test of its class fails after all its trials.
"""

from __future__ import annotations

from collections import defaultdict

TRIALS: dict[str, int] = defaultdict(int)
FAILURES: dict[str, list[str]] = defaultdict(list)


def record(kind: str, failure: str | None = None) -> None:
    """Count one trial of ``kind``; ``failure`` describes what went wrong (None: it held)."""
    TRIALS[kind] += 1
    if failure is not None:
        FAILURES[kind].append(failure)


def report_lines() -> list[str]:
    """One line per class, in the order the classes ran."""
    lines = []
    for kind, trials in TRIALS.items():
        failures = FAILURES.get(kind, [])
        lines.append(f"{kind:<40} {trials:>5} trials {len(failures):>4} failures")
        lines.extend(f"    {f}" for f in failures[:5])
    return lines
