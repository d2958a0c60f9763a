"""CheckpointSaverHook: schedules, background saves, CHECKPOINT events, listeners, failures."""

from __future__ import annotations

import logging
import os
import threading

import pytest
from monitored_helpers import (
    JOIN_SECS,
    Counter,
    RecordingListener,
    fill_disk,
    gated_storage,
    slow_storage,
)
from supervisor_helpers import (
    CHECKPOINT,
    all_events,
    checkpoint_steps,
    event_files,
    read_checkpoint,
    read_events,
    scalars,
    session_logs,
    temporary_files,
)
from tensorboard.compat.proto.event_pb2 import LogMessage

from torchsupervisor import (
    GlobalStep,
    Saver,
    Session,
    StopAtStepHook,
    SummaryWriter,
    SummaryWriterCache,
    summary,
)
from torchsupervisor.core.registry import GraphKeys, add_to_collection
from torchsupervisor.errors import CheckpointSaveError
from torchsupervisor.hooks import CheckpointSaverHook
from torchsupervisor.monitored.creators import ChiefSessionCreator
from torchsupervisor.monitored.scaffold import Scaffold
from torchsupervisor.monitored.session import MonitoredSession
from torchsupervisor.monitored.training_session import MonitoredTrainingSession
from torchsupervisor.monitored.wrappers import HookedSession
from torchsupervisor.testing import FaultyStorage


def monitored(counter, hook, preemption_signals=(), **creator_kwargs):
    return MonitoredSession(
        ChiefSessionCreator(state=counter.state, **creator_kwargs),
        hooks=[hook],
        preemption_signals=preemption_signals,
    )


def run_steps(sess, counter, saver, n):
    """Run ``n`` steps, letting each background save commit before the next step."""
    for _ in range(n):
        sess.run(counter.step)
        saver.wait()


def checkpoint_events(logdir):
    SummaryWriterCache.clear()  # Writes what is queued.
    return [
        (step, path)
        for step, status, path in session_logs(all_events(logdir))
        if status == CHECKPOINT
    ]


def test_argument_errors(tmp_path):
    with pytest.raises(ValueError, match=r"^You cannot provide both saver and scaffold\.$"):
        CheckpointSaverHook(str(tmp_path), save_steps=1, saver=Saver(), scaffold=Scaffold())
    with pytest.raises(ValueError, match="Either every_secs or every_steps"):
        CheckpointSaverHook(str(tmp_path))


def test_begin_needs_a_global_step(tmp_path):
    hook = CheckpointSaverHook(str(tmp_path), save_steps=1)
    with pytest.raises(
        RuntimeError, match=r"^Global step should be created to use CheckpointSaverHook\.$"
    ):
        hook.begin()


def test_saver_from_the_collection(tmp_path):
    counter = Counter()
    add_to_collection(GraphKeys.GLOBAL_STEP, counter.global_step)
    hook = CheckpointSaverHook(str(tmp_path), save_steps=1)
    hook.begin()
    with pytest.raises(RuntimeError, match=r"^No items in collection savers\. Please add"):
        hook.after_create_session(Session(counter.state), None)
    add_to_collection(GraphKeys.SAVERS, Saver())
    add_to_collection(GraphKeys.SAVERS, Saver())
    with pytest.raises(RuntimeError, match=r"^More than one item in collection savers\."):
        hook.after_create_session(Session(counter.state), None)


def test_the_scaffold_saver_joins_the_collection(tmp_path):
    counter = Counter()
    with monitored(counter, CheckpointSaverHook(str(tmp_path), save_steps=1)):
        pass
    assert checkpoint_steps(tmp_path) == [0]


def test_steps_schedule_with_session_creation(tmp_path):
    counter = Counter()
    saver = Saver(max_to_keep=None)
    listener = RecordingListener()
    hook = CheckpointSaverHook(str(tmp_path), save_steps=2, saver=saver, listeners=[listener])
    with monitored(counter, hook) as sess:
        saver.wait()
        run_steps(sess, counter, saver, 5)
    assert listener.steps("before_save") == [0, 2, 4, 5]  # 5: the final one, in end().
    assert checkpoint_steps(tmp_path) == [0, 2, 4, 5]
    assert listener.calls[0] == ("begin", None)
    assert listener.calls[-1] == ("end", 5)
    assert checkpoint_events(tmp_path) == [(s, str(tmp_path / "model.ckpt")) for s in (0, 2, 4, 5)]
    assert temporary_files(tmp_path) == []


def test_snapshots_are_taken_between_steps(tmp_path):
    counter = Counter()
    saver = Saver(max_to_keep=None)
    with monitored(counter, CheckpointSaverHook(str(tmp_path), save_steps=3, saver=saver)) as sess:
        run_steps(sess, counter, saver, 7)
    for step in checkpoint_steps(tmp_path):
        tree = read_checkpoint(tmp_path / f"model.ckpt-{step}")
        assert float(tree["w"]) == step  # w and the step move together in every step.


def test_a_loop_that_waits_for_each_save_does_not_hold_back_its_summaries(tmp_path, caplog):
    # A checkpoint's save waits for the summaries' flush, left for the next step boundary.
    # A loop that waits for the save itself (saver.wait()) never reaches that boundary
    # first: the wait asks for the flush now. Before, each save waited 10 s and warned.
    counter = Counter()
    summary.scalar("w", counter.w)
    scaffold = Scaffold()
    with (
        caplog.at_level(logging.WARNING, logger="torchsupervisor"),
        MonitoredTrainingSession(
            checkpoint_dir=str(tmp_path),
            scaffold=scaffold,
            state=counter.state,
            hooks=[StopAtStepHook(last_step=4)],
            save_checkpoint_steps=2,
            save_summaries_steps=1,
            log_step_count_steps=None,
        ) as sess,
    ):
        while not sess.should_stop():
            sess.run(counter.step)
            scaffold.saver.wait()
    assert checkpoint_steps(tmp_path) == [0, 2, 4]
    assert "were not flushed within" not in caplog.text


def test_steps_schedule_in_a_bare_hooked_session(tmp_path):
    counter = Counter()
    add_to_collection(GraphKeys.GLOBAL_STEP, counter.global_step)
    saver = Saver(max_to_keep=None)
    listener = RecordingListener()
    hook = CheckpointSaverHook(str(tmp_path), save_steps=2, saver=saver, listeners=[listener])
    hook.begin()
    raw = Session(counter.state)
    sess = HookedSession(raw, [hook])
    run_steps(sess, counter, saver, 5)
    hook.end(raw)
    assert listener.steps("before_save") == [1, 3, 5]


def test_secs_schedule(tmp_path, fake_clock):
    counter = Counter()
    saver = Saver(max_to_keep=None)
    listener = RecordingListener()
    hook = CheckpointSaverHook(
        str(tmp_path), save_secs=10, saver=saver, listeners=[listener], clock=fake_clock
    )
    with monitored(counter, hook) as sess:
        saver.wait()
        for _ in range(7):
            fake_clock.advance(4.0)
            sess.run(counter.step)
            saver.wait()
        assert listener.steps("before_save") == [0, 3, 6]
    assert listener.steps("before_save") == [0, 3, 6, 7]


def test_no_final_save_when_the_last_step_is_saved(tmp_path):
    counter = Counter()
    saver = Saver(max_to_keep=None)
    listener = RecordingListener()
    hook = CheckpointSaverHook(str(tmp_path), save_steps=2, saver=saver, listeners=[listener])
    with monitored(counter, hook) as sess:
        run_steps(sess, counter, saver, 4)
    assert listener.steps("before_save") == [0, 2, 4]
    assert listener.steps("after_save") == [0, 2, 4]
    assert listener.calls[-1] == ("end", 4)


def test_the_final_save_is_synchronous(tmp_path):
    counter = Counter()
    hook = CheckpointSaverHook(str(tmp_path), save_secs=3600)
    with MonitoredSession(
        ChiefSessionCreator(scaffold=Scaffold(), state=counter.state), hooks=[hook]
    ) as sess:
        for _ in range(3):
            sess.run(counter.step)
    # No wait: end() returned only once the last checkpoint was committed.
    assert os.path.exists(tmp_path / "model.ckpt-3.index")
    assert checkpoint_steps(tmp_path) == [0, 3]


def test_a_restored_checkpoint_is_not_written_again(tmp_path):
    counter = Counter()
    with monitored(
        counter, CheckpointSaverHook(str(tmp_path), save_steps=2), checkpoint_dir=str(tmp_path)
    ) as sess:
        for _ in range(3):
            sess.run(counter.step)
    index = tmp_path / "model.ckpt-3.index"
    mtime = os.stat(index).st_mtime_ns
    resumed = Counter()
    listener = RecordingListener()
    hook = CheckpointSaverHook(str(tmp_path), save_steps=2, listeners=[listener])
    with monitored(resumed, hook, checkpoint_dir=str(tmp_path)) as sess:
        assert resumed.global_step.value == 3
        assert listener.steps("before_save") == []
        sess.run(resumed.step)
    assert listener.steps("before_save") == [4]
    assert os.stat(index).st_mtime_ns == mtime


class CommitCheckingListener(RecordingListener):
    """Also records, at each ``after_save``, the runs made so far and whether it is committed."""

    def __init__(self, counter, logdir, stop_at_step=None):
        super().__init__(stop_at_step)
        self.counter = counter
        self.logdir = logdir
        self.runs_at_after_save = []
        self.committed_at_after_save = []

    def after_save(self, session, global_step_value):
        self.runs_at_after_save.append(self.counter.calls)
        index = os.path.join(self.logdir, f"model.ckpt-{global_step_value}.index")
        self.committed_at_after_save.append(os.path.exists(index))
        return super().after_save(session, global_step_value)


def test_listener_after_save_runs_right_after_the_commit_on_the_training_thread(tmp_path):
    counter = Counter()
    saver = Saver(max_to_keep=None, storage=slow_storage())
    listener = CommitCheckingListener(counter, str(tmp_path))
    hook = CheckpointSaverHook(str(tmp_path), save_steps=2, saver=saver, listeners=[listener])
    with monitored(counter, hook) as sess:
        assert listener.calls == [("begin", None), ("before_save", 0), ("after_save", 0)]
        for _ in range(5):
            sess.run(counter.step)  # No waiting: the hook waits for each commit itself.
    assert listener.steps("before_save") == [0, 2, 4, 5]
    assert listener.steps("after_save") == [0, 2, 4, 5]
    # after_save(s) is called in the very run that brought the step to s, once committed.
    assert listener.runs_at_after_save == [0, 2, 4, 5]
    assert all(listener.committed_at_after_save)
    assert set(listener.threads) == {threading.get_ident()}


def run_until_stop(sess, counter, limit=20):
    runs = 0
    while not sess.should_stop() and runs < limit:
        sess.run(counter.step)
        runs += 1
    return runs


def test_a_listener_can_stop_training(tmp_path):
    counter = Counter()
    listener = RecordingListener(stop_at_step=2)
    hook = CheckpointSaverHook(
        str(tmp_path), save_steps=2, saver=Saver(storage=slow_storage()), listeners=[listener]
    )
    with monitored(counter, hook) as sess:
        runs = run_until_stop(sess, counter)
    # As TF: the save at step 2 returns True in run 2, which stops training there.
    assert runs == 2
    assert listener.steps("after_save") == [0, 2]
    assert checkpoint_steps(tmp_path) == [0, 2]
    assert listener.calls[-1] == ("end", 2)


def test_a_stop_request_from_the_save_at_session_creation_is_ignored(tmp_path):
    counter = Counter()
    listener = RecordingListener(stop_at_step=0)  # True from every after_save.
    hook = CheckpointSaverHook(str(tmp_path), save_steps=2, listeners=[listener])
    with monitored(counter, hook) as sess:
        assert not sess.should_stop()
        runs = run_until_stop(sess, counter)
    assert runs == 2
    assert checkpoint_steps(tmp_path) == [0, 2]


@pytest.mark.parametrize("with_listener", [False, True])
@pytest.mark.parametrize(
    ("save_steps", "runs", "expected"),
    [(2, 12, [0, 2, 4, 6, 8, 10, 12]), (10, 35, [0, 10, 20, 30, 35])],
)
def test_fast_steps_on_a_slow_disk_keep_the_exact_schedule(
    tmp_path, with_listener, save_steps, runs, expected
):
    counter = Counter()
    saver = Saver(max_to_keep=None, storage=slow_storage())
    listener = RecordingListener()
    hook = CheckpointSaverHook(
        str(tmp_path),
        save_steps=save_steps,
        saver=saver,
        listeners=[listener] if with_listener else [],
    )
    with monitored(counter, hook) as sess:
        for _ in range(runs):
            sess.run(counter.step)  # Steps far faster than a save, and no waiting.
    assert checkpoint_steps(tmp_path) == expected
    assert [s for s, _ in checkpoint_events(tmp_path)] == expected
    for step in expected:
        assert float(read_checkpoint(tmp_path / f"model.ckpt-{step}")["w"]) == step
    if with_listener:
        assert listener.steps("before_save") == expected
        assert listener.steps("after_save") == expected


def test_secs_schedule_on_a_slow_disk(tmp_path, fake_clock):
    counter = Counter()
    listener = RecordingListener()
    hook = CheckpointSaverHook(
        str(tmp_path),
        save_secs=10,
        saver=Saver(max_to_keep=None, storage=slow_storage()),
        listeners=[listener],
        clock=fake_clock,
    )
    with monitored(counter, hook) as sess:
        for _ in range(7):
            fake_clock.advance(4.0)
            sess.run(counter.step)
    assert listener.steps("before_save") == [0, 3, 6, 7]
    assert checkpoint_steps(tmp_path) == [0, 3, 6, 7]


def test_a_due_save_waits_for_the_one_in_flight(tmp_path):
    counter = Counter()
    storage, gate = gated_storage()
    saver = Saver(storage=storage, max_to_keep=None)
    hook = CheckpointSaverHook(str(tmp_path), save_steps=2, saver=saver)
    step_1_done, go, step_2_done = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def train():  # The training thread: creates and runs the session.
        try:
            with monitored(counter, hook, preemption_signals=()) as sess:
                sess.run(counter.step)
                step_1_done.set()
                assert go.wait(JOIN_SECS)
                sess.run(counter.step)
                step_2_done.set()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=train)
    thread.start()
    try:
        assert gate.reached.wait(JOIN_SECS)  # The save at step 0 is being written.
        # Step 1 is not due: it does not wait for the write (the gate is still closed).
        assert step_1_done.wait(JOIN_SECS)
        assert saver.in_flight
        go.set()
        # Step 2 is due: its after_run waits for the save of step 0, then saves step 2.
        assert not step_2_done.wait(0.3)
        assert counter.global_step.value == 2
        assert checkpoint_steps(tmp_path) == []
    finally:
        gate.open()
        thread.join(JOIN_SECS)
    assert not thread.is_alive() and not errors, errors
    assert step_2_done.is_set()
    assert checkpoint_steps(tmp_path) == [0, 2]


class RecordingWriter:
    """Forwards to a real writer; records the CHECKPOINT events with the loss points on disk
    when each is added (after its commit), and the flush requests."""

    def __init__(self, writer, logdir):
        self.writer = writer
        self.logdir = logdir
        self.calls = []

    def add_session_log(self, session_log, global_step=None):
        if session_log.status == CHECKPOINT:
            on_disk = [step for step, _ in scalars(read(self.logdir), "loss")]
            self.calls.append(("checkpoint", global_step, on_disk))
        self.writer.add_session_log(session_log, global_step)

    def request_flush(self):
        self.calls.append(("request_flush",))
        return self.writer.request_flush()

    def __getattr__(self, name):
        return getattr(self.writer, name)


class SlowWriter(SummaryWriter):
    """Writes events only when flushed (or after an hour)."""

    write_delay_secs = 3600.0


def test_the_summaries_of_a_checkpoints_step_are_on_disk_before_it_commits(tmp_path, monkeypatch):
    # The loop logs a step's loss after ``sess.run``, that is after the hook took the
    # checkpoint of that step: the save writes once the next boundary has flushed it.
    real = SlowWriter(str(tmp_path))
    recorder = RecordingWriter(real, tmp_path)
    monkeypatch.setattr(SummaryWriterCache, "get", staticmethod(lambda logdir: recorder))
    counter = Counter()
    hook = CheckpointSaverHook(str(tmp_path), save_steps=2, saver=Saver(max_to_keep=None))
    try:
        with monitored(counter, hook) as sess:
            for _ in range(4):
                sess.run(counter.step)
                value = counter.global_step.value
                real.add_scalar("loss", float(value), value)
            hook.wait_for_save()
    finally:
        real.close()
    checkpoints = [
        (step, on_disk)
        for kind, *rest in recorder.calls
        if kind == "checkpoint"
        for step, on_disk in [rest]
    ]
    assert [step for step, _ in checkpoints] == [0, 2, 4]
    for step, on_disk in checkpoints:  # Later points may be there too.
        assert on_disk[:step] == list(range(1, step + 1)), (step, on_disk)
    assert recorder.calls.count(("request_flush",)) == 3  # One per checkpoint.


def read(logdir):
    """The events on disk now (a file being written may end with a partial record)."""
    events = []
    for path in event_files(logdir):
        try:
            events.extend(read_events(path))
        except Exception:
            pass
    return events


def test_a_failed_background_save_is_reported_and_training_goes_on(tmp_path, caplog):
    counter = Counter()
    storage = FaultyStorage()
    fill_disk(storage)
    saver = Saver(storage=storage)
    listener = RecordingListener()
    hook = CheckpointSaverHook(str(tmp_path), save_steps=2, saver=saver, listeners=[listener])
    with caplog.at_level(logging.ERROR, logger="torchsupervisor"), monitored(counter, hook) as sess:
        saver.wait()
        sess.run(counter.step)
        assert "Checkpoint at step 0 failed" in caplog.text
        storage.clear()
        run_steps(sess, counter, saver, 2)
    assert listener.steps("after_save") == [2, 3]  # Not called for the failed save at 0.
    assert checkpoint_steps(tmp_path) == [2, 3]
    assert temporary_files(tmp_path) == []
    SummaryWriterCache.clear()
    errors = [
        (e.step, e.log_message.level) for e in all_events(tmp_path) if e.HasField("log_message")
    ]
    assert errors == [(0, LogMessage.ERROR)]


def test_stop_on_checkpoint_error_raises_at_the_next_step(tmp_path):
    counter = Counter()
    storage = FaultyStorage()
    fill_disk(storage)
    saver = Saver(storage=storage)
    hook = CheckpointSaverHook(
        str(tmp_path), save_steps=2, saver=saver, stop_on_checkpoint_error=True
    )
    sess = monitored(counter, hook)
    saver.wait()
    with pytest.raises(CheckpointSaveError), sess:
        sess.run(counter.step)
    assert counter.calls == 1
    assert checkpoint_steps(tmp_path) == []


def test_monitored_training_session_offers_tfs_stop_on_a_failed_checkpoint(tmp_path):
    # TF stopped on a checkpoint that could not be written; the default goes on (README).
    for stop in (False, True):
        counter = Counter()
        storage = FaultyStorage()
        fill_disk(storage)
        saver = Saver(storage=storage)
        logdir = tmp_path / str(stop)
        sess = MonitoredTrainingSession(
            checkpoint_dir=str(logdir),
            scaffold=Scaffold(saver=saver),
            state=counter.state,
            save_checkpoint_steps=1,
            save_summaries_steps=None,
            log_step_count_steps=None,
            stop_on_checkpoint_error=stop,
        )
        saver.wait()  # The save at step 0 failed.
        if stop:
            with pytest.raises(CheckpointSaveError), sess:
                sess.run(counter.step)
            assert counter.calls == 1
        else:
            storage.clear()
            with sess:
                for _ in range(3):
                    sess.run(counter.step)
            assert counter.calls == 3
            assert checkpoint_steps(logdir)  # Later saves were written.


def test_a_failed_final_save_raises(tmp_path):
    counter = Counter()
    storage = FaultyStorage()
    saver = Saver(storage=storage)
    hook = CheckpointSaverHook(str(tmp_path), save_secs=3600, saver=saver)
    sess = monitored(counter, hook)
    saver.wait()
    sess.run(counter.step)
    fill_disk(storage)
    with pytest.raises(CheckpointSaveError):
        sess.close()
    assert checkpoint_steps(tmp_path) == [0]


def test_scaffold_saver_and_global_step_of_the_session_state(tmp_path):
    # A stale step in the collection: the state's own step is the one saved and counted.
    add_to_collection(GraphKeys.GLOBAL_STEP, GlobalStep(100))
    counter = Counter()
    scaffold = Scaffold()
    hook = CheckpointSaverHook(str(tmp_path), save_steps=2, scaffold=scaffold)
    with MonitoredSession(
        ChiefSessionCreator(scaffold=scaffold, state=counter.state), hooks=[hook]
    ) as sess:
        sess.run(counter.step)
    assert checkpoint_steps(tmp_path) == [0, 1]


def test_a_failed_final_save_still_closes_the_saver_and_flushes_the_writer(tmp_path):
    counter = Counter()
    storage = FaultyStorage()
    saver = Saver(storage=storage)
    hook = CheckpointSaverHook(str(tmp_path), save_steps=100, saver=saver)
    sess = monitored(counter, hook)
    run_steps(sess, counter, saver, 3)
    fill_disk(storage)
    writer = SummaryWriterCache.get(str(tmp_path))
    flushes = writer.counters().flushes
    with pytest.raises(CheckpointSaveError):
        sess.close()  # end(): the final save at step 3 fails.
    assert not any(t.name == "torchsupervisor-checkpoint-writer" for t in threading.enumerate())
    # The failure's event was flushed to disk by end(), before any writer close.
    assert writer.counters().flushes > flushes
    (path,) = event_files(tmp_path)
    failed = [e.step for e in read_events(path) if e.HasField("log_message")]
    assert failed == [3]
    assert checkpoint_steps(tmp_path) == [0]
    assert temporary_files(tmp_path) == []
