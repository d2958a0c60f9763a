"""``Deadline.call``: work a stop waits for only until its deadline."""

from __future__ import annotations

import threading

from torchsupervisor.core.clock import REAL_CLOCK, Deadline


def test_without_a_limit_the_call_runs_here():
    ran = []
    assert Deadline(REAL_CLOCK, None).call(lambda: ran.append(threading.get_ident()), "x")
    assert ran == [threading.get_ident()]


def test_a_call_that_does_not_end_in_time_is_left_behind():
    release = threading.Event()
    started = threading.Event()

    def stuck():  # A store that does not answer.
        started.set()
        release.wait(30)

    try:
        assert not Deadline(REAL_CLOCK, 0.2).call(stuck, "test-stuck")
        assert started.is_set()
    finally:
        release.set()
    assert Deadline(REAL_CLOCK, 10).call(lambda: None, "test-quick")


def test_after_the_deadline_nothing_is_started(fake_clock):
    deadline = Deadline(fake_clock, 1.0)
    fake_clock.advance(2.0)
    ran = []
    assert not deadline.call(lambda: ran.append(1), "test-late")
    assert ran == []
