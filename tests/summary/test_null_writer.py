"""``NullSummaryWriter``: every ``SummaryWriter`` call accepted, nothing written."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from tensorboard.compat.proto.event_pb2 import SessionLog

from torchsupervisor import NullSummaryWriter, SummaryWriter
from torchsupervisor.summary import WriterCounters


def test_every_method_of_the_writer_is_accepted_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    w = NullSummaryWriter()
    public = [
        name
        for name, member in inspect.getmembers(SummaryWriter, callable)
        if not name.startswith("_")
    ]
    assert {"add_scalar", "add_histogram", "add_image", "add_text", "flush", "close"} <= set(public)
    for name in public:
        assert callable(getattr(w, name)), name
    assert w.add_scalar("loss", 1.0, 3) is None
    assert w.add_histogram("w", np.arange(4.0), 3) is None
    assert w.add_image("img", np.zeros((3, 2, 2)), 3) is None
    assert w.add_text("t", "x", 3) is None
    assert w.add_session_log(SessionLog(status=SessionLog.START), 3) is None
    w.flush()
    assert w.request_flush().is_set()
    w.close()
    w.reopen()
    assert w.get_logdir() is None and w.counters() == WriterCounters()
    assert not w  # ``if sv.summary_writer:`` tells a writing chief.
    with w as same:
        assert same is w
    assert list(tmp_path.iterdir()) == []


def test_a_name_the_writer_does_not_have_is_an_error_as_there():
    with pytest.raises(AttributeError, match="'NullSummaryWriter' object has no attribute"):
        NullSummaryWriter().add_scalarz  # noqa: B018
