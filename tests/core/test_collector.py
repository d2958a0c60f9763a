"""The cyclic garbage collector is paused while a checkpoint job runs (core/collector.py)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from torchsupervisor.checkpoint.engine import CheckpointEngine
from torchsupervisor.core import collector


@pytest.fixture(autouse=True)
def _collector_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_disables_the_collector_and_enables_it_again():
    with collector.paused():
        assert not gc.isenabled()
        with collector.paused():  # Nested: still paused when the inner one ends.
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_disabled_by_the_program_stays_disabled():
    gc.disable()
    with collector.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_pauses_on_two_threads_end_with_the_last():
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with collector.paused():
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(30)
    with collector.paused():
        pass
    assert not gc.isenabled()  # The other thread's pause goes on.
    release.set()
    thread.join(30)
    assert gc.isenabled()


def test_a_checkpoint_job_runs_with_the_collector_paused_and_outside_autograd():
    engine = CheckpointEngine()
    future = engine.submit(lambda: (gc.isenabled(), torch.is_grad_enabled()))
    assert future.result(timeout=60) == (False, False)
    assert gc.isenabled() and torch.is_grad_enabled()  # This thread's own grad mode.
    engine.close()


def test_a_pause_that_lasts_too_long_gives_the_collector_back():
    with collector.paused(max_secs=0.05):
        for _ in range(600):  # Bounded: at most 30 s.
            if gc.isenabled():
                break
            threading.Event().wait(0.05)
        assert gc.isenabled()
        gc.disable()  # The program's own choice now: the pause's end leaves it alone.
    assert not gc.isenabled()
    with collector.paused():  # A later pause starts afresh.
        assert not gc.isenabled()
    assert not gc.isenabled()
