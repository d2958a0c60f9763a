"""``ts.logging.set_verbosity(ts.logging.INFO)``: TF's ``tf.logging`` line that makes the hooks'
INFO lines (``LoggingTensorHook``) visible in a program that configured no logging."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import torchsupervisor as ts

PROGRAM = """
import sys, tempfile
import torch
import torchsupervisor as ts
if sys.argv[1] == "info":
    ts.logging.set_verbosity(ts.logging.INFO)
step = ts.GlobalStep()
with ts.MonitoredTrainingSession(
    checkpoint_dir=tempfile.mkdtemp(),
    state={"w": torch.zeros(1), "global_step": step},
    hooks=[
        ts.StopAtStepHook(last_step=2),
        ts.LoggingTensorHook({"loss": "loss"}, every_n_iter=1),
    ],
    save_summaries_steps=None,
    log_step_count_steps=None,
) as sess:
    while not sess.should_stop():
        sess.run(lambda: {"loss": torch.tensor(0.5), "step": step.increment()})
"""


@pytest.mark.parametrize("verbosity", ["default", "info"])
def test_info_lines_show_only_after_set_verbosity(verbosity):
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, verbosity], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    shown = "INFO:torchsupervisor:loss = 0.5" in done.stderr
    assert shown == (verbosity == "info"), done.stderr[-3000:]


def test_verbosity_is_the_library_loggers_level():
    logger = logging.getLogger("torchsupervisor")
    before = logger.level
    try:
        ts.logging.set_verbosity(ts.logging.WARN)
        assert ts.logging.get_verbosity() == logging.WARNING
        with pytest.raises(TypeError, match="logging level"):
            ts.logging.set_verbosity("INFO")
    finally:
        logger.setLevel(before)
