"""Shared fixtures: a clean default graph per test, no leaked threads, a fake clock."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from torchsupervisor.checkpoint import commit as checkpoint_commit
from torchsupervisor.checkpoint import engine as checkpoint_engine
from torchsupervisor.core.registry import reset_default_graph
from torchsupervisor.summary import SummaryWriterCache
from torchsupervisor.testing import FakeClock


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


def pytest_terminal_summary(terminalreporter):
    """After ``make test-slow``: trials and failures of each adversarial class."""
    import adversarial_record

    lines = adversarial_record.report_lines()
    if lines:
        terminalreporter.section("adversarial trials")
        for line in lines:
            terminalreporter.write_line(line)
