"""An injectable clock, so that everything that waits or schedules can be tested without sleeping.

Timers (``LooperThread``, the Supervisor's services, ``SessionManager`` polling, retention of old
checkpoints) read time through a ``Clock``. Production code uses ``REAL_CLOCK``; tests pass a
clock whose time they advance by hand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["REAL_CLOCK", "Clock", "Deadline"]


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


class Deadline:
    """A time budget on a clock: what is left of it, and waits that never pass its end.

    Args:
        clock: The clock the budget runs on.
        budget_secs: The budget in seconds from now; None: no limit.

    Thread safety: immutable; may be shared between threads.
    """

    def __init__(self, clock: Clock, budget_secs: float | None) -> None:
        self.clock = clock
        self.budget_secs = budget_secs
        self._end = None if budget_secs is None else clock.monotonic() + budget_secs

    def remaining(self) -> float | None:
        """Seconds left (never negative); None without a limit."""
        if self._end is None:
            return None
        return max(0.0, self._end - self.clock.monotonic())

    def expired(self) -> bool:
        """True once the budget is spent."""
        return self._end is not None and self.clock.monotonic() >= self._end

    def wait(self, event: threading.Event) -> bool:
        """Wait for ``event`` until the deadline at the latest; return whether it is set."""
        return self.clock.wait(event, self.remaining())

    def call(self, fn: Callable[[], object], name: str) -> bool:
        """Run ``fn`` and return True once it ended; False if the deadline came first.

        Without a limit ``fn`` runs on the calling thread. With one it runs on a daemon
        thread named ``name``, which is left running when the deadline comes (a call stuck
        on an unreachable store must not hold up a stop): ``fn`` handles its own errors. Once
        the deadline has passed ``fn`` is not started at all (it could be cut off halfway).
        """
        if self._end is None:
            fn()
            return True
        if self.expired():
            return False
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        threading.Thread(target=run, name=name, daemon=True).start()
        return self.wait(done)
