"""Bad values given to ``add_*`` raise at the call, on the caller's thread.

Before, ``add_scalar`` with a non-integer step was truncated, a step beyond int64 and
``add_histogram('h', 'abc')`` were accepted and then dropped by the writer thread with a log
line: a silently missing curve.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from torchsupervisor.errors import InvalidArgumentError
from torchsupervisor.summary import SummaryWriter


def events_of(logdir):
    """The events with a summary, in file order, read with TensorBoard's own loader."""
    out = []
    for path in sorted(glob.glob(os.path.join(str(logdir), "events.out.tfevents.*"))):
        out.extend(e for e in EventFileLoader(path).Load() if e.HasField("summary"))
    return out


@pytest.mark.parametrize(
    "step,error",
    [
        (1.5, TypeError),
        ("3", TypeError),
        (True, TypeError),
        (2**63, ValueError),
        (-(2**63) - 1, ValueError),
        (torch.tensor(2.5), TypeError),
        (torch.tensor([1, 2]), ValueError),
        (torch.tensor(1 + 2j), TypeError),
    ],
)
def test_a_bad_step_raises_at_the_call(tmp_path, step, error):
    with SummaryWriter(tmp_path) as w:
        with pytest.raises(error, match="global_step"):
            w.add_scalar("x", 1.0, step)
        with pytest.raises(error, match="global_step"):
            w.add_histogram("h", [1.0, 2.0], step)
    assert events_of(tmp_path) == []


@pytest.mark.parametrize("value", ["abc", None, "3", 1 + 2j, [1, 2], object()])
def test_a_non_numeric_scalar_raises_at_the_call(tmp_path, value):
    with SummaryWriter(tmp_path) as w, pytest.raises(InvalidArgumentError, match="'x'"):
        w.add_scalar("x", value, 1)


@pytest.mark.parametrize(
    "values",
    ["abc", None, [1, "a"], [[1, 2], [3]], torch.zeros(3, dtype=torch.complex64), np.array(["a"])],
)
def test_non_numeric_histogram_values_raise_at_the_call(tmp_path, values):
    with SummaryWriter(tmp_path) as w, pytest.raises(InvalidArgumentError, match="histogram"):
        w.add_histogram("h", values, 1)


def test_good_steps_and_values_are_written(tmp_path):
    with SummaryWriter(tmp_path) as w:
        w.add_scalar("x", 1.0, 3.0)  # An integral float is an integer step.
        w.add_scalar("x", np.float32(2.0), np.int64(4))
        w.add_scalar("x", torch.tensor(3.0), torch.tensor(5))
        w.add_scalar("x", 4, 2**63 - 1)
        w.add_histogram("h", [1, 2.5], 1)
        w.add_histogram("h", np.arange(3), 2)
    steps = [(e.step, e.summary.value[0].tag) for e in events_of(tmp_path)]
    assert steps == [(3, "x"), (4, "x"), (5, "x"), (2**63 - 1, "x"), (1, "h"), (2, "h")]
