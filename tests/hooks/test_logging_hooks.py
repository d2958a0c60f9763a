"""NanTensorHook and LoggingTensorHook, with tensors, callables and named entries."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from monitored_helpers import Counter

from torchsupervisor import GlobalStep, Session
from torchsupervisor.hooks import LoggingTensorHook, NanLossDuringTrainingError, NanTensorHook
from torchsupervisor.monitored.creators import ChiefSessionCreator
from torchsupervisor.monitored.session import MonitoredSession
from torchsupervisor.monitored.wrappers import HookedSession


def hooked(hooks):
    for hook in hooks:
        hook.begin()
    return HookedSession(Session({}), hooks)


def messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "torchsupervisor"]


def test_nan_loss_error_text():
    assert str(NanLossDuringTrainingError()) == "NaN loss during training."
    assert isinstance(NanLossDuringTrainingError(), RuntimeError)


@pytest.mark.parametrize(
    "nan",
    [float("nan"), torch.tensor(float("nan")), np.float32("nan"), torch.tensor([1.0, math.nan])],
)
def test_nan_raises_by_default(nan, caplog):
    sess = hooked([NanTensorHook("loss")])
    sess.run(lambda: {"loss": torch.tensor(1.0)})
    with (
        caplog.at_level(logging.ERROR, logger="torchsupervisor"),
        pytest.raises(NanLossDuringTrainingError),
    ):
        sess.run(lambda: {"loss": nan})
    assert "Model diverged with loss = NaN." in messages(caplog)


def test_nan_can_stop_instead(caplog):
    counter = Counter()
    loss = torch.tensor(0.5)
    hook = NanTensorHook(loss, fail_on_nan_loss=False)
    runs = 0
    with (
        caplog.at_level(logging.WARNING, logger="torchsupervisor"),
        MonitoredSession(ChiefSessionCreator(state=counter.state), hooks=[hook]) as sess,
    ):
        while not sess.should_stop() and runs < 10:
            sess.run(counter.step)
            runs += 1
            if runs == 3:
                loss.fill_(float("nan"))
    assert runs == 4
    assert "Model diverged with loss = NaN." in messages(caplog)


def test_logging_argument_errors():
    text = r"^either at_end and/or exactly one of every_n_iter and every_n_secs must be provided\.$"
    with pytest.raises(ValueError, match=text):
        LoggingTensorHook({"a": 1.0})
    with pytest.raises(ValueError, match=text):
        LoggingTensorHook({"a": 1.0}, every_n_iter=1, every_n_secs=1.0)
    with pytest.raises(ValueError, match=r"^invalid every_n_iter=0\.$"):
        LoggingTensorHook({"a": 1.0}, every_n_iter=0)


def test_logs_every_n_iterations_with_elapsed_time(caplog, fake_clock):
    step = GlobalStep()
    hook = LoggingTensorHook(
        {"step": step, "loss": "loss", "a_const": torch.tensor(0.25)},
        every_n_iter=3,
        clock=fake_clock,
    )
    sess = hooked([hook])
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        for i in range(7):
            fake_clock.advance(0.5)
            sess.run(lambda i=i: (step.increment(), {"loss": torch.tensor(float(i))})[1])
    assert messages(caplog) == [
        "a_const = 0.25, loss = 0.0, step = 1",
        "a_const = 0.25, loss = 3.0, step = 4 (1.500 sec)",
        "a_const = 0.25, loss = 6.0, step = 7 (1.500 sec)",
    ]


def test_list_of_fetches_keeps_its_order_and_a_formatter(caplog):
    hook = LoggingTensorHook(
        ["b", "a"], every_n_iter=1, formatter=lambda values: f"b={values['b']} a={values['a']}"
    )
    plain = LoggingTensorHook(["b", "a"], every_n_iter=1)
    sess = hooked([hook, plain])
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        sess.run(lambda: {"a": 1, "b": 2})
    assert messages(caplog) == ["b=2 a=1", "b = 2, a = 1"]


def test_every_n_secs(caplog, fake_clock):
    hook = LoggingTensorHook({"x": "x"}, every_n_secs=5.0, clock=fake_clock)
    sess = hooked([hook])
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        for i in range(6):
            sess.run(lambda i=i: {"x": i})
            fake_clock.advance(2.0)
    assert messages(caplog) == ["x = 0", "x = 3 (6.000 sec)"]


def test_at_end_only(caplog):
    counter = Counter()
    evaluated = []

    def w():
        evaluated.append(1)
        return float(counter.w)

    hook = LoggingTensorHook({"w": w, "loss": "loss"}, at_end=True)
    with (
        caplog.at_level(logging.INFO, logger="torchsupervisor"),
        MonitoredSession(ChiefSessionCreator(state=counter.state), hooks=[hook]) as sess,
    ):
        for _ in range(3):
            sess.run(counter.step)
        assert messages(caplog) == []
    assert evaluated == [1]  # Only at the end: other fetches are not evaluated per step.
    assert messages(caplog) == ["loss = 3.0, w = 3.0"]


def test_iterations_count_from_zero_in_each_monitored_session(caplog):
    counter = Counter()
    hook = LoggingTensorHook({"loss": "loss"}, every_n_iter=2)
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        for _ in range(2):
            with MonitoredSession(ChiefSessionCreator(state=counter.state), hooks=[hook]) as sess:
                for _ in range(3):
                    sess.run(counter.step)
    logged = [m.split(" (")[0] for m in messages(caplog) if m.startswith("loss")]
    assert logged == ["loss = 1.0", "loss = 3.0", "loss = 4.0", "loss = 6.0"]
