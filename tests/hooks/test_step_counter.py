"""StepCounterHook: global_step/sec summaries on schedule, read back with TensorBoard."""

from __future__ import annotations

import logging

import pytest
from monitored_helpers import Counter
from supervisor_helpers import accumulator

from torchsupervisor import GlobalStep, Session, SummaryWriter, SummaryWriterCache
from torchsupervisor.core.registry import GraphKeys, add_to_collection
from torchsupervisor.hooks import StepCounterHook
from torchsupervisor.monitored.creators import ChiefSessionCreator
from torchsupervisor.monitored.session import MonitoredSession
from torchsupervisor.monitored.wrappers import HookedSession


def test_argument_errors():
    text = r"^exactly one of every_n_steps and every_n_secs should be provided\.$"
    with pytest.raises(ValueError, match=text):
        StepCounterHook(every_n_steps=None)
    with pytest.raises(ValueError, match=text):
        StepCounterHook(every_n_steps=10, every_n_secs=5)


def test_begin_needs_a_global_step(tmp_path):
    with pytest.raises(
        RuntimeError, match=r"^Global step should be created to use StepCounterHook\.$"
    ):
        StepCounterHook(output_dir=str(tmp_path)).begin()


def test_rates_every_n_steps(tmp_path, fake_clock):
    counter = Counter()
    hook = StepCounterHook(every_n_steps=10, output_dir=str(tmp_path), clock=fake_clock)
    with MonitoredSession(ChiefSessionCreator(state=counter.state), hooks=[hook]) as sess:
        for _ in range(35):
            fake_clock.advance(0.5)
            sess.run(counter.step)
    SummaryWriterCache.clear()
    events = accumulator(tmp_path).Scalars("global_step/sec")
    assert [(e.step, e.value) for e in events] == [(11, 2.0), (21, 2.0), (31, 2.0)]


def test_rates_every_n_secs_and_the_tag_of_a_named_step(tmp_path, fake_clock):
    step = GlobalStep(name="bar/foo")
    add_to_collection(GraphKeys.GLOBAL_STEP, step)
    writer = SummaryWriter(str(tmp_path))
    hook = StepCounterHook(
        every_n_steps=None, every_n_secs=10.0, summary_writer=writer, clock=fake_clock
    )
    hook.begin()
    sess = HookedSession(Session({"global_step": step}), [hook])
    for _ in range(12):
        fake_clock.advance(2.0)
        sess.run(lambda: step.increment(3))
    writer.close()
    events = accumulator(tmp_path).Scalars("bar/foo/sec")
    # First run (step 3) records; then due at +10 s (step 18) and +20 s (step 33).
    assert [(e.step, e.value) for e in events] == [(18, 1.5), (33, 1.5)]


def test_no_writer_only_logs(caplog, fake_clock):
    counter = Counter()
    add_to_collection(GraphKeys.GLOBAL_STEP, counter.global_step)
    hook = StepCounterHook(every_n_steps=2, clock=fake_clock)
    hook.begin()
    sess = HookedSession(Session(counter.state), [hook])
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        for _ in range(3):
            fake_clock.advance(1.0)
            sess.run(counter.step)
    assert "global_step/sec: 1" in caplog.text


def test_a_stuck_global_step_is_reported_five_times(caplog, fake_clock):
    counter = Counter()
    add_to_collection(GraphKeys.GLOBAL_STEP, counter.global_step)
    hook = StepCounterHook(every_n_steps=100, clock=fake_clock)
    hook.begin()
    sess = HookedSession(Session(counter.state), [hook])
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        for _ in range(10):
            sess.run(lambda: None)
    warnings = [r for r in caplog.records if "has not been increased" in r.getMessage()]
    assert len(warnings) == 5
    assert "Current value (could be stable): 0 vs previous value: 0" in warnings[0].getMessage()


def test_after_a_new_session_the_first_trigger_only_records(tmp_path, fake_clock):
    counter = Counter()
    writer = SummaryWriter(str(tmp_path))
    add_to_collection(GraphKeys.GLOBAL_STEP, counter.global_step)
    hook = StepCounterHook(every_n_steps=1, summary_writer=writer, clock=fake_clock)
    hook.begin()
    for _ in range(2):  # Two sessions (a recovery): each starts by recording only.
        raw = Session(counter.state)
        hook.after_create_session(raw, None)
        sess = HookedSession(raw, [hook])
        for _ in range(2):
            fake_clock.advance(1.0)
            sess.run(counter.step)
    writer.close()
    assert [e.step for e in accumulator(tmp_path).Scalars("global_step/sec")] == [2, 4]
