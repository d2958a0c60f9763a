"""Time the training thread spent waiting for its input: what the goodput ledger counts as
``data`` badput.

``INPUT_WAITS`` is one process-wide counter: the input pipelines that can tell how long the
training loop waited for a batch (``ResumableDataLoader``) add to it, and the goodput recorder
(``driver/goodput.py``) reads it. It lives in ``core`` so that both can reach it without
knowing each other.

TF name: none.
"""

from __future__ import annotations

__all__ = ["INPUT_WAITS", "WaitCounter"]


class WaitCounter:
    """Seconds waited, summed.

    Thread safety: ``add`` from the training thread; ``secs`` read from anywhere (a float
    read is atomic).
    """

    __slots__ = ("secs",)

    def __init__(self) -> None:
        self.secs = 0.0

    def add(self, secs: float) -> None:
        """Count ``secs`` more seconds of waiting."""
        self.secs += secs


INPUT_WAITS = WaitCounter()
"""The training thread's waits for input batches, in seconds, since the process started."""
