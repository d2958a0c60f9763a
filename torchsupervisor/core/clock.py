"""An injectable clock, so that everything that waits or schedules can be tested without sleeping.

Timers (``LooperThread``, the Supervisor's services, ``SessionManager`` polling, retention of old
checkpoints) read time through a ``Clock``. Production code uses ``REAL_CLOCK``; tests pass a
clock whose time they advance by hand.
"""

from __future__ import annotations

import threading
import time

__all__ = ["REAL_CLOCK", "Clock"]


class Clock:
    """The real clock: ``time.monotonic``, ``time.time`` and real waits.

    Subclasses override all four methods together so that ``wait`` and ``sleep`` advance the
    same time that ``monotonic`` reports.

    Thread safety: every method may be called from any thread.
    """

    def monotonic(self) -> float:
        """Return a monotonic time in seconds (only differences are meaningful)."""
        return time.monotonic()

    def time(self) -> float:
        """Return the wall-clock time in seconds since the epoch (for timestamps on disk)."""
        return time.time()

    def sleep(self, secs: float) -> None:
        """Block for ``secs`` seconds (no-op when ``secs <= 0``)."""
        if secs > 0:
            time.sleep(secs)

    def wait(self, event: threading.Event, timeout_secs: float | None) -> bool:
        """Wait until ``event`` is set or ``timeout_secs`` pass; ``None`` waits forever.

        Returns:
            True if the event is set, False if the timeout expired first.
        """
        if timeout_secs is not None and timeout_secs <= 0:
            return event.is_set()
        return event.wait(timeout_secs)


REAL_CLOCK = Clock()
