"""The writer's bounded queue, its full-queue policies, batching, counters and flush requests."""

from __future__ import annotations

import logging
import os
import sys
import threading

import numpy as np
import pytest
import torch

from torchsupervisor.summary import SessionLog, SummaryWriter, summary_iterator
from torchsupervisor.summary import event_file as event_file_mod
from torchsupervisor.summary.counters import WriterCounters
from torchsupervisor.summary.event_file import DROP_REPORT_SECS, WRITE_BATCH
from torchsupervisor.summary.queue_items import VECTORIZE_MIN_RUN
from torchsupervisor.testing import FakeClock, FaultyStorage, GatedStorage, events_worker_of


def event_files(logdir):
    return sorted(os.path.join(logdir, n) for n in os.listdir(logdir) if "tfevents" in n)


def all_events(logdir):
    return [e for path in event_files(logdir) for e in list(summary_iterator(path))[1:]]


def scalars(events, tag):
    return [(e.step, v.simple_value) for e in events for v in e.summary.value if v.tag == tag]


class HeldWrites:
    """A storage whose every events-file write waits until ``release()``."""

    def __init__(self):
        self.storage = GatedStorage()
        self._gate = self.storage.hold("write", times=None, timeout_secs=30)
        self.entered = self._gate.reached

    def release(self):
        self._gate.open()


def wait_until(predicate, timeout_secs=10.0):
    done = threading.Event()
    for _ in range(int(timeout_secs / 0.005)):
        if predicate():
            return
        done.wait(0.005)
    raise AssertionError("condition not reached in time")


# --------------------------------------------------------------------------- policies


def test_on_full_must_be_block_or_drop(tmp_path):
    with pytest.raises(ValueError, match="on_full must be 'block' or 'drop', got 'wait'"):
        SummaryWriter(tmp_path, on_full="wait")


def test_drop_policy_counts_reports_and_keeps_the_order_of_what_it_keeps(
    tmp_path, monkeypatch, caplog
):
    held = HeldWrites()
    clock = FakeClock(epoch_secs=1_599_999_000.25, auto_advance=False)
    w = SummaryWriter(tmp_path, max_queue=4, on_full="drop", clock=clock, storage=held.storage)
    try:
        w.add_scalar("x", 0.0, 0)
        assert held.entered.wait(10)  # the thread holds event 0 inside its write
        with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
            for step in range(1, 11):  # 4 fit in the queue, 6 are dropped without blocking
                w.add_scalar("x", float(step), step)
            assert caplog.text.count("dropping events") == 1  # then at most once a minute
            clock.advance(DROP_REPORT_SECS)
            w.add_scalar("x", 11.0, 11)
            assert caplog.text.count("dropping events") == 2
            assert "is full (max_queue=4, max_queue_bytes=67108864)" in caplog.text
            assert "7 dropped so far" in caplog.text
        counters = w.counters()
        assert counters.events_dropped == 7
        assert counters.events_pending == 4
        assert counters.blocked_calls == 0
        held.release()
        with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
            w.close()
        assert "7 summary events for" in caplog.text and "were dropped" in caplog.text
    finally:
        held.release()
        w.close()
    assert [s for s, _ in scalars(all_events(tmp_path), "x")] == [0, 1, 2, 3, 4]
    final = w.counters()
    assert (final.events_written, final.events_pending, final.events_dropped) == (5, 0, 7)


def test_block_policy_counts_blocked_calls_and_their_time(tmp_path, caplog):
    held = HeldWrites()
    clock = FakeClock(epoch_secs=1_599_999_000.25, auto_advance=False)
    w = SummaryWriter(tmp_path, max_queue=2, clock=clock, storage=held.storage)
    try:
        w.add_scalar("x", 0.0, 0)
        assert held.entered.wait(10)
        w.add_scalar("x", 1.0, 1)
        w.add_scalar("x", 2.0, 2)
        producer = threading.Thread(target=w.add_scalar, args=("x", 3.0, 3))
        producer.start()
        wait_until(lambda: events_worker_of(w).blocked_producers == 1)
        clock.advance(2.5)  # the caller waits 2.5 s (fake) for room
        held.release()
        producer.join(10)
        assert not producer.is_alive()
        with caplog.at_level(logging.INFO, logger="torchsupervisor"):
            w.close()
        assert "waited 1 times (2.500 s in total)" in caplog.text
    finally:
        held.release()
        w.close()
    counters = w.counters()
    assert counters.blocked_calls == 1
    assert counters.blocked_secs == pytest.approx(2.5)
    assert counters.events_dropped == 0
    assert [s for s, _ in scalars(all_events(tmp_path), "x")] == [0, 1, 2, 3]


def test_memory_bound_of_queued_tensors(tmp_path):
    held = HeldWrites()
    w = SummaryWriter(
        tmp_path, max_queue=1000, max_queue_bytes=100_000, on_full="drop", storage=held.storage
    )
    try:
        w.add_scalar("x", 0.0, 0)
        assert held.entered.wait(10)
        w.add_histogram("h", torch.zeros(20_000), 1)  # 80 kB: fits
        w.add_histogram("h", torch.zeros(10_000), 2)  # 40 kB more would exceed 100 kB
        w.add_scalar("x", 3.0, 3)  # scalars are bounded by max_queue only
        counters = w.counters()
        assert (counters.events_pending, counters.events_dropped) == (2, 1)
        assert events_worker_of(w).pending_bytes == 80_000
        held.release()
        w.flush()
        assert events_worker_of(w).pending_bytes == 0
        w.add_histogram("big", torch.zeros(50_000), 4)  # 200 kB, alone in the queue: accepted
    finally:
        held.release()
        w.close()
    steps = sorted(e.step for e in all_events(tmp_path))
    assert steps == [0, 1, 3, 4]


def test_queued_bytes():
    from tensorboard.compat.proto import event_pb2

    from torchsupervisor.summary.queue_items import HISTOGRAM, RAW_EVENT, TEXT, Item, queued_bytes

    assert queued_bytes((1.0, 0, "x", 1.0)) == 0
    assert queued_bytes(Item((HISTOGRAM, 1.0, 0, "h", torch.zeros(3, 4), "tensorflow"))) == 48
    assert queued_bytes(Item((HISTOGRAM, 1.0, 0, "h", np.zeros(5), "tensorflow"))) == 40
    assert queued_bytes(Item((TEXT, 1.0, 0, "t", np.array(["ab"]), None))) == 8
    event = event_pb2.Event(wall_time=1.5, step=3)
    assert queued_bytes(Item((RAW_EVENT, event, None))) == event.ByteSize() == 11


def test_unbounded_queue_never_blocks_or_drops(tmp_path):
    held = HeldWrites()
    w = SummaryWriter(tmp_path, max_queue=0, on_full="drop", storage=held.storage)
    try:
        w.add_scalar("x", 0.0, 0)
        assert held.entered.wait(10)
        for step in range(1, 3 * WRITE_BATCH):
            w.add_scalar("x", float(step), step)
        assert w.counters().events_pending == 3 * WRITE_BATCH - 1
        held.release()
    finally:
        held.release()
        w.close()
    counters = w.counters()
    assert counters.events_written == 3 * WRITE_BATCH
    assert counters.events_dropped == counters.blocked_calls == 0


# --------------------------------------------------------------------------- batching, flushing


def test_events_are_written_together_after_the_first_batch(tmp_path):
    writes = []
    written = threading.Event()

    def write(path):
        writes.append(path)
        written.set()

    storage = FaultyStorage()
    storage.watch("write", write)
    clock = FakeClock(epoch_secs=1_599_999_000.25, auto_advance=False)
    # Writes at once from 50 pending.
    w = SummaryWriter(tmp_path, max_queue=100, clock=clock, storage=storage)
    try:
        w.add_scalar("x", 0.0, 0)
        assert written.wait(10)  # a new file's first event: written (and flushed) at once
        written.clear()
        clock.timed_wait_started.clear()
        for step in range(1, 11):
            w.add_scalar("x", float(step), step)
        assert clock.timed_wait_started.wait(10)  # waiting up to write_delay_secs for more
        assert not written.is_set()
        clock.advance(SummaryWriter.write_delay_secs)
        assert written.wait(10)
        assert len(writes) == 2  # events 1-10 in one write call
        written.clear()
        for step in range(11, 61):  # 50 pending: written without waiting for the delay
            w.add_scalar("x", float(step), step)
        assert written.wait(10)
    finally:
        w.close()
    assert [s for s, _ in scalars(all_events(tmp_path), "x")] == list(range(61))


def test_request_flush_writes_and_syncs_without_waiting(tmp_path):
    synced = threading.Event()
    storage = FaultyStorage()
    storage.watch("fsync", lambda path: synced.set())
    clock = FakeClock(epoch_secs=1_599_999_000.25, auto_advance=False)
    w = SummaryWriter(tmp_path, flush_secs=1e9, clock=clock, storage=storage)
    try:
        w.add_scalar("x", 0.0, 0)
        assert synced.wait(10)  # the first batch of a file is flushed at once
        wait_until(lambda: w.counters().flushes == 1)
        synced.clear()
        w.add_scalar("x", 1.0, 1)
        w.add_session_log(SessionLog(status=SessionLog.CHECKPOINT, checkpoint_path="p"), 1)
        w.request_flush()  # returns at once; the fake clock never reaches the write delay
        assert synced.wait(10)
        (path,) = event_files(tmp_path)
        events = list(summary_iterator(path))[1:]
        assert [e.step for e in events] == [0, 1, 1]
        assert events[-1].session_log.status == SessionLog.CHECKPOINT
        wait_until(lambda: w.counters().flushes == 2)  # Counted once the fsync returned.
    finally:
        w.close()
    w.request_flush()  # a no-op once closed
    w.flush()


def test_flush_of_an_idle_writer_returns(tmp_path):
    with SummaryWriter(tmp_path) as w:
        w.flush()
        w.add_scalar("x", 1.0, 1)
        w.flush()
        w.flush()
    assert w.counters().events_written == 1


# --------------------------------------------------------------------------- encoding in batches


def test_long_runs_mixed_with_other_events_keep_their_order(tmp_path):
    stream = []
    with SummaryWriter(tmp_path, max_queue=0) as w:
        for block in range(3):
            for i in range(VECTORIZE_MIN_RUN * 3):
                step = block * 1000 + i
                w.add_scalar(f"t{i % 5}", float(step), step)
                stream.append(("s", step))
            w.add_session_log(SessionLog(status=SessionLog.START), block * 1000)
            stream.append(("log", block * 1000))
            w.add_histogram("h", np.arange(4.0), block)
            stream.append(("h", block))
    kinds = []
    for e in all_events(tmp_path):
        if e.HasField("session_log"):
            kinds.append(("log", e.step))
        elif e.summary.value[0].HasField("histo"):
            kinds.append(("h", e.step))
        else:
            kinds.append(("s", e.step))
            assert e.summary.value[0].simple_value == float(e.step)
    assert kinds == stream


def test_bad_items_in_a_long_run_are_dropped_and_logged(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="torchsupervisor"), SummaryWriter(tmp_path) as w:
        worker = events_worker_of(w)
        worker.batch_at = worker.wake_at = 10**6  # one batch at close
        for step in range(VECTORIZE_MIN_RUN * 2):
            if step == 10:
                w.add_scalar("meta", torch.zeros((), device="meta"), step)  # cannot be read
            elif step == 20:  # Outside the int64 range of Event.step: raised at the call.
                with pytest.raises(ValueError, match="outside the int64 range"):
                    w.add_scalar("huge", 1.0, 2**64)
            else:
                w.add_scalar("x", float(step), step)
        w.add_scalar("y", 5.0, torch.tensor(7))
    assert "Dropping summary 'meta'" in caplog.text
    events = all_events(tmp_path)
    expected = [(s, float(s)) for s in range(VECTORIZE_MIN_RUN * 2) if s not in (10, 20)]
    assert scalars(events, "x") == expected
    assert scalars(events, "y") == [(7, 5.0)]
    assert w.counters().events_lost == 1


def test_counters_add_up_over_reopen(tmp_path):
    w = SummaryWriter(tmp_path)
    for step in range(3):
        w.add_scalar("x", 1.0, step)
    w.close()
    w.reopen()
    w.add_scalar("x", 1.0, 3)
    w.close()
    counters = w.counters()
    assert counters.events_written == 4
    assert counters.batches >= 2 and counters.flushes >= 2
    on_disk = sum(os.path.getsize(p) for p in event_files(tmp_path))
    assert counters.bytes_written == on_disk
    assert WriterCounters(events_written=1) + WriterCounters(events_written=2) == WriterCounters(
        events_written=3
    )


# --------------------------------------------------------------------------- thread priority


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority: Linux")
def test_writer_thread_priority(tmp_path):
    class LowPriority(SummaryWriter):
        thread_niceness = 7

    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base > 7:
        pytest.skip("the test process already runs at a lower priority")
    seen = []
    for cls in (SummaryWriter, LowPriority):
        w = cls(tmp_path / cls.__name__)
        try:
            worker = events_worker_of(w)
            wait_until(lambda worker=worker: worker.idle)
            thread = worker.thread
            seen.append(os.getpriority(os.PRIO_PROCESS, thread.native_id))
        finally:
            w.close()
    assert seen == [base, 7]


def test_a_failing_writer_thread_never_leaves_callers_waiting(tmp_path, monkeypatch, caplog):
    def broken(self, batch):
        raise RuntimeError("bug in the writer")

    monkeypatch.setattr(event_file_mod.EventFileWriter, "_process", broken)
    w = SummaryWriter(tmp_path, max_queue=2)
    with caplog.at_level(logging.ERROR, logger="torchsupervisor"):
        w.add_scalar("x", 1.0, 1)
        w.flush()  # returns: the thread died, and released the flush marker of its batch
        events_worker_of(w).thread.join(10)
    assert "The summary writer thread for" in caplog.text and "bug in the writer" in caplog.text
    for step in range(5):  # the queue is closed now: no caller blocks on it
        w.add_scalar("x", 1.0, step)
    w.close()
