"""Test doubles of the summary tests (kept out of the package, as the style guide asks)."""

from __future__ import annotations

import threading

from torchsupervisor.core.clock import Clock


class FakeClock(Clock):
    """A clock whose time moves only when a test calls ``advance``.

    ``wait(event, timeout)`` returns when the event is set or when ``advance`` has moved the
    time past the deadline. ``timed_wait_started`` is set whenever somebody starts a wait with a
    timeout (``timed_waits`` lists the timeouts), so a test can tell that a thread went idle.
    """

    def __init__(self, wall: float = 1_600_000_000.25, mono: float = 1000.0) -> None:
        self._cond = threading.Condition()
        self._wall = wall
        self._mono = mono
        self.timed_waits: list[float] = []
        self.timed_wait_started = threading.Event()

    def time(self) -> float:
        with self._cond:
            return self._wall

    def monotonic(self) -> float:
        with self._cond:
            return self._mono

    def advance(self, secs: float) -> None:
        with self._cond:
            self._wall += secs
            self._mono += secs
            self._cond.notify_all()

    def set_wall(self, wall: float) -> None:
        with self._cond:
            self._wall = wall

    def sleep(self, secs: float) -> None:
        self.advance(max(0.0, secs))

    def wait(self, event: threading.Event, timeout_secs: float | None) -> bool:
        if timeout_secs is None:
            return event.wait()
        with self._cond:
            deadline = self._mono + timeout_secs
            self.timed_waits.append(timeout_secs)
        self.timed_wait_started.set()
        while True:
            if event.is_set():
                return True
            with self._cond:
                if self._mono >= deadline:
                    return False
                self._cond.wait(0.005)
