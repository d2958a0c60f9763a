"""Fixtures of the summary tests: a fake clock, a fresh default graph, no leaked threads."""

from __future__ import annotations

import threading

import pytest

from torchsupervisor.core import registry
from torchsupervisor.testing import FakeClock


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock(epoch_secs=1_599_999_000.25, auto_advance=False)


@pytest.fixture
def graph():
    """Give the test an empty default graph and restore an empty one afterwards."""
    registry.reset_default_graph()
    yield registry.get_default_graph()
    registry.reset_default_graph()


def _writer_threads() -> set[threading.Thread]:
    return {
        t
        for t in threading.enumerate()
        if t.name.startswith("torchsupervisor-summary-writer") and t.is_alive()
    }


@pytest.fixture(autouse=True)
def no_leaked_writer_threads():
    """Fail a test that leaves a summary writer thread running (writers must be closed)."""
    before = _writer_threads()
    yield
    leaked = []
    for thread in _writer_threads() - before:
        thread.join(10.0)
        if thread.is_alive():
            leaked.append(thread.name)
    assert not leaked, f"summary writer threads still running: {leaked}"
