from __future__ import annotations

import errno
import gc
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
from tensorboard.compat.proto import event_pb2, summary_pb2

from torchsupervisor import errors
from torchsupervisor.core.global_step import GlobalStep
from torchsupervisor.summary import (
    FileWriter,
    FileWriterCache,
    SessionLog,
    SummaryWriter,
    SummaryWriterCache,
    image_pb,
    scalar_pb,
    summary_iterator,
    text_pb,
)
from torchsupervisor.summary.scalar_event import scalar_event_bytes
from torchsupervisor.testing import FakeClock, FaultyStorage, GatedStorage, events_worker_of

HOST = socket.gethostname()
T0 = 1_600_000_000
CLOSED_WARNING = (
    "Attempting to use a closed FileWriter. The operation will be a noop unless the "
    "FileWriter is explicitly reopened."
)


def event_files(logdir):
    return sorted(os.path.join(logdir, n) for n in os.listdir(logdir) if "tfevents" in n)


def read_events(path):
    return list(summary_iterator(path))


def all_events(logdir):
    return [e for path in event_files(logdir) for e in read_events(path)]


def scalars(events, tag):
    return [
        (e.step, v.simple_value)
        for e in events
        for v in e.summary.value
        if v.tag == tag and v.HasField("simple_value")
    ]


def wait_until(predicate, timeout_secs=10.0):
    """Poll ``predicate`` (a condition of the code under test, not a delay) until it holds."""
    done = threading.Event()
    for _ in range(int(timeout_secs / 0.005)):
        if predicate():
            return
        done.wait(0.005)
    raise AssertionError("condition not reached in time")


# --------------------------------------------------------------------------- files


def test_file_is_created_lazily_with_tf_name_and_first_record(tmp_path, fake_clock):
    logdir = tmp_path / "logs" / "run"
    w = SummaryWriter(logdir, clock=fake_clock, filename_suffix=".v2")
    try:
        assert logdir.is_dir() and os.listdir(logdir) == []
        assert w.get_logdir() == str(logdir)
        w.add_scalar("x", 1.0, 3)
        w.flush()
        assert os.listdir(logdir) == [f"events.out.tfevents.{T0}.{HOST}.v2"]
        first, second = read_events(event_files(logdir)[0])
        assert first.file_version == "brain.Event:2"
        assert first.wall_time == float(T0)
        assert not first.HasField("summary")
        assert second.wall_time == T0 + 0.25 and second.step == 3
        assert second.summary.value[0].tag == "x" and second.summary.value[0].simple_value == 1.0
    finally:
        w.close()


def test_real_clock_file_name_format(tmp_path):
    with FileWriter(tmp_path) as w:
        w.add_scalar("x", 1.0)
    (name,) = os.listdir(tmp_path)
    assert re.fullmatch(r"events\.out\.tfevents\.\d{10}\." + re.escape(HOST), name)
    assert FileWriter is SummaryWriter


def test_same_second_uses_next_free_second(tmp_path):
    clock = FakeClock(epoch_secs=T0 + 0.9 - 1000.0, auto_advance=False)
    writers = [SummaryWriter(tmp_path, clock=clock) for _ in range(3)]
    try:
        for i, w in enumerate(writers):
            w.add_scalar("x", float(i), i)
            w.flush()
        names = [os.path.basename(p) for p in event_files(tmp_path)]
        assert names == [f"events.out.tfevents.{T0 + i}.{HOST}" for i in range(3)]
        for i, path in enumerate(event_files(tmp_path)):
            version, event = read_events(path)
            assert version.wall_time == T0 + i  # the same second as the name
            assert scalars([event], "x") == [(i, float(i))]  # lexicographic = creation order
    finally:
        for w in writers:
            w.close()


# --------------------------------------------------------------------------- TF methods


def test_add_summary_proto_bytes_and_steps(tmp_path, fake_clock):
    with SummaryWriter(tmp_path, clock=fake_clock) as w:
        w.add_summary(scalar_pb("a", 1.0), global_step=3)
        fake_clock.advance(1.5)
        w.add_summary(scalar_pb("b", 2.0).SerializeToString())
        w.add_summary(scalar_pb("c", 3.0), global_step=torch.tensor(7))
        w.add_summary(scalar_pb("d", 4.0), global_step=GlobalStep(9))
        with pytest.raises(TypeError, match="got int"):
            w.add_summary(5)
        with pytest.raises(errors.InvalidArgumentError, match="could not parse"):
            w.add_summary(b"\xff\xff\xff\xff")
    events = read_events(event_files(tmp_path)[0])[1:]
    assert [(e.summary.value[0].tag, e.step) for e in events] == [
        ("a", 3),
        ("b", 0),
        ("c", 7),
        ("d", 9),
    ]
    assert events[0].wall_time == T0 + 0.25
    assert events[1].wall_time == T0 + 1.75


def test_add_summary_copies_the_proto(tmp_path):
    summary = scalar_pb("a", 1.0)
    with SummaryWriter(tmp_path) as w:
        w.add_summary(summary, 1)
        summary.value[0].simple_value = 99.0
    assert scalars(all_events(tmp_path), "a") == [(1, 1.0)]


def test_only_first_occurrence_of_a_tag_keeps_metadata(tmp_path):
    with SummaryWriter(tmp_path) as w:
        w.add_summary(text_pb("t", "a"), 1)
        w.add_summary(text_pb("t", "b"), 2)
        w.add_text("t", "c", 3)
        w.add_text("u", "d", 1)
        w.add_text("u", "e", 2)
    values = [(e.step, v) for e in all_events(tmp_path) for v in e.summary.value]
    with_metadata = [(v.tag, step) for step, v in values if v.HasField("metadata")]
    assert with_metadata == [("t", 1), ("u", 1)]
    assert len(values) == 5


def test_session_logs(tmp_path, fake_clock):
    with SummaryWriter(tmp_path, clock=fake_clock) as w:
        w.add_session_log(SessionLog(status=SessionLog.START), 5)
        w.add_session_log(
            SessionLog(status=SessionLog.CHECKPOINT, checkpoint_path="/ckpt/model.ckpt"), 6
        )
        w.add_session_log(SessionLog(status=SessionLog.STOP))
        with pytest.raises(TypeError, match="SessionLog"):
            w.add_session_log("START")
    events = read_events(event_files(tmp_path)[0])[1:]
    assert [(e.session_log.status, e.step) for e in events] == [
        (SessionLog.START, 5),
        (SessionLog.CHECKPOINT, 6),
        (SessionLog.STOP, 0),
    ]
    assert events[1].session_log.checkpoint_path == "/ckpt/model.ckpt"
    assert all(e.wall_time == T0 + 0.25 for e in events)


def test_add_event_is_written_as_given(tmp_path, fake_clock):
    event = event_pb2.Event(wall_time=12.5, step=4)
    event.summary.value.add(tag="raw", simple_value=2.0)
    with SummaryWriter(tmp_path, clock=fake_clock) as w:
        w.add_event(event)
        event.step = 99
        with pytest.raises(TypeError, match="Event"):
            w.add_event(scalar_pb("x", 1.0))
    (written,) = read_events(event_files(tmp_path)[0])[1:]
    assert (written.wall_time, written.step, written.summary.value[0].tag) == (12.5, 4, "raw")


def test_close_warn_reopen_new_file(tmp_path, fake_clock, caplog):
    w = SummaryWriter(tmp_path, clock=fake_clock)
    w.add_scalar("x", 1.0, 1)
    w.close()
    w.close()  # idempotent
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        w.add_scalar("x", 2.0, 2)
        w.add_summary(scalar_pb("y", 1.0), 2)
        w.add_session_log(SessionLog(status=SessionLog.STOP))
        w.flush()  # no-op
    assert caplog.text.count(CLOSED_WARNING) == 3
    assert len(event_files(tmp_path)) == 1
    fake_clock.advance(10)
    w.reopen()
    w.reopen()  # no-op when open
    w.add_scalar("x", 3.0, 3)
    w.close()
    first, second = event_files(tmp_path)
    assert os.path.basename(second) == f"events.out.tfevents.{T0 + 10}.{HOST}"
    assert scalars(read_events(first), "x") == [(1, 1.0)]
    assert scalars(read_events(second), "x") == [(3, 3.0)]
    assert read_events(second)[0].file_version == "brain.Event:2"


def test_context_manager_closes(tmp_path, caplog):
    with SummaryWriter(tmp_path) as w:
        w.add_scalar("x", 1.0, 1)
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        w.add_scalar("x", 2.0, 2)
    assert CLOSED_WARNING in caplog.text
    assert scalars(all_events(tmp_path), "x") == [(1, 1.0)]


# --------------------------------------------------------------------------- flushing


def test_flush_returns_after_everything_is_written_and_synced(tmp_path):
    storage = FaultyStorage()
    w = SummaryWriter(tmp_path, max_queue=1000, flush_secs=1e9, storage=storage)
    try:
        for i in range(500):
            w.add_scalar("x", float(i), i)
        w.flush()
        assert [op for op, _ in storage.calls if op in ("write", "fsync")][-1] == "fsync"
        assert scalars(read_events(event_files(tmp_path)[0]), "x") == [
            (i, float(i)) for i in range(500)
        ]
        w.flush()  # nothing new: returns at once
    finally:
        w.close()


def test_flush_from_several_threads(tmp_path):
    w = SummaryWriter(tmp_path, max_queue=8)
    seen = {}

    def work(k):
        for i in range(50):
            w.add_scalar(f"t{k}", float(i), i)
        w.flush()
        seen[k] = len(scalars(read_events(event_files(tmp_path)[0]), f"t{k}"))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
            assert not t.is_alive()
    finally:
        w.close()
    assert seen == {k: 50 for k in range(4)}


def test_first_event_flushed_at_once_then_batched_and_flushed_every_flush_secs(
    tmp_path, fake_clock
):
    written, synced = threading.Event(), threading.Event()
    fsyncs = []

    def fsync(path):
        fsyncs.append(fake_clock.monotonic())
        synced.set()

    storage = FaultyStorage()
    storage.watch("write", lambda path: written.set())
    storage.watch("fsync", fsync)
    w = SummaryWriter(tmp_path, flush_secs=60, clock=fake_clock, storage=storage)
    try:
        w.add_scalar("x", 1.0, 1)
        assert synced.wait(10)
        # The writer thread is idle again: the flush is complete (its deadline is set).
        wait_until(lambda: w.counters().flushes == 1 and events_worker_of(w).idle)
        assert len(fsyncs) == 1
        written.clear()
        synced.clear()
        fake_clock.timed_wait_started.clear()
        fake_clock.advance(5)
        w.add_scalar("x", 2.0, 2)
        # Later events wait up to write_delay_secs for more to share their write.
        assert fake_clock.timed_wait_started.wait(10)
        assert fake_clock.timed_waits[-1] == pytest.approx(SummaryWriter.write_delay_secs)
        assert not written.is_set()
        fake_clock.timed_wait_started.clear()
        fake_clock.advance(SummaryWriter.write_delay_secs)
        assert written.wait(10)
        # The writer goes idle until the flush deadline: 60 s after the first flush.
        assert fake_clock.timed_wait_started.wait(10)
        assert fake_clock.timed_waits[-1] == pytest.approx(55.0 - SummaryWriter.write_delay_secs)
        assert len(fsyncs) == 1
        fake_clock.advance(56)
        assert synced.wait(10)
        assert fsyncs == [1000.0, 1061.0 + SummaryWriter.write_delay_secs]
    finally:
        w.close()


def test_max_queue_blocks_the_caller(tmp_path):
    storage = GatedStorage()
    gate = storage.hold("write", timeout_secs=30)
    w = SummaryWriter(tmp_path, max_queue=2, storage=storage)
    try:
        w.add_scalar("x", 0.0, 0)
        assert gate.reached.wait(10)  # the writer thread holds event 0 and is stuck writing it
        w.add_scalar("x", 1.0, 1)
        w.add_scalar("x", 2.0, 2)  # queue now full (2 pending)
        producer = threading.Thread(target=w.add_scalar, args=("x", 3.0, 3))
        producer.start()
        wait_until(lambda: events_worker_of(w).blocked_producers == 1)
        assert producer.is_alive()
        gate.open()
        producer.join(10)
        assert not producer.is_alive()
    finally:
        gate.open()
        w.close()
    assert [s for s, _ in scalars(all_events(tmp_path), "x")] == [0, 1, 2, 3]


def test_close_drains_pending_events(tmp_path):
    w = SummaryWriter(tmp_path, max_queue=0, flush_secs=1e9)
    for i in range(2000):
        w.add_scalar("x", float(i), i)
    w.close()
    assert len(scalars(all_events(tmp_path), "x")) == 2000


# --------------------------------------------------------------------------- errors


def test_write_error_is_logged_and_next_event_opens_new_file(tmp_path, fake_clock, caplog):
    storage = FaultyStorage()
    storage.fail("write", nth=2, errno=errno.ENOSPC)
    w = SummaryWriter(tmp_path, clock=fake_clock, storage=storage)
    try:
        w.add_scalar("x", 1.0, 1)
        w.flush()
        (first,) = event_files(tmp_path)
        with caplog.at_level(logging.ERROR, logger="torchsupervisor"):
            w.add_scalar("x", 2.0, 2)
            w.flush()  # returns although the batch was lost
        assert "Failed to write 1 events to " + first in caplog.text
        assert "No space left on device" in caplog.text
        w.add_scalar("x", 3.0, 3)
    finally:
        w.close()
    first, second = event_files(tmp_path)
    assert scalars(read_events(first), "x") == [(1, 1.0)]
    assert read_events(second)[0].file_version == "brain.Event:2"
    assert scalars(read_events(second), "x") == [(3, 3.0)]


def test_metadata_of_a_lost_batch_is_written_again(tmp_path):
    storage = FaultyStorage()
    storage.fail("write", errno=errno.EIO)
    with SummaryWriter(tmp_path, storage=storage) as w:
        w.add_text("t", "lost", 1)
        w.flush()
        w.add_text("t", "kept", 2)
        w.add_text("t", "again", 3)
    values = [(e.step, v) for e in all_events(tmp_path) for v in e.summary.value]
    assert [(step, v.HasField("metadata")) for step, v in values] == [(2, True), (3, False)]


def test_fsync_error_is_logged_and_next_event_opens_new_file(tmp_path, fake_clock, caplog):
    storage = FaultyStorage()
    storage.fail("fsync", errno=errno.EIO)
    w = SummaryWriter(tmp_path, clock=fake_clock, storage=storage)
    with caplog.at_level(logging.ERROR, logger="torchsupervisor"):
        w.add_scalar("x", 1.0, 1)
        w.flush()
    (first,) = event_files(tmp_path)
    assert f"Failed to flush {first}" in caplog.text
    w.add_scalar("x", 2.0, 2)
    w.close()
    first, second = event_files(tmp_path)
    assert scalars(read_events(first), "x") == [(1, 1.0)]
    assert scalars(read_events(second), "x") == [(2, 2.0)]


def test_create_error_is_logged_and_retried(tmp_path, caplog):
    storage = FaultyStorage()
    storage.fail("open", errno=errno.EACCES)
    w = SummaryWriter(tmp_path, storage=storage)
    with caplog.at_level(logging.ERROR, logger="torchsupervisor"):
        w.add_scalar("x", 1.0, 1)
        w.flush()
    assert f"Failed to create an events file in {tmp_path}" in caplog.text
    assert event_files(tmp_path) == []
    w.add_scalar("x", 2.0, 2)
    w.close()
    assert scalars(all_events(tmp_path), "x") == [(2, 2.0)]


def test_encoding_error_is_logged_and_other_events_written(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="torchsupervisor"), SummaryWriter(tmp_path) as w:
        w.add_histogram("bad", torch.tensor([1.0, float("nan")]), 1)
        w.add_scalar("x", 1.0, 1)
    assert "Nan in summary histogram for: bad" in caplog.text
    assert "'bad'" in caplog.text
    events = all_events(tmp_path)
    assert [v.tag for e in events for v in e.summary.value] == ["x"]


def test_caller_side_validation(tmp_path):
    with SummaryWriter(tmp_path) as w:
        with pytest.raises(TypeError, match="tag must be a str"):
            w.add_scalar(1, 1.0)
        with pytest.raises(errors.InvalidArgumentError, match=r"\[\] != \[2\]"):
            w.add_scalar("x", torch.zeros(2))
        with pytest.raises(ValueError, match="dataformats"):
            w.add_image("i", torch.zeros(3, 4, 4), dataformats="NCHW")
        with pytest.raises(ValueError, match="does not match"):
            w.add_image("i", torch.zeros(4, 4), dataformats="CHW")
        with pytest.raises(ValueError, match="bins"):
            w.add_histogram("h", [1.0], bins="bogus")
        with pytest.raises(ValueError, match="bins"):
            w.add_histogram("h", [1.0], bins=0)
        with pytest.raises(errors.InvalidArgumentError, match="sample_rate must be > 0"):
            w.add_audio("a", torch.zeros(4), sample_rate=0)
        with pytest.raises(ValueError, match=r"\[L\] or \[1, L\]"):
            w.add_audio("a", torch.zeros(2, 4))
        with pytest.raises(errors.InvalidArgumentError, match="expects a string"):
            w.add_text("t", 5)
    assert event_files(tmp_path) == []


# --------------------------------------------------------------------------- values


def test_values_are_snapshotted_at_enqueue(tmp_path):
    t = torch.tensor(1.0)
    h = torch.zeros(4)
    step_t = torch.tensor(3)
    gs = GlobalStep(4)
    arr = np.zeros(3)
    with SummaryWriter(tmp_path) as w:
        w.add_scalar("s", t, 1)
        w.add_histogram("h", h, 1)
        w.add_histogram("a", arr, 1)
        w.add_scalar("s2", 2.0, step_t)
        w.add_scalar("s3", 1.0, gs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            w.add_scalar("g", torch.tensor(2.0, requires_grad=True) * 2, 1)
        w.add_scalar("np", np.float32(1.5), np.int64(2))
        w.add_scalar("i", 7, 1)
        t.fill_(5.0)
        h.fill_(1.0)
        arr.fill(1.0)
        step_t.fill_(9)
        gs.increment()
    events = all_events(tmp_path)
    assert scalars(events, "s") == [(1, 1.0)]
    assert scalars(events, "s2") == [(3, 2.0)]
    assert scalars(events, "s3") == [(4, 1.0)]
    assert scalars(events, "g") == [(1, 4.0)]
    assert scalars(events, "np") == [(2, 1.5)]
    assert scalars(events, "i") == [(1, 7.0)]
    sums = {v.tag: v.histo.sum for e in events for v in e.summary.value if v.HasField("histo")}
    assert sums == {"h": 0.0, "a": 0.0}


def test_walltime_argument(tmp_path):
    with SummaryWriter(tmp_path) as w:
        w.add_scalar("x", 1.0, 1, walltime=123.5)
        w.add_text("t", "x", 1, walltime=124.5)
    events = read_events(event_files(tmp_path)[0])[1:]
    assert [e.wall_time for e in events] == [123.5, 124.5]


@pytest.mark.parametrize(
    ("wall", "step", "tag", "value"),
    [
        (0.0, None, "a", 0.0),
        (-0.0, 0, "", -0.0),
        (1.6e9, 1, "loss", 0.1),
        (1.5, -1, "x" * 200, 1e40),
        (1.5, 2**62, "é/ü", -1e40),
        (1.5, 300, "t", float("nan")),
        (1.5, 128, "t", float("inf")),
        (1.5, 16384, "t", 3.4028235677973366e38 * (1 + 1e-9)),
    ],
)
def test_fast_scalar_encoding_is_byte_identical_to_protobuf(wall, step, tag, value):
    expected = event_pb2.Event(wall_time=wall)
    expected.summary.value.add(tag=tag, simple_value=value)
    if step is not None:
        expected.step = step
    heads = {}
    for _ in range(2):  # second time from the tag cache
        got = scalar_event_bytes(wall, step, tag, value, heads)
        assert got == expected.SerializeToString()


# --------------------------------------------------------------------------- TensorBoard


def _accumulator(logdir):
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(
        str(logdir),
        size_guidance={
            ea.COMPRESSED_HISTOGRAMS: 0,
            ea.HISTOGRAMS: 0,
            ea.IMAGES: 0,
            ea.AUDIO: 0,
            ea.SCALARS: 0,
            ea.TENSORS: 0,
        },
    )
    acc.Reload()
    return acc


def test_tensorboard_reads_everything(tmp_path):
    import io

    from PIL import Image
    from tensorboard.util import tensor_util

    rng = np.random.default_rng(0)
    chw = rng.integers(0, 256, size=(3, 4, 5), dtype=np.uint8)
    with SummaryWriter(tmp_path) as w:
        for step in range(5):
            w.add_scalar("loss", 1.0 / (step + 1), step)
        w.add_histogram("w", np.arange(10.0), 2)
        w.add_histogram("w", torch.arange(5.0), 3, bins=[0.0, 2.0, 4.0])
        w.add_image("img", torch.from_numpy(chw), 1)
        w.add_image("gray", np.full((2, 3), 0.5), 1, dataformats="HW")
        w.add_audio("snd", torch.linspace(-1, 1, 50), 1, sample_rate=8000)
        w.add_text("note", "hello", 1)
        w.add_summary(image_pb("batch", rng.random((2, 4, 4, 3)), max_outputs=2), 4)
    acc = _accumulator(tmp_path)
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [0, 1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([1.0 / (s + 1) for s in range(5)])
    histos = acc.Histograms("w")
    assert [h.step for h in histos] == [2, 3]
    assert histos[0].histogram_value.num == 10 and histos[0].histogram_value.max == 9.0
    assert histos[1].histogram_value.bucket == [2.0, 3.0]
    assert histos[1].histogram_value.bucket_limit == [2.0, 4.0]
    (img,) = acc.Images("img")
    assert (img.step, img.width, img.height) == (1, 5, 4)
    decoded = np.asarray(Image.open(io.BytesIO(img.encoded_image_string)))
    np.testing.assert_array_equal(decoded, chw.transpose(1, 2, 0))
    (gray,) = acc.Images("gray")
    gray_pixels = np.asarray(Image.open(io.BytesIO(gray.encoded_image_string)))
    assert gray_pixels.tolist() == [[127, 127, 127]] * 2
    assert [i.step for i in acc.Images("batch/image/1")] == [4]
    (snd,) = acc.Audio("snd")
    assert (snd.step, snd.sample_rate, snd.length_frames) == (1, 8000, 50)
    assert snd.content_type == "audio/wav"
    (note,) = acc.Tensors("note")
    assert tensor_util.make_ndarray(note.tensor_proto).item() == b"hello"
    assert "note" in acc.PluginTagToContent("text")


def test_tensorboard_purges_stale_points_at_restart(tmp_path):
    clock = FakeClock(epoch_secs=T0 + 0.5 - 1000.0, auto_advance=False)
    with SummaryWriter(tmp_path, clock=clock) as w:
        for step in range(10):
            w.add_scalar("loss", float(step), step)
    # Restart from a checkpoint at step 5 within the same second: the new file must sort last.
    with SummaryWriter(tmp_path, clock=clock) as w:
        w.add_session_log(SessionLog(status=SessionLog.START), 5)
        for step in range(5, 8):
            w.add_scalar("loss", 100.0 + step, step)
    assert len(event_files(tmp_path)) == 2
    loss = _accumulator(tmp_path).Scalars("loss")
    assert [(e.step, e.value) for e in loss] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
        (5, 105.0),
        (6, 106.0),
        (7, 107.0),
    ]


# --------------------------------------------------------------------------- threads, cache


def test_concurrent_producers_keep_per_thread_order(tmp_path):
    w = SummaryWriter(tmp_path, max_queue=16)

    def produce(k):
        for i in range(300):
            w.add_scalar(f"t{k}", float(i), i)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    w.close()
    events = all_events(tmp_path)
    for k in range(4):
        assert [s for s, _ in scalars(events, f"t{k}")] == list(range(300))


def test_writer_cache(tmp_path, caplog):
    try:
        a = SummaryWriterCache.get(tmp_path / "x")
        assert SummaryWriterCache.get(str(tmp_path / "x") + os.sep) is a
        assert SummaryWriterCache.get(tmp_path / "y") is not a
        assert FileWriterCache is SummaryWriterCache
        a.add_scalar("x", 1.0, 1)
        SummaryWriterCache.clear()
        with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
            a.add_scalar("x", 2.0, 2)
        assert CLOSED_WARNING in caplog.text
        assert SummaryWriterCache.get(tmp_path / "x") is not a
    finally:
        SummaryWriterCache.clear()
    assert scalars(all_events(tmp_path / "x"), "x") == [(1, 1.0)]


def test_collected_writer_stops_its_thread(tmp_path):
    w = SummaryWriter(tmp_path)
    w.add_scalar("x", 1.0, 1)
    thread = events_worker_of(w).thread
    del w
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
    assert scalars(all_events(tmp_path), "x") == [(1, 1.0)]


def test_pending_events_are_written_at_interpreter_exit(tmp_path):
    script = (
        "import sys\n"
        "from torchsupervisor.summary import SummaryWriter\n"
        "w = SummaryWriter(sys.argv[1], max_queue=0, flush_secs=1e9)\n"
        "for i in range(20000):\n"
        "    w.add_scalar('x', float(i), i)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, env=env, timeout=120)
    assert len(scalars(all_events(tmp_path), "x")) == 20000


def test_summary_iterator_reports_bad_records(tmp_path):
    from torchsupervisor.summary import records

    path = tmp_path / "events.out.tfevents.1.h"
    good = event_pb2.Event(wall_time=1.0, file_version="brain.Event:2").SerializeToString()
    path.write_bytes(records.encode_record(good) + records.encode_record(b"\xff\xff\xff"))
    it = summary_iterator(path)
    assert next(it).file_version == "brain.Event:2"
    offset = len(good) + 16
    with pytest.raises(errors.DataLossError, match=f"byte offset {offset} in .*not a valid Event"):
        next(it)
    raw = path.read_bytes()
    path.write_bytes(raw[: offset + 3])
    with pytest.raises(errors.DataLossError, match="truncated"):
        list(summary_iterator(path))


def test_summary_proto_classes_exported():
    from torchsupervisor import summary

    assert summary.Summary is summary_pb2.Summary
    assert summary.Event is event_pb2.Event
    assert summary.SessionLog is event_pb2.SessionLog
    assert summary.HistogramProto().DESCRIPTOR.name == "HistogramProto"
    assert set(summary.__all__) <= set(dir(summary))


def test_tf_positional_arguments(tmp_path):
    # TF: FileWriter(logdir, graph, max_queue, flush_secs, graph_def, filename_suffix, session).
    w = FileWriter(str(tmp_path), None, 100, 60, None, ".tf-order", None)
    w.add_scalar("x", 1.0, 1)
    w.close()
    (name,) = os.listdir(tmp_path)
    assert name.startswith("events.out.tfevents.") and name.endswith(".tf-order")
