"""SummarySaverHook: the summary op runs only on due steps (1, 9, 17, 25 for save_steps=8)."""

from __future__ import annotations

import pytest
from monitored_helpers import Counter
from supervisor_helpers import START, accumulator, all_events, session_logs

from torchsupervisor import Session, SummaryWriter, SummaryWriterCache, summary
from torchsupervisor.core.registry import GraphKeys, add_to_collection
from torchsupervisor.hooks import SummarySaverHook
from torchsupervisor.monitored.creators import ChiefSessionCreator
from torchsupervisor.monitored.scaffold import Scaffold
from torchsupervisor.monitored.session import MonitoredSession
from torchsupervisor.monitored.wrappers import HookedSession


def test_argument_errors():
    text = r"^Exactly one of scaffold or summary_op must be provided\.$"
    with pytest.raises(ValueError, match=text):
        SummarySaverHook(save_steps=1)
    with pytest.raises(ValueError, match=text):
        SummarySaverHook(save_steps=1, scaffold=Scaffold(), summary_op=lambda: None)
    with pytest.raises(ValueError, match="Either every_secs or every_steps"):
        SummarySaverHook(summary_op=lambda: None)


def test_begin_needs_a_global_step(tmp_path):
    hook = SummarySaverHook(save_steps=1, output_dir=str(tmp_path), summary_op=lambda: None)
    with pytest.raises(
        RuntimeError, match=r"^Global step should be created to use SummarySaverHook\.$"
    ):
        hook.begin()


def test_save_steps_schedule_and_op_evaluated_only_when_due(tmp_path):
    counter = Counter()
    evaluated = []

    def value():
        evaluated.append(counter.global_step.value)
        return float(counter.w)

    op = summary.scalar("w", value)
    hook = SummarySaverHook(save_steps=8, output_dir=str(tmp_path), summary_op=op)
    with MonitoredSession(ChiefSessionCreator(state=counter.state), hooks=[hook]) as sess:
        for _ in range(30):
            sess.run(counter.step)
    assert evaluated == [1, 9, 17, 25]
    SummaryWriterCache.clear()
    scalars = [(e.step, e.value) for e in accumulator(tmp_path).Scalars("w")]
    # Evaluated after the step: the value describes the state at the step it is written at.
    assert scalars == [(1, 1.0), (9, 9.0), (17, 17.0), (25, 25.0)]
    assert [(s, status) for s, status, _ in session_logs(all_events(tmp_path))] == [(1, START)]


def test_scaffold_summary_op_and_a_list_of_ops(tmp_path):
    counter = Counter()
    summary.scalar("a", 1.0)
    summary.scalar("b", 2.0)
    scaffold = Scaffold()
    hook = SummarySaverHook(save_steps=2, output_dir=str(tmp_path), scaffold=scaffold)
    with MonitoredSession(
        ChiefSessionCreator(scaffold=scaffold, state=counter.state), hooks=[hook]
    ) as sess:
        for _ in range(3):
            sess.run(counter.step)
    listed = tmp_path / "listed"
    ops = [summary.scalar("c", 3.0, collections=[]), summary.scalar("d", 4.0, collections=[])]
    writer = SummaryWriter(str(listed))
    hook = SummarySaverHook(save_steps=2, summary_writer=writer, summary_op=ops)
    hook.begin()
    sess = HookedSession(Session(counter.state), [hook])
    sess.run(counter.step)
    writer.close()
    SummaryWriterCache.clear()
    acc = accumulator(tmp_path)
    assert [e.step for e in acc.Scalars("a")] == [1, 3]
    assert [e.step for e in acc.Scalars("b")] == [1, 3]
    acc = accumulator(listed)
    assert [(e.step, e.value) for e in acc.Scalars("c")] == [(4, 3.0)]
    assert [(e.step, e.value) for e in acc.Scalars("d")] == [(4, 4.0)]


def test_save_secs_schedule(tmp_path, fake_clock):
    counter = Counter()
    op = summary.scalar("w", counter.w)
    hook = SummarySaverHook(save_secs=10, output_dir=str(tmp_path), summary_op=op, clock=fake_clock)
    with MonitoredSession(ChiefSessionCreator(state=counter.state), hooks=[hook]) as sess:
        for _ in range(8):
            fake_clock.advance(3.0)
            sess.run(counter.step)
    SummaryWriterCache.clear()
    # First run at 3 s; then the first run at >= 13 s (run 5, 15 s) and >= 25 s (run 9: none).
    assert [e.step for e in accumulator(tmp_path).Scalars("w")] == [1, 5]


def test_no_summaries_writes_only_start(tmp_path):
    counter = Counter()
    scaffold = Scaffold()
    hook = SummarySaverHook(save_steps=1, output_dir=str(tmp_path), scaffold=scaffold)
    counter.global_step.assign(7)
    with MonitoredSession(
        ChiefSessionCreator(scaffold=scaffold, state=counter.state), hooks=[hook]
    ) as sess:
        sess.run(counter.step)
        sess.run(counter.step)
    SummaryWriterCache.clear()
    events = all_events(tmp_path)
    assert [(s, status) for s, status, _ in session_logs(events)] == [(8, START)]
    assert not any(e.HasField("summary") for e in events)


def test_without_a_writer_nothing_is_evaluated():
    counter = Counter()
    calls = []
    add_to_collection(GraphKeys.GLOBAL_STEP, counter.global_step)
    hook = SummarySaverHook(save_steps=1, summary_op=lambda: calls.append(1))
    hook.begin()
    sess = HookedSession(Session(counter.state), [hook])
    sess.run(counter.step)
    assert calls == []
