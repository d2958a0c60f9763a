"""The CheckpointDriver: skip, defer, report, and the final save within a grace budget.

Budgets run on a ``FakeClock``: a save that does not end in time is abandoned as soon as the
driver waits past the deadline, so these tests never race real time.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import pytest
import torch
from tensorboard.compat.proto.event_pb2 import SessionLog

from torchsupervisor import GlobalStep, Saver, Session, latest_checkpoint
from torchsupervisor.checkpoint import engine as engine_module
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.driver.checkpoint_driver import CheckpointDriver
from torchsupervisor.errors import CheckpointSaveError
from torchsupervisor.storage import is_temporary_name
from torchsupervisor.testing import FakeClock, FaultyStorage, GatedStorage

JOIN_SECS = 60.0


class RecordingWriter:
    """The two calls of a summary writer the driver makes, recorded."""

    def __init__(self) -> None:
        self.logs: list[tuple[int, int, str]] = []
        self.events: list = []
        self.flushes = 0

    def add_session_log(self, log, step) -> None:
        self.logs.append((log.status, step, log.checkpoint_path))

    def add_event(self, event) -> None:
        self.events.append(event)

    def request_flush(self) -> None:
        self.flushes += 1


def _setup(tmp_path, storage=None, **kwargs):
    w = torch.zeros(100)
    step = GlobalStep()
    sess = Session({"w": w, "global_step": step})
    saver = Saver(storage=storage, max_to_keep=None)
    driver = CheckpointDriver(saver, str(tmp_path / "model.ckpt"), step, **kwargs)
    return w, step, sess, saver, driver


def _steps(tmp_path) -> list[int]:
    names = os.listdir(tmp_path)
    return sorted(
        int(n[len("model.ckpt-") : -len(".index")]) for n in names if n.endswith(".index")
    )


def test_a_committed_save_writes_the_checkpoint_event_and_asks_for_a_flush(tmp_path):
    writer = RecordingWriter()
    _, step, sess, _, driver = _setup(tmp_path, writer=writer)
    step.increment()
    assert driver.save(sess, 1) == str(tmp_path / "model.ckpt-1")
    assert writer.logs == [(SessionLog.CHECKPOINT, 1, str(tmp_path / "model.ckpt"))]
    assert writer.flushes == 1
    assert (driver.last_step, driver.last_prefix, driver.last_error) == (
        1,
        str(tmp_path / "model.ckpt-1"),
        None,
    )


def test_the_step_of_the_last_checkpoint_is_not_saved_again(tmp_path):
    _, step, sess, _, driver = _setup(tmp_path, last_step=0)
    assert driver.save(sess, 0) is None  # Restored at step 0.
    step.increment()
    assert driver.save(sess, 1) is not None
    assert driver.save(sess, 1) is None
    assert _steps(tmp_path) == [1]


def test_a_failed_save_is_logged_reported_as_an_event_and_raised(tmp_path, caplog):
    storage = FaultyStorage()
    storage.fail("write", errno=errno.ENOSPC)
    writer = RecordingWriter()
    _, _, sess, _, driver = _setup(tmp_path, storage, writer=writer)
    with caplog.at_level(logging.ERROR, "torchsupervisor"), pytest.raises(CheckpointSaveError):
        driver.save(sess, 0)
    assert "Checkpoint at step 0 failed; training continues" in caplog.text
    (event,) = writer.events
    assert event.step == 0 and event.log_message.message.startswith("Checkpoint at step 0 failed")
    assert driver.last_error.startswith("CheckpointSaveError") and driver.last_step is None


def test_a_failed_background_save_calls_on_error_after_its_report(tmp_path):
    storage = FaultyStorage()
    storage.fail("rename", errno=errno.EIO)
    seen = []
    writer = RecordingWriter()
    _, _, sess, _, driver = _setup(
        tmp_path, storage, writer=writer, on_error=lambda e: seen.append((e, len(writer.events)))
    )
    driver.start(sess, 0)
    assert driver.wait(JOIN_SECS)
    (error, events_then) = seen[0]
    assert isinstance(error, CheckpointSaveError) and events_then == 1


def test_after_a_failure_that_stops_training_no_periodic_save_commits(tmp_path):
    # The failing save is held at the gate while training goes on and asks again.
    storage = GatedStorage()
    gate = storage.hold("rename", timeout_secs=JOIN_SECS)
    storage.fail("rename", errno=errno.ENOSPC)
    stopped = []
    _, step, sess, saver, driver = _setup(tmp_path, storage, on_error=stopped.append)
    driver.request(sess)
    sess.boundary.run_pending()  # The save of step 0 starts ...
    assert gate.reached.wait(JOIN_SECS)
    step.increment()
    driver.request(sess)
    sess.boundary.run_pending()  # ... a request while it is in flight is deferred ...
    gate.open()
    assert driver.wait(JOIN_SECS)  # ... and the save fails: training is told to stop.
    assert len(stopped) == 1 and isinstance(stopped[0], CheckpointSaveError)
    assert not sess.boundary.pending  # The deferred request was dropped,
    driver.request(sess)  # and so is one made while training winds down.
    sess.boundary.run_pending()
    assert not driver.in_flight and not saver.in_flight
    assert _steps(tmp_path) == []


def test_a_request_during_a_save_is_served_after_it_at_the_step_reached_then(tmp_path):
    storage = GatedStorage()
    gate = storage.hold("fsync", timeout_secs=JOIN_SECS)  # The first save waits at the gate.
    w, step, sess, _, driver = _setup(tmp_path, storage)
    driver.request(sess)
    sess.boundary.run_pending()  # The training thread's boundary: the save of step 0 starts.
    assert gate.reached.wait(JOIN_SECS)
    for _ in range(3):
        step.increment()
        w.add_(1)
    driver.request(sess)
    driver.request(sess)  # Two requests before the boundary are one.
    sess.boundary.run_pending()  # In flight: deferred, never blocking.
    assert driver.in_flight and not sess.boundary.pending
    gate.open()
    assert driver.wait(JOIN_SECS)
    assert sess.boundary.pending  # Re-asked once the save of step 0 ended.
    sess.boundary.run_pending()
    assert driver.wait(JOIN_SECS)
    assert _steps(tmp_path) == [0, 3]


def test_final_without_a_budget_is_a_save_that_raises(tmp_path):
    storage = FaultyStorage()
    storage.fail("open", errno=errno.EACCES)
    _, _, sess, _, driver = _setup(tmp_path, storage)
    with pytest.raises(CheckpointSaveError):
        driver.final(sess, 0)


def test_final_within_the_budget_commits_and_calls_before_save(tmp_path):
    # The real clock: on a fake one any wait for the disk uses the budget up at once.
    _, _, sess, _, driver = _setup(tmp_path)
    driver.grace_budget_secs = 60.0
    called = []
    assert driver.final(sess, 0, before_save=called.append) == str(tmp_path / "model.ckpt-0")
    assert called == [0] and driver.last_step == 0


def test_a_final_save_that_cannot_fit_is_not_started_when_another_tier_holds_its_step(
    tmp_path, caplog
):
    clock = FakeClock()
    clock.auto_advance = False
    _, step, sess, _, driver = _setup(tmp_path, clock=clock)
    assert driver.fastest_save_secs is None
    driver.save(sess, 0)  # On the fake clock it took no time: every final save fits.
    assert driver.fastest_save_secs == 0.0
    driver.fastest_save_secs = 5.0  # As if the fastest save so far took 5 s.
    step.increment()
    driver.grace_budget_secs = 4.0
    # Nothing else holds step 1: the save is tried (and fits: the fake clock stands still).
    assert driver.final(sess, 1) == str(tmp_path / "model.ckpt-1")
    assert driver.fastest_save_secs == 0.0  # It measured this one too: as fast as ever.
    driver.fastest_save_secs = 5.0
    step.increment()
    with caplog.at_level("WARNING", "torchsupervisor"):
        assert driver.final(sess, 2, held_elsewhere="this node's memory tier") is None
    assert _steps(tmp_path) == [0, 1] and driver.last_step == 1
    assert driver.last_error.startswith("not started: it takes about 5.0 s and 4.0 s")
    assert "this node's memory tier holds step 2" in caplog.text
    driver.grace_budget_secs = 6.0  # Time enough: written even though memory holds it.
    assert driver.final(sess, 2, held_elsewhere="this node's memory tier") is not None
    assert _steps(tmp_path) == [0, 1, 2]


@pytest.mark.parametrize("hangs", ["the save in flight", "the final save"])
def test_a_hung_fsync_cannot_overrun_the_grace_budget(tmp_path, caplog, hangs):
    storage = GatedStorage()
    clock = FakeClock()
    w, step, sess, saver, driver = _setup(tmp_path, storage, clock=clock)
    driver.save(sess, 0)  # Step 0, committed.
    # Every fsync hangs from now on (a dead NFS server, a stuck disk) until the gate opens.
    gate = storage.hold("fsync", times=None, timeout_secs=120)
    watchdog = threading.Timer(JOIN_SECS, gate.open)  # Fails the test below, never hangs.
    watchdog.start()
    try:
        step.increment()
        w.add_(1)
        if hangs == "the save in flight":
            driver.request(sess)
            sess.boundary.run_pending()  # The background save of step 1 starts...
            assert gate.reached.wait(JOIN_SECS)  # ...and hangs in fsync.
            step.increment()
        driver.grace_budget_secs = 0.5
        start = clock.monotonic()
        with caplog.at_level("WARNING", "torchsupervisor"):
            if hangs == "the save in flight":
                assert driver.final(sess, step.value) is None
            else:
                # The budget runs out only once the final save hangs in fsync: on a fake clock
                # that advances by itself it would run out at once, and a writer that had not
                # reached fsync yet (a busy machine) would stop at its next stage, cancelled.
                clock.auto_advance = False
                returned = []
                final = threading.Thread(
                    target=lambda: returned.append(driver.final(sess, step.value))
                )
                final.start()
                assert gate.reached.wait(JOIN_SECS)  # The final save hangs in fsync...
                clock.auto_advance = True
                clock.advance(0.5)  # ...and the budget runs out.
                final.join(JOIN_SECS)
                assert not final.is_alive() and returned == [None]
            # On the driver's clock the budget was kept to the letter.
            assert clock.monotonic() - start == pytest.approx(0.5)
            # The Supervisor's stop then neither waits for the stuck writer nor joins it.
            assert driver.wait() is True
            saver.close()
        assert "abandoned" in caplog.text or "stuck" in caplog.text
        assert driver.last_error is not None and driver.last_step == 0
        assert saver.in_flight  # Still stuck in fsync...
        # ...and the interpreter's exit hook waits for it only a little.
        exit_start = time.monotonic()
        engine_module.wait_for_saves_at_exit()
        assert time.monotonic() - exit_start < engine_module.ABANDONED_EXIT_WAIT_SECS + 10
    finally:
        gate.open()
        watchdog.cancel()
    assert saver.wait(JOIN_SECS)  # ...until the call returns: then it stops, committing nothing.
    names = os.listdir(tmp_path)
    assert sorted(n for n in names if n.endswith(".index")) == ["model.ckpt-0.index"]
    assert not [n for n in names if is_temporary_name(n)]
    assert CheckpointReader(latest_checkpoint(str(tmp_path))).global_step == 0


def test_abandon_cancels_the_save_in_flight(tmp_path):
    storage = GatedStorage()
    gate = storage.hold("fsync", timeout_secs=JOIN_SECS)
    _, _, sess, _, driver = _setup(tmp_path, storage)
    driver.start(sess, 0)
    assert gate.reached.wait(JOIN_SECS)
    threading.Timer(0.2, gate.open).start()
    assert driver.abandon(JOIN_SECS)
    assert not driver.in_flight and driver.last_step is None
    assert _steps(tmp_path) == []


def test_waiting_for_the_save_in_flight_hurries_it(tmp_path, monkeypatch):
    """A wait (``wait``, ``final``) first raises the writer to the waiter's CPU priority."""
    from torchsupervisor.core import threads

    hurried: list[bool] = []
    monkeypatch.setattr(threads, "hurry", lambda: hurried.append(True) or True)
    storage = GatedStorage()
    gate = storage.hold("fsync", timeout_secs=JOIN_SECS)
    _, _, sess, _, driver = _setup(tmp_path, storage)
    assert driver.wait(0) and hurried == []  # Nothing in flight: nothing to hurry.
    driver.request(sess)
    sess.boundary.run_pending()
    assert gate.reached.wait(JOIN_SECS)
    assert driver.wait(0) is False  # Timed out, after hurrying the save.
    assert hurried
    gate.open()
    assert driver.wait(JOIN_SECS)
    driver.close()


class ScalarWriter(RecordingWriter):
    def __init__(self) -> None:
        super().__init__()
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag, value, step) -> None:
        self.scalars.append((tag, value, step))


def test_a_save_that_falls_behind_its_interval_is_hurried_then_reported(
    tmp_path, monkeypatch, caplog
):
    # save_model_secs=5 on a busy machine: checkpoints 4-15 s apart, one 25 s old at a kill,
    # and nothing said.
    from torchsupervisor.core import threads

    hurried = []
    monkeypatch.setattr(threads, "hurry", lambda: hurried.append(True) or True)
    clock = FakeClock()
    storage = GatedStorage()
    writer = ScalarWriter()
    _, step, sess, _, driver = _setup(tmp_path, storage, writer=writer, clock=clock)
    gate = storage.hold("fsync")  # The save in flight makes no progress.
    try:
        step.assign(3)
        driver.start(sess, 3)
        assert gate.reached.wait(JOIN_SECS)
        clock.advance(4.0)
        driver.keep_up(5.0)  # Within the interval: nothing.
        assert hurried == [] and writer.scalars == []
        clock.advance(2.0)
        driver.keep_up(5.0)  # Past it: the save runs at the caller's priority.
        assert hurried == [True] and writer.scalars == []
        clock.advance(5.0)
        with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
            driver.keep_up(5.0)  # Twice the interval: said, and a scalar.
            driver.keep_up(5.0)  # Said once per interval.
        assert caplog.text.count("The newest checkpoint is 11 s old, more than 2 times") == 1
        assert writer.scalars == [("torchsupervisor/checkpoint_age_secs", 11.0, 3)] * 2
    finally:
        gate.open()
        driver.close()


def test_a_short_intervals_lag_is_said_in_hundredths_not_as_0_s(tmp_path, caplog):
    clock = FakeClock()
    *_, driver = _setup(tmp_path, GatedStorage(), writer=ScalarWriter(), clock=clock)
    try:
        clock.advance(0.12)
        with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
            driver.keep_up(0.05)
        assert "The newest checkpoint is 0.12 s old, more than 2 times the interval of 0.05 s" in (
            caplog.text
        )
    finally:
        driver.close()


def test_the_progress_line_says_a_checkpoint_is_overdue(fake_clock):
    from torchsupervisor.hooks.progress import Progress

    class Driver:
        last_commit_time = fake_clock.monotonic()
        in_flight = True

    progress = Progress(checkpoint_driver=Driver(), checkpoint_every_secs=5.0, clock=fake_clock)
    fake_clock.advance(3.0)
    assert progress.describe(10, fake_clock.monotonic()).endswith("checkpoint 3s ago, next in 2s")
    fake_clock.advance(9.0)  # "next in 0s" was shown while the save fell behind.
    assert progress.describe(20, fake_clock.monotonic()).endswith(
        "checkpoint 12s ago, saving, 7s overdue"
    )
