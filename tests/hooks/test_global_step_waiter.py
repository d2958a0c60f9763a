"""GlobalStepWaiterHook: a worker waits for the global step (on an injected clock)."""

from __future__ import annotations

import logging

import pytest
from monitored_helpers import Counter

from torchsupervisor import Session
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.registry import GraphKeys, add_to_collection
from torchsupervisor.hooks import GlobalStepWaiterHook
from torchsupervisor.monitored.wrappers import HookedSession


class StepMovingClock(Clock):
    """A clock whose sleeps move the global step, as another worker would."""

    def __init__(self, step, by: int) -> None:
        self.step = step
        self.by = by
        self.sleeps: list[float] = []

    def sleep(self, secs: float) -> None:
        self.sleeps.append(secs)
        self.step.increment(self.by)


def test_waiter_needs_a_global_step():
    with pytest.raises(
        RuntimeError, match=r"^Global step should be created to use _GlobalStepWaiterHook\.$"
    ):
        GlobalStepWaiterHook(5).begin()


def test_waiter_blocks_the_first_run_until_the_step_is_reached(caplog):
    counter = Counter()
    add_to_collection(GraphKeys.GLOBAL_STEP, counter.global_step)
    clock = StepMovingClock(counter.global_step, by=400)
    hook = GlobalStepWaiterHook(2500, clock=clock)
    hook.begin()
    sess = HookedSession(Session(counter.state), [hook])
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        sess.run(lambda: None)
    assert counter.global_step.value == 2800
    assert clock.sleeps == [0.5] * 7
    text = caplog.text
    assert "Waiting for global step 2500 before starting training." in text
    assert "Current step is 1200." in text and "Current step is 2400." in text
    sess.run(lambda: None)  # Started: never waits again.
    assert len(clock.sleeps) == 7


def test_waiter_with_a_non_positive_step_never_waits():
    counter = Counter()
    add_to_collection(GraphKeys.GLOBAL_STEP, counter.global_step)
    clock = StepMovingClock(counter.global_step, by=1)
    hook = GlobalStepWaiterHook(0, clock=clock)
    hook.begin()
    HookedSession(Session(counter.state), [hook]).run(lambda: None)
    assert clock.sleeps == []
