"""A summary whose source has no value yet is skipped with one warning; training goes on.

TF's ptb_word_lm summarizes a validation loss that exists only after the first validation;
its port read it from a dict and stopped training with ``KeyError`` at the first summary.
"""

from __future__ import annotations

import logging

import torch
from supervisor_helpers import all_events

import torchsupervisor as ts
from torchsupervisor.core.registry import Graph


def test_the_op_is_empty_until_its_source_has_a_value(caplog):
    results: dict[str, float] = {}
    with Graph().as_default():
        valid = ts.summary.scalar("valid_loss", lambda: results["valid_loss"])
        optional = ts.summary.scalar("optional", lambda: results.get("optional"))
        merged = ts.summary.merge([valid, optional])
        with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
            assert list(merged().value) == []
            assert list(merged().value) == []
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 2  # Once per op.
        assert "Summary 'valid_loss' skipped: its source has no value yet (KeyError" in warnings[0]
        assert "'optional' skipped: its source has no value yet (it returned None)" in warnings[1]
        results["valid_loss"] = 1.5
        assert [(v.tag, v.simple_value) for v in merged().value] == [("valid_loss", 1.5)]


def test_training_goes_on_and_logs_the_value_once_it_exists(tmp_path):
    results: dict[str, float] = {}
    step = ts.GlobalStep()
    with Graph().as_default():
        ts.summary.scalar("valid_loss", lambda: results["valid_loss"])
        with ts.MonitoredTrainingSession(
            checkpoint_dir=str(tmp_path),
            state={"w": torch.zeros(1), "global_step": step},
            hooks=[ts.StopAtStepHook(last_step=4)],
            save_summaries_steps=1,
            log_step_count_steps=None,
        ) as sess:
            while not sess.should_stop():
                sess.run(step.increment)
                if step.value == 2:
                    results["valid_loss"] = 0.25  # The first validation.
    ts.SummaryWriterCache.clear()
    points = [
        (e.step, v.simple_value)
        for e in all_events(tmp_path)
        for v in e.summary.value
        if v.tag == "valid_loss"
    ]
    assert points and all(value == 0.25 for _, value in points)
    assert step.value == 4
