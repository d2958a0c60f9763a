"""CheckpointSaverHook: schedules, background saves, CHECKPOINT events, listeners, failures."""

from __future__ import annotations

import logging
import os
import threading

import pytest
from monitored_helpers import Counter, FullDiskFS, GatedFS, RecordingListener
from supervisor_helpers import (
    CHECKPOINT,
    all_events,
    checkpoint_steps,
    read_checkpoint,
    session_logs,
    temporary_files,
)
from tensorboard.compat.proto.event_pb2 import LogMessage

from torchsupervisor import GlobalStep, Saver, Session, SummaryWriterCache
from torchsupervisor.errors import CheckpointSaveError
from torchsupervisor.hooks import CheckpointSaverHook
from torchsupervisor.monitored_session import MonitoredSession
from torchsupervisor.registry import GraphKeys, add_to_collection
from torchsupervisor.scaffold import Scaffold
from torchsupervisor.session_creators import ChiefSessionCreator
from torchsupervisor.wrapped_sessions import _HookedSession


def monitored(counter, hook, **creator_kwargs):
    return MonitoredSession(
        ChiefSessionCreator(state=counter.state, **creator_kwargs), hooks=[hook]
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


def test_steps_schedule_in_a_bare_hooked_session(tmp_path):
    counter = Counter()
    add_to_collection(GraphKeys.GLOBAL_STEP, counter.global_step)
    saver = Saver(max_to_keep=None)
    listener = RecordingListener()
    hook = CheckpointSaverHook(str(tmp_path), save_steps=2, saver=saver, listeners=[listener])
    hook.begin()
    raw = Session(counter.state)
    sess = _HookedSession(raw, [hook])
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


def test_listener_after_save_runs_on_the_training_thread_after_commit(tmp_path):
    counter = Counter()
    saver = Saver()
    listener = RecordingListener()
    hook = CheckpointSaverHook(str(tmp_path), save_steps=2, saver=saver, listeners=[listener])
    with monitored(counter, hook) as sess:
        assert listener.calls == [("begin", None), ("before_save", 0)]
        saver.wait()
        assert os.path.exists(tmp_path / "model.ckpt-0.index")
        assert listener.steps("after_save") == []  # Committed, but seen at the next hook call.
        sess.run(counter.step)
        assert listener.steps("after_save") == [0]
    assert set(listener.threads) == {threading.get_ident()}


def test_a_listener_can_stop_training(tmp_path):
    counter = Counter()
    saver = Saver()
    listener = RecordingListener(stop_at_step=2)
    hook = CheckpointSaverHook(str(tmp_path), save_steps=2, saver=saver, listeners=[listener])
    runs = 0
    with monitored(counter, hook) as sess:
        while not sess.should_stop() and runs < 20:
            sess.run(counter.step)
            saver.wait()
            runs += 1
    # The save at step 2 commits during step 2; run 3 calls after_save(2), which stops.
    assert runs == 3
    assert listener.steps("after_save")[:2] == [0, 2]
    assert checkpoint_steps(tmp_path) == [0, 2, 3]


def test_a_due_save_does_not_wait_for_the_one_in_flight(tmp_path):
    counter = Counter()
    fs = GatedFS()
    saver = Saver(fs=fs)
    listener = RecordingListener()
    hook = CheckpointSaverHook(str(tmp_path), save_steps=1, saver=saver, listeners=[listener])
    try:
        with monitored(counter, hook) as sess:
            assert fs.entered.wait(10.0)  # The save at step 0 is being written.
            for _ in range(3):
                sess.run(counter.step)  # Each step is due; none blocks on the write.
            assert saver.in_flight
            assert listener.steps("before_save") == [0]
            fs.release()
            saver.wait()
            sess.run(counter.step)
            assert listener.steps("after_save") == [0]
            assert listener.steps("before_save") == [0, 4]
    finally:
        fs.release()
    assert checkpoint_steps(tmp_path) == [0, 4]


def test_a_failed_background_save_is_reported_and_training_goes_on(tmp_path, caplog):
    counter = Counter()
    fs = FullDiskFS()
    saver = Saver(fs=fs)
    listener = RecordingListener()
    hook = CheckpointSaverHook(str(tmp_path), save_steps=2, saver=saver, listeners=[listener])
    with caplog.at_level(logging.ERROR, logger="torchsupervisor"), monitored(counter, hook) as sess:
        saver.wait()
        sess.run(counter.step)
        assert "Checkpoint at step 0 failed" in caplog.text
        fs.full = False
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
    saver = Saver(fs=FullDiskFS())
    hook = CheckpointSaverHook(
        str(tmp_path), save_steps=2, saver=saver, stop_on_checkpoint_error=True
    )
    sess = monitored(counter, hook)
    saver.wait()
    with pytest.raises(CheckpointSaveError), sess:
        sess.run(counter.step)
    assert counter.calls == 1
    assert checkpoint_steps(tmp_path) == []


def test_a_failed_final_save_raises(tmp_path):
    counter = Counter()
    fs = FullDiskFS()
    fs.full = False
    saver = Saver(fs=fs)
    hook = CheckpointSaverHook(str(tmp_path), save_secs=3600, saver=saver)
    sess = monitored(counter, hook)
    saver.wait()
    sess.run(counter.step)
    fs.full = True
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
