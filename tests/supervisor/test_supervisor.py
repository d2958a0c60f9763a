"""Supervisor: USE_DEFAULT resolution, properties, and the chief / logdir rules.

Services, checkpoints and event files are in test_supervisor_services.py; restarts, custom
initialization and session reuse in test_supervisor_recovery.py.
"""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch
from supervisor_helpers import (
    STOP,
    Counter,
    Trainer,
    event_files,
    read_events,
    session_logs,
)
from tensorboard.compat.proto.summary_pb2 import Summary

import torchsupervisor as ts
from torchsupervisor import (
    Coordinator,
    GlobalStep,
    Graph,
    GraphKeys,
    NullSummaryWriter,
    Saver,
    Session,
    SessionManager,
    SummaryWriter,
    Supervisor,
    create_global_step,
    get_collection,
    summary,
)
from torchsupervisor.errors import DeadlineExceededError

NON_CHIEF_TEXT = (
    "Only chief supervisor can start standard services. Because only chief supervisors can "
    "write events."
)


def _sv_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("SV"))


# ----------------------------------------------------------------------------- construction


def test_use_default_is_the_class_attribute_zero():
    assert Supervisor.USE_DEFAULT == 0


def test_defaults_are_created_and_registered_in_the_collections(tmp_path):
    t = Trainer()
    logdir = str(tmp_path / "logs")
    sv = Supervisor(logdir=logdir, state=t.state)
    try:
        assert get_collection(GraphKeys.READY_OP) == [sv.ready_op]
        assert get_collection(GraphKeys.INIT_OP) == [sv.init_op]
        assert get_collection(GraphKeys.LOCAL_INIT_OP) == [sv.local_init_op]
        assert isinstance(sv.saver, Saver)
        assert get_collection(GraphKeys.SAVERS) == [sv.saver]
        assert get_collection(GraphKeys.GLOBAL_STEP) == [t.global_step]
        assert sv.global_step is t.global_step
        # No summary op exists: merge_all() is None and nothing is registered.
        assert sv.summary_op is None
        assert get_collection(GraphKeys.SUMMARY_OP) == []
        assert sv.ready_for_local_init_op is None
        assert sv.init_feed_dict is None
        assert sv.is_chief is True
        assert isinstance(sv.coord, Coordinator)
        assert isinstance(sv.session_manager, SessionManager)
        assert sv.save_path == os.path.join(logdir, "model.ckpt")
        assert sv.save_summaries_secs == 120
        assert sv.save_model_secs == 600
        assert isinstance(sv.summary_writer, SummaryWriter)
        assert sv.summary_writer.get_logdir() == logdir
        assert os.path.isdir(logdir)  # the writer creates the directory
        sess = Session(sv.state)
        assert sv.ready_op(sess) == []  # report_uninitialized_variables: all materialized
    finally:
        sv.summary_writer.close()


def test_use_default_takes_the_first_item_of_each_collection_and_logs_several(caplog):
    graph = Graph()
    items = {}
    for key in (
        GraphKeys.READY_OP,
        GraphKeys.READY_FOR_LOCAL_INIT_OP,
        GraphKeys.INIT_OP,
        GraphKeys.LOCAL_INIT_OP,
        GraphKeys.SUMMARY_OP,
    ):
        items[key] = [lambda: [], lambda: []]
    items[GraphKeys.SAVERS] = [Saver(), Saver()]
    items[GraphKeys.GLOBAL_STEP] = [GlobalStep(), GlobalStep()]
    for key, values in items.items():
        for value in values:
            graph.add_to_collection(key, value)
    caplog.set_level(logging.INFO, logger="torchsupervisor")
    sv = Supervisor(graph=graph, state={"w": torch.zeros(2)})
    assert sv.ready_op is items[GraphKeys.READY_OP][0]
    assert sv.ready_for_local_init_op is items[GraphKeys.READY_FOR_LOCAL_INIT_OP][0]
    assert sv.init_op is items[GraphKeys.INIT_OP][0]
    assert sv.local_init_op is items[GraphKeys.LOCAL_INIT_OP][0]
    assert sv.summary_op is items[GraphKeys.SUMMARY_OP][0]
    assert sv.saver is items[GraphKeys.SAVERS][0]
    assert sv.global_step is items[GraphKeys.GLOBAL_STEP][0]
    # The global step found in the collection joins the state, so it is checkpointed.
    assert sv.state["global_step"] is items[GraphKeys.GLOBAL_STEP][0]
    for key, values in items.items():
        assert graph.get_collection(key) == values  # nothing added
        assert f"Found 2 {key} operations. Returning the first one." in caplog.messages
    # The default graph was not used.
    assert get_collection(GraphKeys.READY_OP) == []


def test_explicit_arguments_are_used_as_given_and_not_registered():
    def ready():
        return []

    def init(sess):
        pass

    def local_init():
        pass

    def summary_op():
        return Summary()

    saver = Saver()
    step = GlobalStep()
    sv = Supervisor(
        ready_op=ready,
        ready_for_local_init_op=ready,
        init_op=init,
        init_feed_dict={"x": 1},
        local_init_op=local_init,
        summary_op=summary_op,
        saver=saver,
        global_step=step,
        state={"w": torch.zeros(1)},
    )
    assert (sv.ready_op, sv.ready_for_local_init_op, sv.init_op) == (ready, ready, init)
    assert (sv.local_init_op, sv.summary_op, sv.saver) == (local_init, summary_op, saver)
    assert sv.global_step is step
    assert sv.init_feed_dict == {"x": 1}
    assert sv.state["global_step"] is step
    for key in (GraphKeys.READY_OP, GraphKeys.INIT_OP, GraphKeys.SAVERS, GraphKeys.GLOBAL_STEP):
        assert get_collection(key) == []


def test_none_disables_ready_init_local_init_summary_saver_and_global_step():
    sv = Supervisor(
        ready_op=None,
        init_op=None,
        local_init_op=None,
        summary_op=None,
        saver=None,
        global_step=None,
        state={"global_step": GlobalStep(3)},
    )
    assert sv.ready_op is None and sv.init_op is None and sv.local_init_op is None
    assert sv.summary_op is None and sv.saver is None and sv.global_step is None


def test_default_summary_op_is_merge_all_of_the_summaries():
    w = torch.tensor([1.5])
    summary.scalar("weight", lambda: float(w))
    summary.scalar("twice", lambda: 2 * float(w))
    sv = Supervisor(state={"w": w})
    assert sv.summary_op is not None
    assert get_collection(GraphKeys.SUMMARY_OP) == [sv.summary_op]
    result = sv.summary_op()
    assert [(v.tag, v.simple_value) for v in result.value] == [("weight", 1.5), ("twice", 3.0)]


def test_global_step_found_by_name_in_the_state():
    step = torch.tensor(7)
    sv = Supervisor(state={"w": torch.zeros(1), "global_step": step})
    assert sv.global_step is step
    assert get_collection(GraphKeys.GLOBAL_STEP) == [step]


def test_global_step_that_is_not_an_integer_is_ignored_with_a_warning(caplog):
    step = torch.tensor(0.0)
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        sv = Supervisor(state={"w": torch.zeros(1), "global_step": step})
    assert sv.global_step is None
    assert get_collection(GraphKeys.GLOBAL_STEP) == []
    assert any(m.startswith("Found 'global_step' is not an int type: ") for m in caplog.messages), (
        caplog.messages
    )


def test_global_step_conflicting_with_the_state_entry_is_an_error():
    with pytest.raises(ValueError, match=r"state\['global_step'\] is not the Supervisor's"):
        Supervisor(state={"global_step": GlobalStep()}, global_step=GlobalStep())


def test_saver_is_none_when_the_state_is_empty():
    sv = Supervisor(state={})
    assert sv.saver is None
    assert get_collection(GraphKeys.SAVERS) == []


def test_a_global_step_alone_is_state_worth_a_saver():
    step = create_global_step()
    sv = Supervisor(state={})
    assert sv.state == {"global_step": step}
    assert isinstance(sv.saver, Saver)


def test_session_manager_passed_in_is_used_with_the_supervisors_init_fn(tmp_path):
    state = {"w": torch.zeros(2), "global_step": GlobalStep()}
    calls = []
    sm = SessionManager(ready_op=lambda: [], state=state)
    sv = Supervisor(
        logdir=str(tmp_path),
        state=state,
        session_manager=sm,
        init_fn=calls.append,
        save_summaries_secs=0,
        save_model_secs=0,
    )
    assert sv.session_manager is sm
    with sv.managed_session() as sess:
        assert calls == [sess]
        assert sess.state is state


def test_camel_case_aliases_are_the_same_functions():
    pairs = {
        "PrepareSession": "prepare_or_wait_for_session",
        "StartQueueRunners": "start_queue_runners",
        "StartStandardServices": "start_standard_services",
        "Stop": "stop",
        "RequestStop": "request_stop",
        "Loop": "loop",
        "ShouldStop": "should_stop",
        "StopOnException": "stop_on_exception",
        "WaitForStop": "wait_for_stop",
        "SummaryComputed": "summary_computed",
    }
    for alias, name in pairs.items():
        assert getattr(Supervisor, alias) is getattr(Supervisor, name), alias


# ---------------------------------------------------------------------- logdir and chiefs


@pytest.mark.parametrize("logdir", [None, ""])
def test_chief_without_logdir_has_no_save_path_writer_or_services(
    tmp_path, monkeypatch, caplog, logdir
):
    monkeypatch.chdir(tmp_path)
    c = Counter()
    sv = Supervisor(logdir=logdir, state=c.state)
    assert sv.save_path is None
    assert sv.summary_writer is None
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"), sv.managed_session() as sess:
        # The session starts without services (TF's warning); asked for them, it refuses, as
        # the seed documents.
        assert "Standard services need a 'logdir' passed to the SessionManager" in caplog.messages
        with pytest.raises(ValueError, match=r"^Standard services need a 'logdir'"):
            sv.start_standard_services(sess)
        assert _sv_threads() == []
        with pytest.raises(RuntimeError, match=r"^Writing a summary requires a summary writer\.$"):
            sv.summary_computed(sess, Summary())
        sess.run(c.step)
        with pytest.raises(RuntimeError, match="needs a running checkpoint service"):
            sv.checkpoint()
    assert os.listdir(tmp_path) == []  # nothing written anywhere


def test_explicit_writer_without_logdir_gets_summaries_but_no_services(tmp_path):
    writer = SummaryWriter(str(tmp_path / "events"))
    c = Counter()
    sv = Supervisor(summary_writer=writer, state=c.state)
    assert sv.summary_writer is writer and sv.save_path is None
    with sv.managed_session() as sess:
        with pytest.raises(ValueError, match="need a 'logdir'"):
            sv.start_standard_services(sess)
        sess.run(c.step)
        sv.summary_computed(sess, Summary(value=[Summary.Value(tag="x", simple_value=2.0)]))
    # No START (no standard services), the summary at the current step, then STOP: stop()
    # closes any writer, as TF does.
    (path,) = event_files(tmp_path / "events")
    events = read_events(path)
    assert [(e.step, v.tag) for e in events if e.HasField("summary") for v in e.summary.value] == [
        (1, "x")
    ]
    assert session_logs(events) == [(0, STOP, "")]


def test_logdir_with_no_summary_writer_still_checkpoints(tmp_path):
    c = Counter()
    sv = Supervisor(logdir=str(tmp_path), summary_writer=None, state=c.state, save_summaries_secs=1)
    assert sv.summary_writer is None
    with sv.managed_session() as sess:
        assert _sv_threads() == ["SVTimerCheckpointThread"]
        sess.run(c.step)
        with pytest.raises(RuntimeError, match="requires a summary writer"):
            sv.summary_computed(sess, Summary())
    assert event_files(tmp_path) == []
    assert os.path.exists(os.path.join(tmp_path, "model.ckpt-1.index"))
    assert os.path.exists(os.path.join(tmp_path, "checkpoint"))


def test_non_chief_has_no_logdir_writer_or_save_path_even_when_given(tmp_path):
    writer = SummaryWriter(str(tmp_path / "explicit"))
    try:
        sv = Supervisor(
            is_chief=False,
            logdir=str(tmp_path / "logs"),
            summary_writer=writer,
            state=Counter().state,
        )
        assert sv.is_chief is False
        assert sv.save_path is None
        # TF's None, as a writer that writes nothing: the chief's loop runs here too.
        assert isinstance(sv.summary_writer, NullSummaryWriter) and not sv.summary_writer
        assert sv.save_summaries_secs is None and sv.save_model_secs is None
        sess = Session(sv.state)
        with pytest.raises(RuntimeError) as info:
            sv.start_standard_services(sess)
        assert str(info.value) == NON_CHIEF_TEXT
        with pytest.raises(RuntimeError, match="requires a summary writer"):
            sv.summary_computed(sess, Summary())
        assert not os.path.exists(tmp_path / "logs")
    finally:
        writer.close()


class _ReadyAfter:
    """A ready op that reports ``w`` as not initialized for its first ``polls`` calls."""

    def __init__(self, polls: int) -> None:
        self.polls = polls
        self.calls = 0

    def __call__(self) -> list[str]:
        self.calls += 1
        return ["w"] if self.calls <= self.polls else []


def test_non_chief_managed_session_waits_for_readiness_and_starts_no_service(
    tmp_path, fake_clock, caplog
):
    ready = _ReadyAfter(polls=3)
    init_calls = []
    c = Counter()
    sv = Supervisor(
        is_chief=False,
        logdir=str(tmp_path / "logs"),
        state=c.state,
        ready_op=ready,
        init_op=init_calls.append,
        recovery_wait_secs=5,
        clock=fake_clock,
    )
    caplog.set_level(logging.INFO, logger="torchsupervisor")
    with sv.managed_session() as sess:
        assert ready.calls == 4
        assert fake_clock.sleeps == [5, 5, 5]
        assert _sv_threads() == []
        sess.run(c.step)
        with pytest.raises(RuntimeError, match="needs a running checkpoint service"):
            sv.checkpoint()
    assert init_calls == []  # only the chief initializes
    assert not os.path.exists(tmp_path / "logs")
    waiting = [m for m in caplog.messages if m.startswith("Waiting for model to be ready.")]
    assert len(waiting) == 3
    assert "ready: Variables not initialized: w" in waiting[0]


def test_non_chief_that_never_sees_a_ready_model_gives_up(fake_clock):
    sv = Supervisor(
        is_chief=False,
        state=Counter().state,
        ready_op=lambda: ["w"],
        recovery_wait_secs=600,
        clock=fake_clock,
    )
    body_ran = []
    expected = r"^Session was not ready after waiting 7200 secs\.$"
    with pytest.raises(DeadlineExceededError, match=expected), sv.managed_session():
        body_ran.append(True)
    assert body_ran == []
    assert sv.should_stop()


def test_a_second_run_in_the_same_process_uses_its_own_global_step(tmp_path):
    """The state's global step wins over one an earlier Supervisor left in the collection."""
    first = ts.GlobalStep(5)
    ts.Supervisor(logdir=str(tmp_path / "a"), state={"global_step": first})
    second = ts.GlobalStep(9)
    sv = ts.Supervisor(logdir=str(tmp_path / "b"), state={"global_step": second})
    assert sv.global_step is second
    assert ts.get_collection(ts.GraphKeys.GLOBAL_STEP) == [first, second]
    sv.summary_writer.close()
