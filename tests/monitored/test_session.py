"""Scaffold, session creators, MonitoredSession / SingularMonitoredSession /
MonitoredTrainingSession: lifecycle, errors, recovery, step functions, defaults, end of input."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch
from monitored_helpers import JOIN_SECS, Counter, RecordingHook, gated_storage
from supervisor_helpers import (
    CHECKPOINT,
    START,
    accumulator,
    all_events,
    checkpoint_steps,
    read_checkpoint,
    session_logs,
)

from torchsupervisor import GlobalStep, Saver, Session, SummaryWriterCache, summary
from torchsupervisor.checkpoint.run_id import RUN_ID_FILENAME
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.registry import GraphKeys, add_to_collection, get_collection
from torchsupervisor.errors import (
    AbortedError,
    DataLossError,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    UnavailableError,
)
from torchsupervisor.hooks import (
    CheckpointSaverHook,
    NanTensorHook,
    SessionRunHook,
    StepCounterHook,
    StopAtStepHook,
    SummarySaverHook,
)
from torchsupervisor.input.queue_runner import queue_from_iterable
from torchsupervisor.monitored.creators import (
    ChiefSessionCreator,
    SessionCreator,
    WorkerSessionCreator,
)
from torchsupervisor.monitored.scaffold import Scaffold
from torchsupervisor.monitored.session import MonitoredSession, SingularMonitoredSession
from torchsupervisor.monitored.training_session import MonitoredTrainingSession
from torchsupervisor.storage import temporary_name
from torchsupervisor.storage.lock import LOCK_FILENAME
from torchsupervisor.testing import hooks_of, raw_session_of, timer_of

# ------------------------------------------------------------------------------------ Scaffold


def test_finalize_fills_defaults_and_shares_them_through_the_collections():
    summary.scalar("x", 1.0)
    first = Scaffold().finalize()
    for field in ("init_op", "ready_op", "ready_for_local_init_op", "local_init_op", "saver"):
        assert getattr(first, field) is not None, field
    assert first.summary_op is not None
    assert isinstance(first.saver, Saver)
    second = Scaffold().finalize()
    for field in ("init_op", "ready_op", "local_init_op", "summary_op", "saver"):
        assert getattr(second, field) is getattr(first, field), field
    assert get_collection(GraphKeys.SAVERS) == [first.saver]
    assert first.finalize() is first  # Idempotent.


def test_without_summaries_the_summary_op_is_none():
    assert Scaffold().finalize().summary_op is None
    assert get_collection(GraphKeys.SUMMARY_OP) == []


def test_given_fields_and_collection_items_win():
    saver = Saver()
    add_to_collection(GraphKeys.INIT_OP, "collected init")
    scaffold = Scaffold(saver=saver).finalize()
    assert scaffold.saver is saver and scaffold.init_op == "collected init"
    add_to_collection(GraphKeys.READY_OP, "a")
    add_to_collection(GraphKeys.READY_OP, "b")
    with pytest.raises(
        RuntimeError,
        match=r'^More than one item in the collection "ready_op"\. .*Scaffold\(ready_op=item',
    ):
        Scaffold().finalize()


def test_copy_from_scaffold():
    def init_fn(scaffold, session):
        pass

    original = Scaffold(init_op="op", init_fn=init_fn, summary_op="s", state={"a": torch.zeros(1)})
    copy = Scaffold(copy_from_scaffold=original, summary_op="mine")
    assert copy.init_op == "op" and copy.summary_op == "mine"
    assert copy.state["a"] is original.state["a"]
    assert copy.init_fn is not None and copy.init_fn is not original.init_fn
    with pytest.raises(TypeError, match=r"^copy_from_scaffold is not a Scaffold instance\.$"):
        Scaffold(copy_from_scaffold="nope")


def test_state_and_the_global_step_collection():
    step = GlobalStep()
    scaffold = Scaffold(state={"global_step": step, "w": torch.zeros(1)})
    assert get_collection(GraphKeys.GLOBAL_STEP) == [step]
    other = Scaffold(state={"w": torch.zeros(1)})
    assert other.state["global_step"] is step  # Added so that it is checkpointed.
    assert scaffold.state is not None


# ------------------------------------------------------------------------------------ creators


def test_session_creator_is_abstract():
    with pytest.raises(NotImplementedError):
        SessionCreator().create_session()


def test_chief_initializes_then_restores(tmp_path):
    counter = Counter()
    calls = []
    scaffold = Scaffold(init_fn=lambda scaffold, sess: calls.append((scaffold, sess)))
    sess = ChiefSessionCreator(scaffold, checkpoint_dir=str(tmp_path), state=counter.state)
    session = sess.create_session()
    assert calls == [(scaffold, session)] and session.restored_checkpoint is None
    counter.step()
    scaffold.saver.save(session, str(tmp_path / "model.ckpt"), global_step=counter.global_step)
    restored = Counter()
    creator = ChiefSessionCreator(checkpoint_dir=str(tmp_path), state=restored.state)
    session = creator.create_session()
    assert session.restored_checkpoint == str(tmp_path / "model.ckpt-1")
    assert restored.global_step.value == 1 and float(restored.w) == 1.0
    assert len(calls) == 1


def test_the_chief_removes_what_a_crash_left(tmp_path):
    stale = temporary_name(str(tmp_path / "model.ckpt-5.index"))
    open(stale, "w").close()
    orphan = tmp_path / "model.ckpt-7.data-00000-of-00001"
    orphan.write_bytes(b"partial")
    creator = ChiefSessionCreator(checkpoint_dir=str(tmp_path), state=Counter().state)
    creator.create_session()
    # The chief's writer lock, and the run's id.
    assert sorted(os.listdir(tmp_path)) == sorted([LOCK_FILENAME, RUN_ID_FILENAME])
    creator.close()


def test_the_chief_reports_a_directory_without_a_valid_checkpoint(tmp_path):
    counter = Counter()
    creator = ChiefSessionCreator(checkpoint_dir=str(tmp_path), state=counter.state)
    session = creator.create_session()
    counter.step()
    prefix = creator.scaffold.saver.save(session, str(tmp_path / "model.ckpt"), global_step=1)
    index = prefix + ".index"
    with open(index, "r+b") as f:
        f.write(b"garbage")  # The only checkpoint is damaged.
    with pytest.raises(DataLossError, match="No valid checkpoint in"):
        ChiefSessionCreator(checkpoint_dir=str(tmp_path), state=Counter().state).create_session()


def test_the_chief_reports_a_state_that_init_does_not_make_ready():
    model = torch.nn.Linear(2, 2, device="meta")
    creator = ChiefSessionCreator(Scaffold(init_op=lambda: None), state={"model": model})
    with pytest.raises(
        RuntimeError, match=r"^Init operations did not make model ready for local_init\.  "
    ):
        creator.create_session()


def test_state_given_twice_must_be_the_same():
    state = Counter().state
    scaffold = Scaffold(state=state)
    assert ChiefSessionCreator(scaffold, state=state).state["w"] is state["w"]
    with pytest.raises(ValueError, match="the scaffold already has a different state"):
        ChiefSessionCreator(scaffold, state=Counter().state)


def test_worker_waits_for_a_ready_state(fake_clock):
    ready = WorkerSessionCreator(state=Counter().state, clock=fake_clock).create_session()
    assert isinstance(ready, Session)
    model = torch.nn.Linear(2, 2, device="meta")  # Never initialized by a chief.
    worker = WorkerSessionCreator(state={"model": model}, max_wait_secs=60, clock=fake_clock)
    with pytest.raises(
        DeadlineExceededError, match=r"^Session was not ready after waiting 60 secs\.$"
    ):
        worker.create_session()


# ----------------------------------------------------------------------------- MonitoredSession


def monitored(counter, hooks=(), **kwargs):
    return MonitoredSession(ChiefSessionCreator(state=counter.state, **kwargs), hooks=list(hooks))


def test_close_twice_and_use_after_close():
    counter = Counter()
    sess = monitored(counter)
    assert sess.graph is not None
    sess.close()
    assert sess.graph is None and sess.should_stop()
    with pytest.raises(RuntimeError, match=r"^Session is already closed\.$"):
        sess.close()
    with pytest.raises(RuntimeError, match=r"^Attempted to use a closed Session\.$"):
        sess.run(counter.step)


@pytest.mark.parametrize("error", [OutOfRangeError("end of input"), StopIteration()])
def test_end_of_input_is_a_clean_exit(error):
    counter = Counter()
    hook = RecordingHook()

    def step():
        raise error

    with monitored(counter, [hook]) as sess:
        sess.run(step)
    assert hook.names()[-1] == "end"


def test_other_errors_skip_end_and_propagate():
    counter = Counter()
    hook = RecordingHook()
    with pytest.raises(ValueError, match="training failed"), monitored(counter, [hook]) as sess:
        sess.run(counter.step)
        raise ValueError("training failed")
    assert "end" not in hook.names()
    assert sess.should_stop()


class CoordHook(SessionRunHook):
    def after_create_session(self, session, coord):
        self.coord = coord


def report_from_thread(coord, error):
    def target():
        try:
            raise error
        except type(error) as e:
            coord.request_stop(e)

    thread = threading.Thread(target=target)
    coord.register_thread(thread)
    thread.start()
    thread.join(10.0)


def test_a_thread_error_replaces_the_body_error_at_close():
    counter = Counter()
    hook = CoordHook()
    with pytest.raises(KeyError, match="input thread failed"), monitored(counter, [hook]) as sess:
        report_from_thread(hook.coord, KeyError("input thread failed"))
        sess.run(counter.step)  # A stopped coordinator does not block runs.
        assert sess.should_stop()
        raise ValueError("body")
    assert counter.calls == 1


def test_request_stop_is_a_clean_stop_with_end():
    counter = Counter()
    hook = RecordingHook()
    with monitored(counter, [hook]) as sess:
        sess.run(counter.step)
        threading.Thread(target=sess.request_stop).start()
        while not sess.should_stop():
            pass
        sess.run(counter.step)  # Still usable.
    assert hook.names()[-1] == "end"


@pytest.mark.parametrize("error_type", [AbortedError, UnavailableError])
def test_recovery_restores_the_newest_checkpoint_and_retries_the_run(tmp_path, error_type):
    counter = Counter()
    hook = RecordingHook()
    scaffold = Scaffold()
    saver_hook = CheckpointSaverHook(str(tmp_path), save_steps=2, scaffold=scaffold)
    fail = {"at_call": 4}

    def step():
        out = counter.step()
        if counter.calls == fail["at_call"]:
            counter.w.add_(100.0)  # A half-done step, thrown away by the recovery.
            raise error_type("worker preempted")
        return out

    sess = MonitoredSession(
        ChiefSessionCreator(scaffold, checkpoint_dir=str(tmp_path), state=counter.state),
        hooks=[saver_hook, hook],
    )
    with sess:
        for _ in range(3):
            sess.run(step)
            scaffold.saver.wait()
        assert counter.global_step.value == 3
        result = sess.run(step)  # Fails, recovers from model.ckpt-2, and runs again.
        assert counter.global_step.value == 3 and float(result["loss"]) == 3.0
    assert counter.calls == 5
    assert hook.names().count("begin") == 1
    assert hook.names().count("after_create_session") == 2
    assert hook.sessions[0] is not hook.sessions[1]
    assert hook.sessions[1].restored_checkpoint == str(tmp_path / "model.ckpt-2")


def test_recovery_reruns_the_whole_step_fn(tmp_path):
    counter = Counter()
    attempts = []

    def step_fn(step_context):
        attempts.append(step_context.session)
        step_context.session.run(counter.step)
        if len(attempts) == 1:
            raise AbortedError("aborted")
        return "done"

    with monitored(counter, checkpoint_dir=str(tmp_path)) as sess:
        assert sess.run_step_fn(step_fn) == "done"
    assert len(attempts) == 2 and attempts[0] is not attempts[1]


def test_a_preemption_error_from_a_thread_recreates_the_session():
    counter = Counter()
    hook = CoordHook()
    with monitored(counter, [hook]) as sess:
        first = hook.coord
        report_from_thread(first, AbortedError("ps restarted"))
        assert not sess.should_stop()  # Recovered: a new session and coordinator.
        assert hook.coord is not first and not hook.coord.should_stop()
        sess.run(counter.step)


def test_a_thread_preemption_error_explains_a_failed_run_and_it_is_retried():
    counter = Counter()
    hook = CoordHook()
    failures = []

    def step():
        if not failures:
            failures.append(1)
            raise ValueError("lost connection")  # Caused by the preemption the thread saw.
        return counter.step()

    with monitored(counter, [hook]) as sess:
        first = hook.coord
        report_from_thread(first, UnavailableError("ps unavailable"))
        out = sess.run(step)  # Raised as UnavailableError, recovered, and run again.
        assert float(out["loss"]) == 1.0
        assert hook.coord is not first


def test_singular_session_exposes_the_raw_session_and_does_not_recover():
    counter = Counter()
    with SingularMonitoredSession(state=counter.state) as sess:
        raw = sess.raw_session()
        assert isinstance(raw, Session) and raw.state["w"] is counter.w

        def aborted():
            raise AbortedError("aborted")

        with pytest.raises(AbortedError):
            sess.run(aborted)
    assert sess.raw_session() is None


def test_run_step_fn_raw_and_hooked_runs_and_request_stop():
    counter = Counter()
    hook = RecordingHook()
    with monitored(counter, [hook]) as sess:

        def step_fn(step_context):
            assert isinstance(step_context, MonitoredSession.StepContext)
            step_context.session.run(counter.step)  # No hooks.
            return step_context.run_with_hooks(counter.step)

        out = sess.run_step_fn(step_fn)
        assert float(out["loss"]) == 2.0
        assert hook.names().count("before_run") == 1

        class Trainer:
            def step(self, step_context):
                step_context.request_stop()

        with pytest.raises(
            StopIteration, match=r"^step_fn has requested the iterations to stop\.$"
        ):
            sess.run_step_fn(Trainer().step)
        assert not sess.should_stop()
        sess.run_step_fn(Trainer().step)  # Leaves the with block cleanly.
    assert hook.names()[-1] == "end"


def test_run_step_fn_checks_the_signature():
    counter = Counter()
    with monitored(counter) as sess:
        for bad in (lambda: None, lambda a, b: None):
            with pytest.raises(ValueError, match=r"^`step_fn` may either have one `step_context`"):
                sess.run_step_fn(bad)


# -------------------------------------------------------------------- MonitoredTrainingSession


def hook_types(sess):
    return [type(h) for h in hooks_of(sess)]


def test_default_hooks_and_their_order(tmp_path):
    counter = Counter()
    first, last = RecordingHook(), RecordingHook()
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path), state=counter.state, chief_only_hooks=[first], hooks=[last]
    ) as sess:
        assert hook_types(sess) == [
            RecordingHook,
            StepCounterHook,
            SummarySaverHook,
            CheckpointSaverHook,
            RecordingHook,
        ]
        assert hooks_of(sess)[0] is first and hooks_of(sess)[-1] is last
        assert timer_of(hooks_of(sess)[3]).every_secs == 600
        assert timer_of(hooks_of(sess)[2]).every_steps == 100
        assert timer_of(hooks_of(sess)[1]).every_steps == 100


def test_disabling_the_default_hooks(tmp_path):
    counter = Counter()
    cases = [
        (
            dict(checkpoint_dir=str(tmp_path), save_checkpoint_secs=0),
            [StepCounterHook, SummarySaverHook],
        ),
        (
            dict(checkpoint_dir=str(tmp_path), save_checkpoint_secs=None),
            [StepCounterHook, SummarySaverHook],
        ),
        (
            dict(checkpoint_dir=str(tmp_path), save_summaries_steps=0, log_step_count_steps=0),
            [CheckpointSaverHook],
        ),
        (dict(summary_dir=str(tmp_path)), [StepCounterHook, SummarySaverHook]),
        (dict(), []),
        (
            dict(is_chief=False, checkpoint_dir=str(tmp_path), chief_only_hooks=[RecordingHook()]),
            [],
        ),
    ]
    for kwargs, expected in cases:
        with MonitoredTrainingSession(state=counter.state, **kwargs) as sess:
            assert hook_types(sess) == expected, kwargs


def test_only_one_interval_given_disables_the_other(tmp_path):
    counter = Counter()
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path),
        state=counter.state,
        save_checkpoint_steps=5,
        save_summaries_secs=30,
    ) as sess:
        summary_hook, checkpoint_hook = hooks_of(sess)[1], hooks_of(sess)[2]
        assert (
            timer_of(checkpoint_hook).every_steps == 5
            and timer_of(checkpoint_hook).every_secs is None
        )
        assert (
            timer_of(summary_hook).every_secs == 30 and timer_of(summary_hook).every_steps is None
        )


def test_training_writes_checkpoints_and_summaries_then_resumes(tmp_path):
    counter = Counter()
    summary.scalar("w", counter.w)
    scaffold = Scaffold()
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path),
        scaffold=scaffold,
        state=counter.state,
        hooks=[StopAtStepHook(last_step=30), NanTensorHook("loss")],
        save_checkpoint_steps=10,
        save_summaries_steps=8,
        log_step_count_steps=10,
    ) as sess:
        while not sess.should_stop():
            sess.run(counter.step)
            scaffold.saver.wait()
    assert checkpoint_steps(tmp_path) == [0, 10, 20, 30]
    assert float(read_checkpoint(tmp_path / "model.ckpt-30")["w"]) == 30.0
    SummaryWriterCache.clear()
    acc = accumulator(tmp_path)
    assert [e.step for e in acc.Scalars("w")] == [1, 9, 17, 25]
    assert [e.step for e in acc.Scalars("global_step/sec")] == [11, 21]
    resumed = Counter()
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path),
        state=resumed.state,
        hooks=[StopAtStepHook(num_steps=5)],
        save_checkpoint_steps=10,
    ) as sess:
        assert resumed.global_step.value == 30
        while not sess.should_stop():
            sess.run(resumed.step)
    assert checkpoint_steps(tmp_path)[-1] == 35
    SummaryWriterCache.clear()
    logs = session_logs(all_events(tmp_path))
    assert (31, START, "") in logs  # The resumed run's first summary step.
    assert [s for s, status, _ in logs if status == CHECKPOINT] == [0, 10, 20, 30, 35]


def test_end_of_input_ends_training_with_a_final_checkpoint(tmp_path):
    counter = Counter()
    batches = queue_from_iterable([torch.tensor(float(i)) for i in range(13)], capacity=4)
    seen = []
    hook = RecordingHook()

    def step():
        seen.append(float(batches.dequeue()))
        return counter.step()

    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path), state=counter.state, hooks=[hook], save_checkpoint_steps=5
    ) as sess:
        while not sess.should_stop():
            sess.run(step)
    assert seen == [float(i) for i in range(13)]
    assert hook.names()[-1] == "end"
    assert checkpoint_steps(tmp_path)[-1] == 13


def test_an_input_thread_error_leaves_the_with_block(tmp_path):
    def records():
        yield torch.tensor(1.0)
        raise KeyError("corrupt record")

    batches = queue_from_iterable(records())
    counter = Counter()
    hook = RecordingHook()
    with (
        pytest.raises(KeyError, match="corrupt record"),
        MonitoredTrainingSession(state=counter.state, hooks=[hook]) as sess,
    ):
        while not sess.should_stop():
            sess.run(lambda: batches.dequeue(timeout_secs=10.0))
    assert "end" in hook.names()  # The loop ended by should_stop(): a normal exit.


# ------------------------------------------------------------------- recovery: details and state


class _OpensTheGateWhenWaitedOn(Clock):
    """The real clock, but once ``armed``, a wait for a save in flight opens ``gate``: the
    save can only finish once someone waits for it, so a recovery that did not wait would
    restore model.ckpt-0 (deterministic: no sleep decides the order)."""

    def __init__(self, gate) -> None:
        self.gate = gate
        self.armed = False

    def wait(self, event, timeout_secs):
        if self.armed and not event.is_set():
            self.gate.open()
        return super().wait(event, timeout_secs)


def test_recovery_waits_for_the_checkpoint_being_written(tmp_path):
    counter = Counter()
    # The save at step 3 stays in flight until the gate opens.
    storage, gate = gated_storage("open", path_contains="model.ckpt-3.")
    scaffold = Scaffold(saver=Saver(storage=storage, max_to_keep=None))
    clock = _OpensTheGateWhenWaitedOn(gate)
    hooks = [CheckpointSaverHook(str(tmp_path), save_steps=3, scaffold=scaffold, clock=clock)]

    def step():
        out = counter.step()
        if counter.calls == 5:
            assert gate.reached.wait(JOIN_SECS)  # The save at step 3 is being written...
            assert not gate.opened.is_set()  # ... and cannot finish yet.
            clock.armed = True
            raise AbortedError("worker preempted")
        return out

    sess = MonitoredSession(
        ChiefSessionCreator(scaffold, checkpoint_dir=str(tmp_path), state=counter.state),
        hooks=hooks,
    )
    try:
        with sess:
            for _ in range(4):
                sess.run(step)
            sess.run(step)  # Fails; the new session restores model.ckpt-3 and runs it again.
            assert raw_session_of(sess).restored_checkpoint == str(tmp_path / "model.ckpt-3")
            assert counter.global_step.value == 4
    finally:
        gate.open()
    assert checkpoint_steps(tmp_path) == [0, 3, 4]
    assert float(read_checkpoint(tmp_path / "model.ckpt-4")["w"]) == 4.0


def test_recovery_without_a_checkpoint_keeps_the_state_in_memory():
    counter = Counter()
    init_calls = []
    scaffold = Scaffold(init_fn=lambda scaffold, sess: init_calls.append(sess))

    def step():
        out = counter.step()
        if counter.calls == 3:
            counter.w.add_(100.0)  # What a failed run changed before it raised...
            raise AbortedError("worker preempted")
        return out

    hook = RecordingHook()
    with MonitoredSession(
        ChiefSessionCreator(scaffold, state=counter.state), hooks=[hook]
    ) as sess:  # No checkpoint_dir: nothing to restore.
        for _ in range(3):
            sess.run(step)
        assert hook.names().count("after_create_session") == 2
        assert hook.sessions[1].restored_checkpoint is None
        # ... is kept, and the retried run continued from there; init ran only once.
        assert counter.global_step.value == 4 and float(counter.w) == 104.0
        assert len(init_calls) == 1


def test_training_recovery_always_has_a_checkpoint_to_restore(tmp_path):
    counter = Counter()

    def step():
        out = counter.step()
        if counter.calls == 2:
            counter.w.add_(100.0)
            raise UnavailableError("parameter server unavailable")
        return out

    with MonitoredTrainingSession(checkpoint_dir=str(tmp_path), state=counter.state) as sess:
        sess.run(step)
        sess.run(step)  # No save since step 0 (600 s): the recovery restores model.ckpt-0.
        assert raw_session_of(sess).restored_checkpoint == str(tmp_path / "model.ckpt-0")
        assert counter.global_step.value == 1 and float(counter.w) == 1.0


def test_a_failed_step_fn_is_recovered_when_a_thread_reported_a_preemption_error():
    counter = Counter()
    hook = CoordHook()
    attempts = []

    def step_fn(step_context):
        attempts.append(hook.coord)
        if len(attempts) == 1:
            report_from_thread(hook.coord, UnavailableError("ps unavailable"))
            raise ValueError("lost connection")  # Caused by the preemption the thread saw.
        return step_context.run_with_hooks(counter.step)

    with monitored(counter, [hook]) as sess:
        out = sess.run_step_fn(step_fn)  # Raised as UnavailableError, recovered, run again.
        assert float(out["loss"]) == 1.0
        assert len(attempts) == 2 and attempts[0] is not attempts[1]


def test_a_singular_session_raises_the_thread_preemption_error_of_a_failed_step_fn():
    counter = Counter()
    hook = CoordHook()

    def step_fn(step_context):
        report_from_thread(hook.coord, AbortedError("ps restarted"))
        raise ValueError("lost connection")

    sess = SingularMonitoredSession(hooks=[hook], state=counter.state)
    with pytest.raises(AbortedError, match="ps restarted") as raised:
        sess.run_step_fn(step_fn)
    assert isinstance(raised.value.__context__, ValueError)
    with pytest.raises(AbortedError, match="ps restarted"):
        sess.close()  # The coordinator's recorded error, as for any run.


def test_stop_at_step_keeps_its_last_step_across_a_recovery(tmp_path):
    counter = Counter()
    scaffold = Scaffold()
    stop = StopAtStepHook(num_steps=5)
    recorder = RecordingHook()

    def step():
        out = counter.step()
        if counter.calls == 4:
            raise AbortedError("worker preempted")  # At step 4; model.ckpt-2 is restored.
        return out

    hooks = [CheckpointSaverHook(str(tmp_path), save_steps=2, scaffold=scaffold), stop, recorder]
    with MonitoredSession(
        ChiefSessionCreator(scaffold, checkpoint_dir=str(tmp_path), state=counter.state),
        hooks=hooks,
    ) as sess:
        while not sess.should_stop():
            sess.run(step)
            scaffold.saver.wait()
        assert recorder.sessions[1].restored_checkpoint == str(tmp_path / "model.ckpt-2")
    assert recorder.names().count("after_create_session") == 2
    # Not 2 + 5 = 7: num_steps counts from the first session only.
    assert stop.last_step == 5 and counter.global_step.value == 5


def test_training_session_passes_max_wait_secs_to_a_non_chief(fake_clock):
    model = torch.nn.Linear(2, 2, device="meta")  # No chief ever initializes it.
    with pytest.raises(
        DeadlineExceededError, match=r"^Session was not ready after waiting 45 secs\.$"
    ):
        MonitoredTrainingSession(
            is_chief=False,
            state={"model": model, "global_step": GlobalStep()},
            max_wait_secs=45,
            clock=fake_clock,
        )


def test_training_session_passes_stop_grace_period_secs(caplog):
    counter = Counter()
    hook = CoordHook()
    release = threading.Event()
    stubborn = threading.Thread(target=release.wait, args=(JOIN_SECS,), name="stubborn-input")
    try:
        with caplog.at_level(logging.INFO, logger="torchsupervisor"):
            sess = MonitoredTrainingSession(
                state=counter.state, hooks=[hook], stop_grace_period_secs=0.2
            )
            hook.coord.register_thread(stubborn)
            stubborn.start()
            start = time.monotonic()
            sess.close()  # Gives the thread 0.2 s (not the default 120 s), then goes on.
            elapsed = time.monotonic() - start
    finally:
        release.set()
        stubborn.join(JOIN_SECS)
    assert elapsed < 60
    assert "stubborn-input" in caplog.text


def test_training_session_errors_at_creation(tmp_path):
    with pytest.raises(
        RuntimeError, match=r"^Global step should be created to use StepCounterHook\.$"
    ):
        MonitoredTrainingSession(checkpoint_dir=str(tmp_path / "a"), state={"w": torch.zeros(1)})
    counter = Counter()
    with MonitoredTrainingSession(checkpoint_dir=str(tmp_path), state=counter.state) as sess:
        sess.run(counter.step)
    with pytest.raises(NotFoundError, match="extra"):
        MonitoredTrainingSession(
            checkpoint_dir=str(tmp_path), state={**Counter().state, "extra": torch.zeros(1)}
        )
    with pytest.raises(InvalidArgumentError):
        MonitoredTrainingSession(
            checkpoint_dir=str(tmp_path),
            state={"w": torch.zeros(3), "global_step": GlobalStep()},
        )
    for name in os.listdir(tmp_path):
        if name.endswith(".index"):
            with open(tmp_path / name, "r+b") as f:
                f.write(b"garbage")  # Every checkpoint is damaged.
    with pytest.raises(DataLossError, match="No valid checkpoint in"):
        MonitoredTrainingSession(checkpoint_dir=str(tmp_path), state=Counter().state)
