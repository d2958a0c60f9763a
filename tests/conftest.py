"""Shared fixtures: a clean default graph per test, no leaked threads, a fake clock."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from torchsupervisor.checkpoint import commit as checkpoint_commit
from torchsupervisor.checkpoint import engine as checkpoint_engine
from torchsupervisor.clock import Clock
from torchsupervisor.registry import reset_default_graph
from torchsupervisor.summary import SummaryWriterCache


class FakeClock(Clock):
    """A clock whose time moves only when a test advances it or something sleeps or waits.

    ``sleep`` and a ``wait`` that times out advance the time by the requested amount at once,
    so code that polls on a timer runs through its schedule without real waiting.
    """

    def __init__(self, start_secs: float = 1_000.0, epoch_secs: float = 1_700_000_000.0):
        self._lock = threading.Lock()
        self._now = start_secs
        self._epoch = epoch_secs
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def time(self) -> float:
        with self._lock:
            return self._epoch + self._now

    def advance(self, secs: float) -> None:
        with self._lock:
            self._now += secs

    def sleep(self, secs: float) -> None:
        self.sleeps.append(secs)
        if secs > 0:
            self.advance(secs)

    def wait(self, event: threading.Event, timeout_secs: float | None) -> bool:
        if event.is_set():
            return True
        if timeout_secs is None:
            return event.wait()
        if timeout_secs > 0:
            self.advance(timeout_secs)
        return event.is_set()


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(autouse=True)
def _clean_graph_and_threads():
    """Each test starts with an empty default graph and must not leave threads running."""
    reset_default_graph()
    before = set(threading.enumerate())
    yield
    SummaryWriterCache.clear()
    reset_default_graph()
    pending = [f for f in list(checkpoint_engine._in_flight) if not f.done()]
    _, not_done = concurrent.futures.wait(pending, timeout=10.0)
    assert not not_done, "checkpoint saves still running after the test"
    checkpoint_engine._close_all()  # Idle writer threads of savers the test still references.
    checkpoint_commit._Beside.stop_helper()  # The process-wide checksum helper, idle now.
    deadline = time.monotonic() + 10.0
    leaked = []
    for thread in set(threading.enumerate()) - before:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            leaked.append(thread.name)
    assert not leaked, f"threads still running after the test: {leaked}"
