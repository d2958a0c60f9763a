"""Values on a non-CPU device: copied on the caller's thread, read on the writer thread.

``snapshot.py`` promises that ``add_*`` never reads a tensor of another device on the caller's
thread (no ``.item()``, no ``float()``, no ``.cpu()``: each would wait for the device). These
tests use tensors on the ``meta`` device: a plain one cannot be read at all (so a read on the
caller's thread would raise there), and a ``Tensor`` subclass records which thread calls what
and answers the reads with a known value.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import torch

from torchsupervisor.summary import SummaryWriter, summary_iterator
from torchsupervisor.summary.queue_items import VECTORIZE_MIN_RUN
from torchsupervisor.summary.snapshot import (
    DeviceCopy,
    snapshot_array,
    snapshot_scalar,
    snapshot_step,
)
from torchsupervisor.testing import events_worker_of

READS = frozenset(
    {
        "item",
        "__float__",
        "__int__",
        "__index__",
        "__bool__",
        "__array__",
        "__format__",
        "__repr__",
        "cpu",
        "to",
        "numpy",
        "tolist",
    }
)
"""What reads a tensor's data (so, on a CUDA tensor, waits for its device)."""


def recording_tensor(value: float, calls: list[tuple[str, str]]) -> torch.Tensor:
    """A one-element tensor on the ``meta`` device that logs ``(operation, thread name)``.

    Reads (``READS``) return ``value`` (as a CPU tensor for ``cpu``/``to``); every other
    operation runs on the meta tensor and gives back the subclass, so copies record too.
    """

    class Recording(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", repr(func))
            if name == "__get__":  # a property, e.g. Tensor.is_cpu
                name = getattr(getattr(func, "__self__", None), "__name__", name)
            calls.append((name, threading.current_thread().name))
            if name in ("item", "__float__"):
                return value
            if name in ("__int__", "__index__"):
                return int(value)
            if name in ("cpu", "to"):
                return torch.tensor(value)
            if name in ("numpy", "__array__"):
                return np.asarray(value)
            if name == "tolist":
                return value
            return super().__torch_function__(func, types, args, kwargs)

    return torch.Tensor._make_subclass(Recording, torch.empty((), device="meta"))


def writer_thread_name(logdir) -> str:
    return f"torchsupervisor-summary-writer:{os.fspath(logdir)}"


def events_of(logdir):
    names = sorted(n for n in os.listdir(logdir) if "tfevents" in n)
    return [e for n in names for e in list(summary_iterator(os.path.join(logdir, n)))[1:]]


def scalars(events, tag):
    return [(e.step, v.simple_value) for e in events for v in e.summary.value if v.tag == tag]


def reads_by_thread(calls):
    out: dict[str, list[str]] = {}
    for name, thread in calls:
        if name in READS:
            out.setdefault(thread, []).append(name)
    return out


def test_snapshots_of_a_device_tensor_copy_it_without_reading_it():
    calls: list[tuple[str, str]] = []
    value = recording_tensor(2.5, calls)
    for snapshot in (
        snapshot_scalar("x", value),
        snapshot_step(value),
        snapshot_array(value),
    ):
        assert type(snapshot) is DeviceCopy
        assert snapshot.tensor is not value and snapshot.tensor.device.type == "meta"
    assert [name for name, _ in calls if name in READS] == []
    assert {"clone"} <= {name for name, _ in calls}  # a copy, made on the device


def test_add_scalar_reads_a_device_value_and_step_on_the_writer_thread(tmp_path):
    value_calls: list[tuple[str, str]] = []
    step_calls: list[tuple[str, str]] = []
    with SummaryWriter(tmp_path, max_queue=100) as w:
        w.add_scalar("x", recording_tensor(2.5, value_calls), recording_tensor(7, step_calls))
        w.add_scalar("y", 1.0, recording_tensor(8, step_calls))
        w.add_scalar("z", recording_tensor(-3.0, value_calls), 9)
        caller = threading.current_thread().name
        # Nothing was read yet on this thread: only the copy was made here.
        assert caller not in reads_by_thread(value_calls)
        assert caller not in reads_by_thread(step_calls)
        assert any(name == "clone" and thread == caller for name, thread in value_calls)
    assert set(reads_by_thread(value_calls)) == {writer_thread_name(tmp_path)}
    assert set(reads_by_thread(step_calls)) == {writer_thread_name(tmp_path)}
    events = events_of(tmp_path)
    assert scalars(events, "x") == [(7, 2.5)]
    assert scalars(events, "y") == [(8, 1.0)]
    assert scalars(events, "z") == [(9, -3.0)]
    assert w.counters().events_written == 3


def test_long_runs_of_device_scalars_are_read_on_the_writer_thread(tmp_path):
    calls: list[tuple[str, str]] = []
    count = VECTORIZE_MIN_RUN * 2  # the vectorized encoder's path
    with SummaryWriter(tmp_path, max_queue=0) as w:
        worker = events_worker_of(w)
        worker.batch_at = worker.wake_at = 10**6  # long runs: batches at close
        for step in range(count):
            w.add_scalar("x", recording_tensor(float(step), calls), recording_tensor(step, calls))
        assert threading.current_thread().name not in reads_by_thread(calls)
    assert set(reads_by_thread(calls)) == {writer_thread_name(tmp_path)}
    assert scalars(events_of(tmp_path), "x") == [(s, float(s)) for s in range(count)]


def test_add_histogram_reads_a_device_tensor_on_the_writer_thread(tmp_path):
    calls: list[tuple[str, str]] = []
    with SummaryWriter(tmp_path) as w:
        w.add_histogram("h", recording_tensor(4.0, calls), recording_tensor(3, calls))
        assert threading.current_thread().name not in reads_by_thread(calls)
    assert set(reads_by_thread(calls)) == {writer_thread_name(tmp_path)}
    (event,) = events_of(tmp_path)
    assert event.step == 3
    assert (event.summary.value[0].histo.num, event.summary.value[0].histo.sum) == (1.0, 4.0)


def test_a_value_that_cannot_be_read_is_counted_and_logged_not_raised(tmp_path, caplog):
    meta = torch.zeros((), device="meta")  # no data at all: every read fails
    with caplog.at_level(logging.ERROR, logger="torchsupervisor"), SummaryWriter(tmp_path) as w:
        w.add_scalar("bad_value", meta, 1)  # none of these raises here
        w.add_scalar("bad_step", 1.0, meta)
        w.add_histogram("bad_histogram", torch.zeros(3, device="meta"), 1)
        w.add_scalar("good", 2.0, 2)
    for tag in ("bad_value", "bad_step", "bad_histogram"):
        assert f"Dropping summary '{tag}'" in caplog.text
    errors_logged = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert {r.threadName for r in errors_logged} == {writer_thread_name(tmp_path)}
    assert w.counters().events_lost == 3
    assert w.counters().events_written == 1
    events = events_of(tmp_path)
    assert [v.tag for e in events for v in e.summary.value] == ["good"]


def test_the_copy_of_a_cuda_tensor_is_awaited_on_its_own_devices_stream(monkeypatch):
    """A tensor on ``cuda:1`` while ``cuda:0`` is current: the event must mark ``cuda:1``."""

    class OnSecondGpu(torch.Tensor):  # a meta tensor that says it lives on cuda:1
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(getattr(func, "__self__", None), "__name__", None) == "device":
                return torch.device("cuda", 1)
            return super().__torch_function__(func, types, args, kwargs)

    class FakeEvent:
        def __init__(self):
            self.recorded_on = "nothing"
            self.synchronized = False

        def record(self, stream=None):
            self.recorded_on = stream if stream is not None else ("current stream of", 0)

        def synchronize(self):
            self.synchronized = True

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    tensor = torch.Tensor._make_subclass(OnSecondGpu, torch.empty((), device="meta"))
    copy = snapshot_scalar("x", tensor)
    assert type(copy) is DeviceCopy
    assert copy.event.recorded_on == ("stream of", torch.device("cuda", 1))
    assert copy.get() is copy.tensor and copy.event.synchronized
