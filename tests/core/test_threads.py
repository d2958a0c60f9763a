"""Background threads step aside for the training thread: niceness and SCHED_IDLE (Linux)."""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading

import pytest
import torch

from torchsupervisor import Saver, Session
from torchsupervisor.core import threads as priority

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux threads")


def _in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(timeout=60)
    return out[0]


@linux_only
def test_lower_sets_niceness_and_sched_idle_of_the_calling_thread_only():
    before = priority.current()

    def lowered():
        priority.lower(19, idle=True)
        return priority.current()

    assert _in_thread(lowered) == priority.Priority(19, os.SCHED_IDLE)
    assert priority.current() == before  # This thread is untouched.
    assert _in_thread(lambda: (priority.lower(0, idle=True), priority.current())[1]) == before


@linux_only
def test_the_checkpoint_writer_and_its_checksum_helper_run_at_idle_priority(tmp_path):
    saver = Saver()
    future = saver.save_async(Session({"w": torch.ones(1 << 20)}), str(tmp_path / "m"), 1)
    for _ in range(6000):  # Polled: a wait (result()) would raise them (threads.hurry).
        if future.done():
            break
        threading.Event().wait(0.01)
    assert future.done() and future.exception() is None
    threads = {t.name: t.native_id for t in threading.enumerate()}
    # Where a wait could not raise them again, they run at nice 15 instead (test below).
    expected = (19, os.SCHED_IDLE) if priority.raise_permitted() else (15, os.SCHED_OTHER)
    for name in ("torchsupervisor-checkpoint-writer", "torchsupervisor-checksums"):
        assert os.getpriority(os.PRIO_PROCESS, threads[name]) == expected[0], name
        assert os.sched_getscheduler(threads[name]) == expected[1], name
    saver.close()


_UNPRIVILEGED_CHILD = """
import logging, os, sys, threading
import torch
from torchsupervisor import Saver, Session
from torchsupervisor.core import threads as priority

records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("torchsupervisor").addHandler(handler)
logging.getLogger("torchsupervisor").setLevel(logging.INFO)
assert priority.raise_permitted() is False
saver = Saver()
state = Session({"w": torch.ones(1 << 20)})
for step in (1, 2):
    future = saver.save_async(state, os.path.join(sys.argv[1], "m"), step)
    for _ in range(6000):  # Polled: nothing raises the writer.
        if future.done():
            break
        threading.Event().wait(0.01)
    assert future.done() and future.exception() is None
    threads = {t.name: t.native_id for t in threading.enumerate()}
    for name in ("torchsupervisor-checkpoint-writer", "torchsupervisor-checksums"):
        assert priority.current(threads[name]) == (15, os.SCHED_OTHER), name
    assert priority.current() == (0, os.SCHED_OTHER)  # The training thread: untouched.
future = saver.save_async(state, os.path.join(sys.argv[1], "m"), 3)
assert future.result(timeout=60).endswith("m-3")  # Waited for: nothing to raise, no refusal.
assert priority.hurry() is True
saver.close()
messages = [r.getMessage() for r in records if r.levelno >= logging.INFO]
assert len(messages) == 1 and "runs at nice 15" in messages[0], messages
print("ok")
"""


@linux_only
def test_without_the_right_to_raise_a_thread_the_writer_runs_at_nice_15_not_idle(tmp_path):
    # Without CAP_SYS_NICE a thread under SCHED_IDLE can never leave it, so a save training
    # waits for could not be hurried, and a machine that other processes keep busy would
    # leave it almost no CPU. A real refusal: the child runs without the capability.
    import shutil
    import subprocess

    command = [sys.executable, "-c", _UNPRIVILEGED_CHILD, str(tmp_path)]
    if priority.raise_permitted():
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to run a process without CAP_SYS_NICE")
        command = ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice", *command]
    if priority.current() != (0, os.SCHED_OTHER):
        pytest.skip("this test runs at another priority than the usual one")
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def _lowered_thread(hurriable: bool):
    """A thread lowered to nice 19 + SCHED_IDLE, waiting; returns (thread, tid, release, lower)."""
    started, release, again = threading.Event(), threading.Event(), threading.Event()
    tid: list[int] = []

    def run():
        priority.lower(19, idle=True, hurriable=hurriable)
        tid.append(threading.get_native_id())
        started.set()
        while not release.wait(0.01):
            if again.is_set():  # Lower again, as a background thread does at its next job.
                again.clear()
                priority.lower(19, idle=True, hurriable=hurriable)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60)
    return thread, tid[0], release, again


def _can_raise_priorities() -> bool:
    thread, tid, release, _ = _lowered_thread(hurriable=False)
    try:
        priority.apply_priority(tid, priority.current())
        return priority.current(tid) == priority.current()
    finally:
        release.set()
        thread.join(60)


@linux_only
def test_raise_permitted_tells_what_a_raise_of_a_lowered_thread_does(monkeypatch):
    expected = _can_raise_priorities()
    monkeypatch.setattr(priority, "_permitted", None)  # Asked afresh, by its own probe.
    assert priority.raise_permitted() is expected
    assert priority.current() == priority.current(os.getpid())  # The probe changed no thread.
    applied = []
    monkeypatch.setattr(priority, "apply_priority", lambda *args: applied.append(args))
    assert priority.raise_permitted() is expected
    assert applied == []  # Asked once per process: no second probe.


@linux_only
def test_hurry_raises_hurriable_threads_to_the_callers_priority_until_they_lower_again():
    if not _can_raise_priorities():
        pytest.skip("raising a thread's priority needs CAP_SYS_NICE here")
    idle = priority.Priority(19, os.SCHED_IDLE)
    hurriable, h_tid, h_release, h_again = _lowered_thread(hurriable=True)
    other, o_tid, o_release, _ = _lowered_thread(hurriable=False)
    try:
        assert priority.current(h_tid) == idle
        assert priority.hurry() is True
        assert priority.current(h_tid) == priority.current()  # Raised to this thread's.
        assert priority.current(o_tid) == idle  # Not hurriable: left alone.
        h_again.set()  # Its next job: it lowers itself again.
        for _ in range(6000):
            if priority.current(h_tid) == idle:
                break
            threading.Event().wait(0.01)
        assert priority.current(h_tid) == idle
    finally:
        h_release.set()
        o_release.set()
        hurriable.join(60)
        other.join(60)


@linux_only
def test_a_refused_hurry_is_logged_once_and_reported(monkeypatch, caplog):
    # A process whose probe was allowed (``raise_permitted``) but whose raise is refused later.
    monkeypatch.setattr(priority, "_permitted", True)
    thread, _, release, _ = _lowered_thread(hurriable=True)

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(priority, "_refusal_logged", False)
    monkeypatch.setattr(priority.os, "sched_setscheduler", refuse)
    monkeypatch.setattr(priority.os, "setpriority", refuse)
    try:
        with caplog.at_level("WARNING", logger="torchsupervisor"):
            assert priority.hurry() is False
            assert priority.hurry() is False
        warnings = [r for r in caplog.records if "CAP_SYS_NICE" in r.getMessage()]
        assert len(warnings) == 1
        assert "Operation not permitted" in warnings[0].getMessage()
    finally:
        monkeypatch.undo()
        release.set()
        thread.join(60)


@linux_only
@pytest.mark.parametrize("waiter", ["engine.wait", "future.result", "future.exception"])
def test_a_save_waited_for_runs_at_the_waiters_priority_then_idle_again(waiter):
    from torchsupervisor.checkpoint.engine import CheckpointEngine

    if not _can_raise_priorities():
        pytest.skip("raising a thread's priority needs CAP_SYS_NICE here")
    engine = CheckpointEngine()
    gate, running, called_back = threading.Event(), threading.Event(), threading.Event()
    seen: list[priority.Priority] = []
    writer_ids: list[int] = []

    def job():
        writer_ids.append(threading.get_native_id())
        running.set()
        assert gate.wait(60)
        return priority.current()

    def record(_):  # On the writer thread, after the future's waiters were woken.
        seen.append(priority.current())
        called_back.set()

    try:
        future = engine.submit(job)
        future.add_done_callback(record)
        assert running.wait(60)
        assert priority.current(writer_ids[0]) == priority.Priority(19, os.SCHED_IDLE)
        if waiter == "engine.wait":
            assert engine.wait(0.01) is False
        else:
            with pytest.raises(TimeoutError):
                getattr(future, waiter.split(".")[1])(timeout=0.01)
        gate.set()
        assert future.result(60) == priority.current()  # The job ran raised to ours...
        assert called_back.wait(60)
        assert seen == [priority.Priority(19, os.SCHED_IDLE)]  # ...and idle once it ended.
    finally:
        gate.set()
        engine.close()


@linux_only
def test_the_checksum_helper_takes_its_callers_priority_when_each_job_starts():
    from torchsupervisor.checkpoint.commit import _Beside

    idle = priority.Priority(19, os.SCHED_IDLE)

    def from_lowered_thread():
        priority.lower(19, idle=True)
        return _Beside(priority.current).result()

    assert _in_thread(from_lowered_thread) == idle
    if _can_raise_priorities():  # Raising the helper back needs CAP_SYS_NICE.
        assert _Beside(priority.current).result() == priority.current()


@linux_only
def test_upload_parts_go_at_the_priority_of_the_sender_raised_when_it_is_hurried(memory_url):
    from torchsupervisor.storage import ObjectStorage, storage_for

    if not _can_raise_priorities():
        pytest.skip("raising a thread's priority needs CAP_SYS_NICE here")
    storage = ObjectStorage(storage_for(memory_url).client, part_bytes=5 << 20, max_concurrency=2)
    client = storage.client
    started, hurried = threading.Semaphore(0), threading.Event()
    seen: list[priority.Priority] = []
    send = client.upload_part

    def recording(*args, **kwargs):
        seen.append(priority.current())
        started.release()
        assert hurried.wait(60)
        seen.append(priority.current())
        return send(*args, **kwargs)

    client.upload_part = recording

    def put_from_the_writer():  # Lowered and hurriable, as the checkpoint writer is.
        priority.lower(19, idle=True, hurriable=True)
        storage.put(f"{memory_url}/model.bin", [bytes(12 << 20)])  # Three parts.

    writer = threading.Thread(target=put_from_the_writer)
    writer.start()
    try:
        assert started.acquire(timeout=60) and started.acquire(timeout=60)  # Two in flight.
        idle = priority.Priority(19, os.SCHED_IDLE)
        assert seen == [idle, idle]
        assert priority.hurry() is True  # Training waits for the save.
    finally:
        hurried.set()
        writer.join(60)
    normal = priority.current()
    assert seen[2:] == [normal] * 4  # The parts in flight raised, the third one too.


@linux_only
def test_a_writer_raised_while_idle_by_another_engines_wait_runs_its_next_job_idle():
    # ``threads.hurry`` raises every hurriable thread: the idle writer of a second saver too.
    # Its next job must still run at the idle priority, not at the priority of that wait.
    from torchsupervisor.checkpoint.engine import CheckpointEngine

    if not _can_raise_priorities():
        pytest.skip("raising a thread's priority needs CAP_SYS_NICE here")
    idle = priority.Priority(19, os.SCHED_IDLE)
    waited, other = CheckpointEngine(), CheckpointEngine()
    gate, running = threading.Event(), threading.Event()
    seen: list[priority.Priority] = []
    other_writer: list[int] = []

    def record():  # A job that nobody waits for: its future's result is never asked.
        seen.append(priority.current())
        other_writer.append(threading.get_native_id())

    def gated():
        running.set()
        assert gate.wait(60)

    def run_unwaited(engine):
        # ``concurrent.futures.wait`` hurries nothing. It returns once the job is reported
        # done, which the writer does only after lowering itself again: a wait on ``record``'s
        # own return instead raced with that lowering (an idle-priority thread, on a busy
        # machine, may lower itself after the hurry below, and the check then read 19).
        done, _ = concurrent.futures.wait([engine.submit(record)], timeout=60)
        assert done

    try:
        run_unwaited(other)
        assert seen == [idle]
        waited.submit(gated)
        assert running.wait(60)
        assert waited.wait(0.01) is False  # Hurries: raises the other, idle writer too.
        assert priority.current(other_writer[0]) == priority.current()
        gate.set()
        assert waited.wait(60)
        run_unwaited(other)
        assert seen == [idle, idle]
    finally:
        gate.set()
        waited.close()
        other.close()


@linux_only
def test_a_job_hurried_before_it_starts_keeps_the_priority_it_was_raised_to():
    # The writer lowers itself as each job starts; a wait that came first must not be undone.
    from torchsupervisor.checkpoint.engine import _Save

    hurried, plain = _Save(), _Save()
    for future in (hurried, plain):
        future.set_running_or_notify_cancel()
    hurried.hurry()
    caller = priority.current()
    assert (
        _in_thread(lambda: hurried.lower_unless_hurried(19, True) or priority.current()) == caller
    )
    lowered = _in_thread(lambda: plain.lower_unless_hurried(19, True) or priority.current())
    assert lowered == priority.Priority(19, os.SCHED_IDLE)
