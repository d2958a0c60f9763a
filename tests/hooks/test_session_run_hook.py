"""Hook dispatch: lifecycle, fetches (named entries of the caller's result), feeds, stop."""

from __future__ import annotations

import pytest
import torch
from monitored_helpers import Counter, RecordingHook

from torchsupervisor import GlobalStep, Session
from torchsupervisor.errors import NotFoundError
from torchsupervisor.hooks import (
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)
from torchsupervisor.monitored.creators import ChiefSessionCreator
from torchsupervisor.monitored.session import MonitoredSession
from torchsupervisor.monitored.wrappers import HookedSession


def hooked(hooks, state=None):
    return HookedSession(Session(state or {}), hooks)


def test_value_objects():
    args = SessionRunArgs("f")
    assert args == ("f", None, None)
    assert SessionRunArgs(1, {"x": 2}).feed_dict == {"x": 2}
    assert SessionRunValues(results=3).run_metadata is None
    context = SessionRunContext(args, "sess")
    assert context.original_args is args and context.session == "sess"
    assert not context.stop_requested
    context.request_stop()
    assert context.stop_requested


def test_lifecycle_order_in_a_monitored_session():
    counter = Counter()
    hook = RecordingHook()
    with MonitoredSession(ChiefSessionCreator(state=counter.state), hooks=[hook]) as sess:
        assert hook.names() == ["begin", "after_create_session"]
        sess.run(counter.step)
        sess.run(counter.step)
    assert hook.names() == [
        "begin",
        "after_create_session",
        "before_run",
        "after_run",
        "before_run",
        "after_run",
        "end",
    ]
    assert isinstance(hook.sessions[0], Session)


def test_one_context_per_run_shared_by_the_hooks():
    first, second = RecordingHook(), RecordingHook()
    sess = hooked([first, second])

    def step():
        return 1

    sess.run(step, None)
    assert first.contexts[0] is second.contexts[0]
    context = first.contexts[0]
    assert context.original_args.fetches is step
    assert isinstance(context.session, Session)


def test_hook_fetches_are_evaluated_with_the_caller_fetches():
    step = GlobalStep(4)
    tensor = torch.ones(2)
    calls = []

    def train():
        calls.append("train")
        step.increment()
        return "trained"

    hook = RecordingHook(fetches={"step": step, "t": tensor, "train": train, "none": None})
    result = hooked([hook]).run(train)
    assert result == "trained"
    assert calls == ["train"]  # A callable fetched by the caller and a hook runs once.
    assert hook.results[0]["step"] == 5  # Evaluated after the caller's fetch.
    assert hook.results[0]["t"] is tensor
    assert hook.results[0]["train"] == "trained"
    assert hook.results[0]["none"] is None


def test_a_hook_without_fetches_gets_none():
    class AfterOnly(SessionRunHook):
        def __init__(self):
            self.values = []

        def after_run(self, run_context, run_values):
            self.values.append(run_values)

    hook = AfterOnly()
    fetcher = RecordingHook(fetches=lambda: 1)
    hooked([hook, fetcher]).run(lambda: 2)
    assert hook.values[0].results is None
    assert fetcher.results == [1]


def test_strings_name_entries_of_the_caller_result():
    counter = Counter()
    hook = RecordingHook(fetches=["loss", ("loss", counter.global_step)])
    out = hooked([hook]).run(counter.step)
    loss = out["loss"]
    assert hook.results[0][0] is loss
    assert hook.results[0][1][0] is loss and hook.results[0][1][1] == 1


def test_strings_name_entries_of_a_caller_dict_fetch():
    hook = RecordingHook(fetches={"value": "a"})
    hooked([hook]).run({"a": lambda: 7, "b": lambda: 8})
    assert hook.results == [{"value": 7}]


def test_a_name_that_is_not_in_the_caller_result_is_an_error():
    hook = RecordingHook(fetches="accuracy")
    with pytest.raises(NotFoundError, match=r"'accuracy'.*keys are \['loss'\]"):
        hooked([hook]).run(lambda: {"loss": 1.0})
    with pytest.raises(NotFoundError, match=r"'accuracy'.*returned float, not a mapping"):
        hooked([hook]).run(lambda: 1.0)


def test_hook_feeds_reach_the_caller_callable_and_the_user_dict_is_untouched():
    got = {}

    def step(x, y):
        got.update(x=x, y=y)

    hook = RecordingHook(feed_dict={"x": 1})
    user_feed = {"y": 2}
    hooked([hook]).run(step, feed_dict=user_feed)
    assert got == {"x": 1, "y": 2}
    assert user_feed == {"y": 2}


def test_two_hooks_feeding_the_same_key_is_an_error():
    ran = []
    hooks = [RecordingHook(feed_dict={"x": 1}), RecordingHook(feed_dict={"x": 2, "z": 3})]
    with pytest.raises(
        RuntimeError, match=r"^Same tensor is fed by two hooks\. Conflict\(s\): \['x'\]$"
    ):
        hooked(hooks).run(lambda x: ran.append(x))
    assert ran == []


def test_a_hook_and_the_user_feeding_the_same_key_is_an_error():
    hooks = [RecordingHook(feed_dict={"x": 1})]
    with pytest.raises(
        RuntimeError,
        match=r"^Same tensor is fed by a SessionRunHook and user\. Conflict\(s\): \['x'\]$",
    ):
        hooked(hooks).run(lambda x: x, feed_dict={"x": 5})


def test_run_after_a_hook_requested_stop_is_an_error():
    hook = RecordingHook()
    hook.stop_after = 1
    sess = hooked([hook])
    assert not sess.should_stop()
    sess.run(lambda: None)
    assert sess.should_stop()
    with pytest.raises(RuntimeError, match=r"^Run called even after should_stop requested\.$"):
        sess.run(lambda: None)


def test_a_before_run_error_stops_the_chain():
    class Failing(SessionRunHook):
        def before_run(self, run_context):
            raise ValueError("before_run failed")

    ran = []
    later = RecordingHook()
    with pytest.raises(ValueError, match="before_run failed"):
        hooked([Failing(), later]).run(lambda: ran.append(1))
    assert ran == [] and later.calls == []


def test_after_run_is_not_called_when_the_run_raises():
    hook = RecordingHook()

    def step():
        raise KeyError("boom")

    with pytest.raises(KeyError):
        hooked([hook]).run(step)
    assert hook.names() == ["before_run"]
