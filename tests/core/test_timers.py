"""SecondOrStepTimer and NeverTriggerTimer: pure, driven by a fake clock."""

from __future__ import annotations

import pytest

from torchsupervisor.core.timers import NeverTriggerTimer, SecondOrStepTimer


def test_needs_exactly_one_interval():
    with pytest.raises(
        ValueError, match=r"^Either every_secs or every_steps should be provided\.$"
    ):
        SecondOrStepTimer()
    with pytest.raises(ValueError, match=r"^Can not provide both every_secs and every_steps\.$"):
        SecondOrStepTimer(every_secs=1.0, every_steps=1)


def test_steps_timer_schedule():
    timer = SecondOrStepTimer(every_steps=10)
    assert timer.last_triggered_step() is None
    assert timer.should_trigger_for_step(5)  # Never triggered: always due.
    assert timer.update_last_triggered_step(5) == (None, None)
    assert timer.last_triggered_step() == 5
    assert not timer.should_trigger_for_step(5)
    assert not timer.should_trigger_for_step(14)
    assert timer.should_trigger_for_step(15)
    assert timer.should_trigger_for_step(40)
    elapsed_secs, elapsed_steps = timer.update_last_triggered_step(17)
    assert elapsed_steps == 12 and elapsed_secs >= 0.0


def test_secs_timer_reads_the_clock(fake_clock):
    timer = SecondOrStepTimer(every_secs=30.0, clock=fake_clock)
    assert timer.should_trigger_for_step(0)
    timer.update_last_triggered_step(0)
    fake_clock.advance(29.0)
    assert not timer.should_trigger_for_step(100)
    fake_clock.advance(1.0)
    assert timer.should_trigger_for_step(100)
    assert not timer.should_trigger_for_step(0)  # The same step never triggers twice.
    assert timer.update_last_triggered_step(100) == (30.0, 100)


def test_reset_forgets_the_last_trigger(fake_clock):
    timer = SecondOrStepTimer(every_steps=100, clock=fake_clock)
    timer.update_last_triggered_step(3)
    assert not timer.should_trigger_for_step(4)
    timer.reset()
    assert timer.last_triggered_step() is None
    assert timer.should_trigger_for_step(4)
    assert timer.update_last_triggered_step(4) == (None, None)


def test_never_trigger_timer():
    timer = NeverTriggerTimer()
    assert not timer.should_trigger_for_step(0)
    assert timer.update_last_triggered_step(7) == (None, None)
    assert timer.last_triggered_step() is None
    timer.reset()
    assert not timer.should_trigger_for_step(1_000_000)
