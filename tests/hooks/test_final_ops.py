"""FinalOpsHook: fetches evaluated once, at the end."""

from __future__ import annotations

import logging

import pytest
from monitored_helpers import Counter

from torchsupervisor import Session
from torchsupervisor.errors import OutOfRangeError
from torchsupervisor.hooks import FinalOpsHook
from torchsupervisor.monitored.creators import ChiefSessionCreator
from torchsupervisor.monitored.session import MonitoredSession


def test_final_ops_are_evaluated_at_the_end():
    counter = Counter()
    hook = FinalOpsHook({"w": lambda scale: float(counter.w) * scale}, {"scale": 10})
    with MonitoredSession(ChiefSessionCreator(state=counter.state), hooks=[hook]) as sess:
        sess.run(counter.step)
        sess.run(counter.step)
        assert hook.final_ops_values is None
    assert hook.final_ops_values == {"w": 20.0}


def test_final_ops_reading_an_exhausted_input_warn_and_raise(caplog):
    def exhausted():
        raise OutOfRangeError("input exhausted")

    hook = FinalOpsHook(exhausted)
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"), pytest.raises(OutOfRangeError):
        hook.end(Session({}))
    assert "dependency back to some input source" in caplog.text
