"""Every public constructor checks its arguments when the object is built, by name and value.

Before: ``Saver(max_to_keep=-1)`` was accepted and deleted every checkpoint right after it was
written; ``Supervisor(save_model_secs="x")`` failed later naming ``timer_interval_secs``.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

import torchsupervisor as ts
from torchsupervisor import summary

STATE = {"w": torch.zeros(1)}


def _supervisor(tmp_path, **kwargs):
    return ts.Supervisor(logdir=str(tmp_path), state=STATE, **kwargs)


def _mts(tmp_path, **kwargs):
    return ts.MonitoredTrainingSession(checkpoint_dir=str(tmp_path), state=STATE, **kwargs)


def _creator_scaffold(d, v):
    return ts.ChiefSessionCreator(scaffold=v)


CASES = [
    # Objects in the wrong place: an AttributeError from deep inside, naming nothing.
    ("ChiefSessionCreator", _creator_scaffold, "scaffold", 3, TypeError),
    ("ChiefSessionCreator", lambda d, v: ts.ChiefSessionCreator(state=v), "state", [1], TypeError),
    ("Scaffold", lambda d, v: ts.Scaffold(state=v), "state", "model", TypeError),
    (
        "MonitoredSession",
        lambda d, v: ts.MonitoredSession(session_creator=v),
        "session_creator",
        "chief",
        TypeError,
    ),
    ("MonitoredSession", lambda d, v: ts.MonitoredSession(hooks=v), "hooks", 5, TypeError),
    ("Supervisor", lambda d, v: _supervisor(d, graph=v), "graph", "g", TypeError),
    ("Saver", lambda d, v: ts.Saver(clock=v), "clock", 1.5, TypeError),
    ("Coordinator", lambda d, v: ts.Coordinator(clock=v), "clock", "now", TypeError),
    ("Session", lambda d, v: ts.Session(master=v), "master", 7, TypeError),
    ("Session", lambda d, v: ts.Session(device=v), "device", -7, ValueError),
    ("CheckpointReader", lambda d, v: ts.CheckpointReader(v), "prefix", 7, TypeError),
    ("GlobalStep", lambda d, v: ts.GlobalStep(name=v), "name", 7, TypeError),
    ("RNGState", lambda d, v: ts.RNGState(rank=v), "rank", "0", TypeError),
    ("InputPipelineState", lambda d, v: ts.InputPipelineState(v), "collection", 7, TypeError),
    ("PreemptionHandler", lambda d, v: ts.PreemptionHandler(v), "signals", 15, TypeError),
    (
        "IgnorePreemptionSignals",
        lambda d, v: ts.IgnorePreemptionSignals(v),
        "worker_init_fn",
        3,
        TypeError,
    ),
    ("Progress", lambda d, v: ts.Progress(refresh_secs=v), "refresh_secs", "fast", TypeError),
    ("Progress", lambda d, v: ts.Progress(last_step=v), "last_step", "1000", TypeError),
    ("ResumableDataLoader", lambda d, v: ts.ResumableDataLoader(v), "dataset", 7, TypeError),
    (
        "SecondOrStepTimer",
        lambda d, v: ts.SecondOrStepTimer(every_secs=v),
        "every_secs",
        "5",
        TypeError,
    ),
    # (what, build(tmp_path, value), argument, value, error)
    ("Saver", lambda d, v: ts.Saver(max_to_keep=v), "max_to_keep", -1, ValueError),
    ("Saver", lambda d, v: ts.Saver(max_to_keep=v), "max_to_keep", 2.5, TypeError),
    ("Saver", lambda d, v: ts.Saver(max_to_keep=v), "max_to_keep", "3", TypeError),
    ("Saver", lambda d, v: ts.Saver(max_to_keep=v), "max_to_keep", True, TypeError),
    (
        "Saver",
        lambda d, v: ts.Saver(keep_checkpoint_every_n_hours=v),
        "keep_checkpoint_every_n_hours",
        -1,
        ValueError,
    ),
    ("Saver", lambda d, v: ts.Saver(max_shard_bytes=v), "max_shard_bytes", 0, ValueError),
    ("Saver", lambda d, v: ts.Saver(save_relative_paths=v), "save_relative_paths", "no", TypeError),
    (
        "Supervisor",
        lambda d, v: _supervisor(d, save_model_secs=v),
        "save_model_secs",
        "x",
        TypeError,
    ),
    (
        "Supervisor",
        lambda d, v: _supervisor(d, save_model_secs=v),
        "save_model_secs",
        -5,
        ValueError,
    ),
    (
        "Supervisor",
        lambda d, v: _supervisor(d, save_summaries_secs=v),
        "save_summaries_secs",
        "60",
        TypeError,
    ),
    (
        "Supervisor",
        lambda d, v: _supervisor(d, preemption_grace_secs=v),
        "preemption_grace_secs",
        "x",
        TypeError,
    ),
    (
        "Supervisor",
        lambda d, v: _supervisor(d, stop_grace_secs=v),
        "stop_grace_secs",
        -1,
        ValueError,
    ),
    (
        "Supervisor",
        lambda d, v: _supervisor(d, stop_grace_secs=v),
        "stop_grace_secs",
        float("nan"),
        ValueError,
    ),
    (
        "Supervisor",
        lambda d, v: _supervisor(d, recovery_wait_secs=v),
        "recovery_wait_secs",
        0,
        ValueError,
    ),
    ("Supervisor", lambda d, v: ts.Supervisor(logdir=v, state=STATE), "logdir", 123, TypeError),
    ("Supervisor", lambda d, v: ts.Supervisor(logdir=str(d), state=v), "state", [1], TypeError),
    (
        "Supervisor",
        lambda d, v: _supervisor(d, preemption_signals=v),
        "preemption_signals",
        [9999],
        ValueError,
    ),
    (
        "Supervisor",
        lambda d, v: _supervisor(d, preemption_exit_code=v),
        "preemption_exit_code",
        "75",
        TypeError,
    ),
    ("Supervisor", lambda d, v: _supervisor(d, is_chief=v), "is_chief", "yes", TypeError),
    (
        "Supervisor",
        lambda d, v: _supervisor(d, checkpoint_basename=v),
        "checkpoint_basename",
        "",
        ValueError,
    ),
    (
        "SummaryWriter",
        lambda d, v: summary.SummaryWriter(d, max_queue=v),
        "max_queue",
        -1,
        ValueError,
    ),
    (
        "SummaryWriter",
        lambda d, v: summary.SummaryWriter(d, flush_secs=v),
        "flush_secs",
        -1,
        ValueError,
    ),
    (
        "SummaryWriter",
        lambda d, v: summary.SummaryWriter(d, flush_secs=v),
        "flush_secs",
        "1",
        TypeError,
    ),
    ("SummaryWriter", lambda d, v: summary.SummaryWriter(v), "logdir", 123, TypeError),
    (
        "Coordinator",
        lambda d, v: ts.Coordinator(clean_stop_exception_types=v),
        "clean_stop_exception_types",
        [3],
        TypeError,
    ),
    (
        "CheckpointSaverHook",
        lambda d, v: ts.CheckpointSaverHook(str(d), save_secs=v),
        "save_secs",
        -1,
        ValueError,
    ),
    (
        "CheckpointSaverHook",
        lambda d, v: ts.CheckpointSaverHook(str(d), save_steps=v),
        "save_steps",
        1.5,
        TypeError,
    ),
    (
        "CheckpointSaverHook",
        lambda d, v: ts.CheckpointSaverHook(v, save_secs=1),
        "checkpoint_dir",
        5,
        TypeError,
    ),
    (
        "StepCounterHook",
        lambda d, v: ts.StepCounterHook(every_n_steps=v),
        "every_n_steps",
        0,
        ValueError,
    ),
    (
        "StepCounterHook",
        lambda d, v: ts.StepCounterHook(every_n_steps=None, every_n_secs=v),
        "every_n_secs",
        "x",
        TypeError,
    ),
    (
        "SummarySaverHook",
        lambda d, v: ts.SummarySaverHook(save_steps=v, summary_op=lambda: None),
        "save_steps",
        -1,
        ValueError,
    ),
    ("StopAtStepHook", lambda d, v: ts.StopAtStepHook(num_steps=v), "num_steps", -3, ValueError),
    ("StopAtStepHook", lambda d, v: ts.StopAtStepHook(last_step=v), "last_step", "10", TypeError),
    (
        "LoggingTensorHook",
        lambda d, v: ts.LoggingTensorHook({"w": STATE["w"]}, every_n_secs=v),
        "every_n_secs",
        -1,
        ValueError,
    ),
    (
        "NanTensorHook",
        lambda d, v: ts.NanTensorHook(STATE["w"], fail_on_nan_loss=v),
        "fail_on_nan_loss",
        "yes",
        TypeError,
    ),
    ("FeedFnHook", lambda d, v: ts.FeedFnHook(v), "feed_fn", 3, TypeError),
    (
        "MonitoredTrainingSession",
        lambda d, v: _mts(d, save_checkpoint_secs=v),
        "save_checkpoint_secs",
        "x",
        TypeError,
    ),
    (
        "MonitoredTrainingSession",
        lambda d, v: _mts(d, save_summaries_steps=v),
        "save_summaries_steps",
        -1,
        ValueError,
    ),
    (
        "MonitoredTrainingSession",
        lambda d, v: _mts(d, stop_grace_period_secs=v),
        "stop_grace_period_secs",
        -1,
        ValueError,
    ),
    (
        "MonitoredTrainingSession",
        lambda d, v: ts.MonitoredTrainingSession(checkpoint_dir=v, state=STATE),
        "checkpoint_dir",
        1,
        TypeError,
    ),
    (
        "MonitoredTrainingSession",
        lambda d, v: ts.MonitoredTrainingSession(checkpoint_dir=str(d), state=v),
        "state",
        [1],
        TypeError,
    ),
    (
        "MonitoredTrainingSession",
        lambda d, v: _mts(d, preemption_grace_secs=v),
        "preemption_grace_secs",
        "x",
        TypeError,
    ),
    ("MonitoredTrainingSession", lambda d, v: _mts(d, scaffold=v), "scaffold", "sc", TypeError),
    ("MonitoredTrainingSession", lambda d, v: _mts(d, hooks=v), "hooks", [7], TypeError),
    (
        "MonitoredTrainingSession",
        lambda d, v: _mts(d, chief_only_hooks=v),
        "chief_only_hooks",
        ["hook"],
        TypeError,
    ),
]


def test_monitored_training_session_takes_tfs_positional_order_and_names_a_misplaced_one(
    tmp_path,
):
    step = ts.GlobalStep()
    state = {"w": torch.zeros(1), "global_step": step}
    hooks = [ts.StopAtStepHook(last_step=1)]
    # TF's order: master, is_chief, checkpoint_dir, scaffold, hooks, chief_only_hooks, ...
    with ts.MonitoredTrainingSession(
        "", True, str(tmp_path), None, hooks, None, state=state
    ) as sess:
        while not sess.should_stop():
            sess.run(step.increment)
    # Hooks one place early (where the scaffold goes): an error naming the argument and
    # the order, not an AttributeError from inside.
    with pytest.raises(TypeError, match=r"^scaffold must be a Scaffold or None.*TF's \(master"):
        ts.MonitoredTrainingSession("", True, str(tmp_path), hooks, state=state)


@pytest.mark.parametrize(
    "build,argument,value,error",
    [case[1:] for case in CASES],
    ids=[f"{case[0]}-{case[2]}={case[3]!r}" for case in CASES],
)
def test_a_bad_argument_fails_when_the_object_is_built(tmp_path, build, argument, value, error):
    with pytest.raises(error) as caught:
        build(tmp_path, value)
    message = str(caught.value)
    assert argument in message
    shown = value[0] if isinstance(value, list) else value  # A list: its bad item is named.
    if argument != "clean_stop_exception_types":
        assert repr(shown) in message or str(shown) in message, message


def test_good_values_still_work(tmp_path):
    ts.Saver(max_to_keep=None)
    ts.Saver(max_to_keep=0, keep_checkpoint_every_n_hours=0.5)
    _supervisor(tmp_path, save_model_secs=None, save_summaries_secs=0)
    summary.SummaryWriter(tmp_path, max_queue=0, flush_secs=0).close()
    ts.StopAtStepHook(last_step=0)


def test_a_supervisor_without_state_warns_that_checkpoints_hold_only_the_step(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        ts.Supervisor(logdir=str(tmp_path))
    assert "has no state=: its checkpoints hold only the global step" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        ts.Supervisor(logdir=str(tmp_path), state=STATE)
        ts.Supervisor(state=STATE)
    assert "has no state=" not in caplog.text


def test_a_second_managed_session_of_a_supervisor_raises(tmp_path):
    sv = _supervisor(tmp_path, save_summaries_secs=0)
    with sv.managed_session():
        second = sv.managed_session()
        with pytest.raises(RuntimeError, match="managed_session\\(\\) is already open"):
            second.__enter__()
    with sv.managed_session():  # Closed: a new one may open.
        pass


@pytest.mark.parametrize(
    "value", [torch.zeros(2, dtype=torch.complex128), object(), {"a": {1j: 2}}]
)
def test_an_unsaveable_state_entry_raises_at_the_first_save_on_the_training_thread(tmp_path, value):
    step = ts.GlobalStep()
    sv = ts.Supervisor(
        logdir=str(tmp_path),
        state={"bad": value, "global_step": step},
        save_model_secs=3600,
        save_summaries_secs=0,
    )
    with pytest.raises(TypeError, match="Cannot save 'bad"), sv.managed_session():
        step.increment()
        sv.checkpoint()  # The first save: on this (the training) thread, at once.


def test_an_unsaveable_state_entry_raises_from_the_step_of_the_timed_save(tmp_path):
    step = ts.GlobalStep()
    sv = ts.Supervisor(
        logdir=str(tmp_path),
        state={"bad": torch.zeros(2, dtype=torch.complex128), "global_step": step},
        save_model_secs=3600,  # The timer's first request comes at once.
        save_summaries_secs=0,
    )
    with pytest.raises(TypeError, match="Cannot save 'bad'"), sv.managed_session() as sess:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # Bounded: the request lands within a step or two.
            sess.run(step.increment)
            time.sleep(0.01)
