"""Supervisor: stop(), loop() threads, queue runners, and the exceptions of managed_session.

Reference section 1.7-1.9: the first exception wins, end of input (``OutOfRangeError``, and here
``StopIteration``) is a clean stop, and every thread is joined at exit.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest
from supervisor_helpers import (
    START,
    STOP,
    Counter,
    event_files,
    read_checkpoint,
    read_events,
    session_logs,
    wait_until,
)

from torchsupervisor import (
    GraphKeys,
    LooperThread,
    Supervisor,
    add_to_collection,
    latest_checkpoint,
)
from torchsupervisor.errors import OutOfRangeError


def _sv_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("SV"))


# ----------------------------------------------------------------------- stop and threads


def test_stop_reraises_the_recorded_exception(tmp_path):
    sv = Supervisor(state=Counter().state)
    sv.prepare_or_wait_for_session()
    assert not sv.should_stop()
    try:
        raise ValueError("from a worker")
    except ValueError as e:
        error = e
        sv.request_stop(e)
    assert sv.should_stop()
    with pytest.raises(ValueError) as info:
        sv.stop()
    assert info.value is error


def test_stop_names_a_thread_that_does_not_stop_within_the_grace_period():
    release = threading.Event()
    stubborn = threading.Thread(target=release.wait, name="stubborn-thread")
    stubborn.start()
    sv = Supervisor(state=Counter().state, stop_grace_secs=0.05)
    try:
        with pytest.raises(RuntimeError) as info:
            sv.stop(threads=[stubborn])
        assert str(info.value) == "Coordinator stopped with threads still running: stubborn-thread"
    finally:
        release.set()
        stubborn.join(10)


def test_stop_ignoring_live_threads_only_logs_them(caplog):
    release = threading.Event()
    sv = Supervisor(state=Counter().state, stop_grace_secs=0.05)
    looper = sv.loop(None, release.wait)  # its first call blocks until released
    try:
        with caplog.at_level(logging.INFO, logger="torchsupervisor"):
            sv.stop(ignore_live_threads=True)
        assert looper.is_alive()
        assert f"Coordinator stopped with threads still running: {looper.name}" in caplog.messages
    finally:
        release.set()
        looper.join(10)
    assert not looper.is_alive()


def test_stop_joins_registered_loop_threads_without_being_passed_them():
    release = threading.Event()
    sv = Supervisor(state=Counter().state, stop_grace_secs=0.05)
    looper = sv.loop(None, release.wait)
    try:
        with pytest.raises(RuntimeError, match=f"still running: {looper.name}$"):
            sv.stop()
    finally:
        release.set()
        looper.join(10)


def test_loop_calls_its_target_at_once_then_on_its_interval_until_stop(tmp_path):
    calls = []
    called = threading.Event()

    def record(sess, tag, scale=1):
        calls.append((sess, tag, scale))
        called.set()

    sv = Supervisor(state=Counter().state)
    with sv.managed_session() as sess:
        thread = sv.loop(3600, record, args=(sess, "t"), kwargs={"scale": 2})
        assert isinstance(thread, threading.Thread) and thread.is_alive()
        # The first call does not wait for the interval.
        assert called.wait(10)
    assert not thread.is_alive()  # stop() joined it
    assert calls == [(sess, "t", 2)]


def test_loop_with_no_interval_calls_back_to_back():
    count = []
    sv = Supervisor(state=Counter().state)
    with sv.managed_session():
        thread = sv.loop(None, lambda: count.append(1))
        wait_until(lambda: len(count) >= 3, what="three calls")
    assert not thread.is_alive()


# ------------------------------------------------------------------- exceptions (scenario 9)


def test_managed_session_normal_exit_leaves_should_stop_true():
    sv = Supervisor(state=Counter().state)
    with sv.managed_session():
        assert not sv.should_stop()
    assert sv.should_stop()


def test_error_in_the_body_is_reraised_after_stopping():
    sv = Supervisor(state=Counter().state)
    error = RuntimeError("bad step")
    with pytest.raises(RuntimeError) as info, sv.managed_session():
        raise error
    assert info.value is error
    assert sv.should_stop()


@pytest.mark.parametrize(
    "make_error",
    [lambda: OutOfRangeError(None, None, "End of sequence"), lambda: StopIteration()],
    ids=["OutOfRangeError", "StopIteration"],
)
def test_end_of_input_in_the_body_is_a_clean_stop(make_error):
    sv = Supervisor(state=Counter().state)
    with sv.managed_session():
        raise make_error()
    assert sv.should_stop()


def test_exhausted_python_iterator_in_the_body_is_a_clean_stop():
    c = Counter()
    data = iter(range(3))
    sv = Supervisor(state=c.state)
    with sv.managed_session() as sess:
        while not sv.should_stop():
            next(data)
            sess.run(c.step)
    assert c.global_step.value == 3


def test_error_in_a_loop_thread_stops_training_and_is_reraised():
    sv = Supervisor(state=Counter().state)

    def failing():
        raise ValueError("service failed")

    with pytest.raises(ValueError, match="service failed"), sv.managed_session():
        sv.loop(3600, failing)
        wait_until(sv.should_stop, what="the stop request of the failed thread")
    assert sv.should_stop()


@pytest.mark.parametrize(
    "make_error",
    [lambda: OutOfRangeError(None, None, "End of sequence"), lambda: StopIteration()],
    ids=["OutOfRangeError", "StopIteration"],
)
def test_end_of_input_in_a_loop_thread_is_a_clean_stop(make_error):
    sv = Supervisor(state=Counter().state)

    def producer():
        raise make_error()

    with sv.managed_session():
        sv.loop(None, producer)
        assert sv.coord.wait_for_stop(10)
    assert sv.should_stop()


def test_first_exception_wins_a_service_error_beats_a_later_body_error():
    sv = Supervisor(state=Counter().state)

    def failing():
        raise ValueError("first")

    with pytest.raises(ValueError, match="first"), sv.managed_session():
        sv.loop(None, failing)
        assert sv.coord.wait_for_stop(10)
        raise RuntimeError("second")


def test_body_error_after_a_plain_stop_request_is_swallowed():
    sv = Supervisor(state=Counter().state)
    with sv.managed_session():
        sv.request_stop()
        raise RuntimeError("ignored: a stop was already requested")
    assert sv.should_stop()


def test_a_failing_standard_service_stops_training_and_is_reraised(tmp_path):
    def summary_op():
        raise ValueError("summary failed")

    sv = Supervisor(
        logdir=str(tmp_path), state=Counter().state, summary_op=summary_op, save_model_secs=0
    )
    with pytest.raises(ValueError, match="summary failed"), sv.managed_session():
        assert sv.coord.wait_for_stop(10)  # the summary service runs at once
    assert session_logs(read_events(event_files(tmp_path)[0]))[-1][1] == STOP


def test_prepare_error_is_recorded_and_reraised_without_running_the_body():
    sv = Supervisor(state=Counter().state, ready_op=lambda: ["w"], init_op=lambda: None)
    body_ran = []
    with (
        pytest.raises(
            RuntimeError,
            match=r"^Init operations did not make model ready\.  .*error: Variables not "
            r"initialized: w$",
        ),
        sv.managed_session(),
    ):
        body_ran.append(True)
    assert body_ran == []


def test_keyboard_interrupt_is_not_caught_but_the_services_stop(tmp_path):
    c = Counter()
    sv = Supervisor(logdir=str(tmp_path), state=c.state, save_model_secs=0)
    with pytest.raises(KeyboardInterrupt), sv.managed_session():
        raise KeyboardInterrupt
    assert sv.should_stop()
    assert _sv_threads() == []
    logs = session_logs(read_events(event_files(tmp_path)[0]))
    assert [status for _, status, _ in logs] == [START, STOP]


def test_stop_on_exception_and_wait_for_stop_delegate_to_the_coordinator():
    sv = Supervisor(state=Counter().state)
    sv.prepare_or_wait_for_session()
    waiter_done = threading.Event()
    waiter = threading.Thread(target=lambda: (sv.wait_for_stop(), waiter_done.set()))
    waiter.start()
    assert not waiter_done.wait(0.01)
    with sv.stop_on_exception():
        raise ValueError("in a worker")
    assert waiter_done.wait(10)
    waiter.join(10)
    with pytest.raises(ValueError, match="in a worker"):
        sv.stop()


def test_the_session_is_closed_at_exit():
    c = Counter()
    sv = Supervisor(state=c.state)
    with sv.managed_session() as sess:
        sess.run(c.step)
    assert sess.closed
    with pytest.raises(RuntimeError, match=r"^Attempted to use a closed Session\.$"):
        sess.run(c.step)


class _Runner:
    """A queue-runner stand-in: one LooperThread feeding items until its source is exhausted."""

    def __init__(self, items):
        self._items = iter(items)
        self.fed = []
        self.threads = []

    def create_threads(self, sess, coord=None, daemon=False, start=False):
        thread = LooperThread(coord, None, target=self._feed)
        thread.daemon = daemon
        if start:
            thread.start()
        self.threads.append(thread)
        return [thread]

    def _feed(self):
        self.fed.append(next(self._items))  # StopIteration at the end: a clean stop


@pytest.mark.parametrize("is_chief", [True, False])
def test_queue_runners_of_the_collection_start_with_the_session(is_chief):
    runner = _Runner(range(5))
    add_to_collection(GraphKeys.QUEUE_RUNNERS, runner)
    sv = Supervisor(state=Counter().state, is_chief=is_chief)
    with sv.managed_session():
        (thread,) = runner.threads
        assert thread.daemon
        wait_until(sv.should_stop, what="the end of the input")
    assert runner.fed == [0, 1, 2, 3, 4]
    assert not thread.is_alive()


def test_queue_runners_are_not_started_without_standard_services():
    runner = _Runner(range(5))
    add_to_collection(GraphKeys.QUEUE_RUNNERS, runner)
    sv = Supervisor(state=Counter().state)
    with sv.managed_session(start_standard_services=False) as sess:
        assert runner.threads == []
        threads = sv.start_queue_runners(sess, [_Runner([])])
        assert len(threads) == 1
        wait_until(sv.should_stop, what="the end of the empty input")
    assert not threads[0].is_alive()


_PREEMPTED_PROGRAM = r"""
import os, signal, sys
import torch
from torchsupervisor import GlobalStep, Supervisor

w, step = torch.zeros(()), GlobalStep()
sv = Supervisor(logdir=sys.argv[1], state={"w": w, "global_step": step},
                save_summaries_secs=0, save_model_secs=3600)

def train_step():
    w.add_(1.0)
    step.increment()

with sv.managed_session() as sess:
    while not sv.should_stop():
        sess.run(train_step)
        if step.value == 3:
            os.kill(os.getpid(), getattr(signal, sys.argv[2]))
        if step.value >= 1000:
            sys.exit(3)  # the signal did not stop training
print("stopped at", step.value)
"""


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGUSR1"])
def test_a_preemption_signal_stops_training_cleanly_with_a_final_checkpoint(tmp_path, signal_name):
    proc = subprocess.run(
        [sys.executable, "-c", _PREEMPTED_PROGRAM, str(tmp_path), signal_name],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.split() == ["stopped", "at", "3"]
    assert latest_checkpoint(str(tmp_path)) == os.path.join(tmp_path, "model.ckpt-3")
    assert read_checkpoint(os.path.join(tmp_path, "model.ckpt-3"))["w"] == 3.0
    assert session_logs(read_events(event_files(tmp_path)[0]))[-1][1] == STOP


# ----------------------------------------- the same stop path outside managed_session

_UNMANAGED_PROGRAM = r"""
import os, signal, sys
import torch
from torchsupervisor import GlobalStep, Supervisor

loop, exit_code = sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None
w, step = torch.zeros(()), GlobalStep()
sv = Supervisor(logdir=sys.argv[1], state={"w": w, "global_step": step},
                save_summaries_secs=0, save_model_secs=3600, preemption_exit_code=exit_code)

def train_step():
    w.add_(1.0)
    step.increment()
    if step.value == 3:
        os.kill(os.getpid(), signal.SIGTERM)

if loop == "managed":  # A loop that never asks should_stop(), in managed_session.
    with sv.managed_session() as sess:
        for _ in range(1000):
            sess.run(train_step)
elif loop == "should_stop":  # TF's inception_distributed_train: should_stop(), then stop().
    sess = sv.prepare_or_wait_for_session()
    while not sv.should_stop():
        sess.run(train_step)
    sv.stop()
else:  # TF's mnist_replica: a loop that never asks should_stop() and never calls stop().
    sess = sv.prepare_or_wait_for_session()
    while True:
        sess.run(train_step)
        if step.value >= 1000:
            break
print("stopped at", step.value)
"""


@pytest.mark.parametrize(
    "loop, exit_code, printed",
    [
        ("should_stop", None, True),
        ("should_stop", 75, False),
        ("no_check", None, False),
        ("no_check", 75, False),
        ("managed", None, True),
    ],
)
def test_a_preemption_stops_every_tf_loop_with_a_final_checkpoint(
    tmp_path, loop, exit_code, printed
):
    # prepare_or_wait_for_session installed no handler: SIGTERM killed the process (-15) and
    # lost the work since the last checkpoint; a loop that never asks should_stop() ran on.
    args = [sys.executable, "-c", _UNMANAGED_PROGRAM, str(tmp_path), loop]
    if exit_code is not None:
        args.append(str(exit_code))
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == (exit_code or 0), (proc.returncode, proc.stderr[-2000:])
    assert (proc.stdout.split() == ["stopped", "at", "3"]) == printed, proc.stdout
    assert latest_checkpoint(str(tmp_path)) == os.path.join(tmp_path, "model.ckpt-3")
    assert read_checkpoint(os.path.join(tmp_path, "model.ckpt-3"))["w"] == 3.0
    assert proc.stderr.count("Received SIGTERM: stopping at step 3 with a final checkpoint") == 1
    assert session_logs(read_events(event_files(tmp_path)[0]))[-1][1] == STOP


def test_prepare_or_wait_then_stop_saves_the_final_checkpoint_of_a_clean_stop(tmp_path):
    c = Counter()
    sv = Supervisor(logdir=str(tmp_path), state=c.state, save_model_secs=3600)
    sess = sv.prepare_or_wait_for_session()
    for _ in range(4):
        sess.run(c.step)
    sv.stop()
    assert latest_checkpoint(str(tmp_path)) == os.path.join(tmp_path, "model.ckpt-4")
    # But not while an exception propagates: the state may be in the middle of a step.
    sess = sv.prepare_or_wait_for_session()
    sess.run(c.step)
    with pytest.raises(ValueError):
        try:
            raise ValueError("in the loop")
        finally:
            sv.stop()
    assert latest_checkpoint(str(tmp_path)) == os.path.join(tmp_path, "model.ckpt-4")
