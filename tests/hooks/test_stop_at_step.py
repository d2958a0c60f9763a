"""StopAtStepHook: argument errors, num_steps counted from session creation, last_step."""

from __future__ import annotations

import pytest
from monitored_helpers import Counter

from torchsupervisor import GlobalStep, Session
from torchsupervisor.core.registry import GraphKeys, add_to_collection
from torchsupervisor.hooks import StopAtStepHook
from torchsupervisor.monitored.creators import ChiefSessionCreator
from torchsupervisor.monitored.session import MonitoredSession
from torchsupervisor.monitored.training_session import MonitoredTrainingSession
from torchsupervisor.monitored.wrappers import HookedSession


def test_argument_errors():
    with pytest.raises(ValueError, match=r"^One of num_steps or last_step must be specified\.$"):
        StopAtStepHook()
    with pytest.raises(
        ValueError, match=r"^Only one of num_steps or last_step can be specified\.$"
    ):
        StopAtStepHook(num_steps=1, last_step=2)


def test_begin_needs_a_global_step():
    with pytest.raises(
        RuntimeError, match=r"^Global step should be created to use StopAtStepHook\.$"
    ):
        StopAtStepHook(num_steps=1).begin()


def run_until_stop(sess, counter, limit=100):
    runs = 0
    while not sess.should_stop() and runs < limit:
        sess.run(counter.step)
        runs += 1
    return runs


def test_last_step_stops_after_the_run_reaching_it():
    counter = Counter()
    hook = StopAtStepHook(last_step=5)
    with MonitoredSession(ChiefSessionCreator(state=counter.state), hooks=[hook]) as sess:
        assert run_until_stop(sess, counter) == 5
    assert counter.global_step.value == 5


def test_num_steps_counts_from_the_step_at_session_creation():
    counter = Counter(start=3)
    hook = StopAtStepHook(num_steps=4)
    with MonitoredSession(ChiefSessionCreator(state=counter.state), hooks=[hook]) as sess:
        assert hook.last_step == 7
        assert run_until_stop(sess, counter) == 4
    assert counter.global_step.value == 7


def test_num_steps_after_a_restore(tmp_path):
    counter = Counter()
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path), state=counter.state, hooks=[StopAtStepHook(last_step=3)]
    ) as sess:
        run_until_stop(sess, counter)
    resumed = Counter()
    hook = StopAtStepHook(num_steps=4)
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path), state=resumed.state, hooks=[hook]
    ) as sess:
        assert resumed.global_step.value == 3  # Restored from the final checkpoint.
        assert run_until_stop(sess, resumed) == 4
    assert resumed.global_step.value == 7


def test_a_step_moving_by_more_than_one_per_run():
    step = GlobalStep()
    add_to_collection(GraphKeys.GLOBAL_STEP, step)
    hook = StopAtStepHook(last_step=10)
    hook.begin()
    sess = HookedSession(Session({"global_step": step}), [hook])
    runs = 0
    while not sess.should_stop():
        sess.run(lambda: step.increment(4))
        runs += 1
    assert (runs, step.value) == (3, 12)


def test_bare_hooked_session_counts_num_steps_from_the_first_run():
    step = GlobalStep(10)
    add_to_collection(GraphKeys.GLOBAL_STEP, step)
    hook = StopAtStepHook(num_steps=2)
    hook.begin()
    sess = HookedSession(Session({"global_step": step}), [hook])
    sess.run(step.increment)
    assert not sess.should_stop()
    sess.run(step.increment)
    assert sess.should_stop()
