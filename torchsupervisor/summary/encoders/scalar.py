"""Scalar summaries: one real number per value, stored as a float32 ``simple_value``."""

from __future__ import annotations

import numpy as np
import torch
from tensorboard.compat.proto import summary_pb2

from torchsupervisor import errors
from torchsupervisor.summary.encoders.values import shape_str, to_numpy

__all__ = ["scalar_pb", "scalar_value"]


def scalar_value(tag: str, value: object) -> float:
    """Return the one real number ``value`` holds, as a Python float.

    Args:
        tag: The summary tag, named in error messages.
        value: A Python number, an object with ``__float__`` or ``__int__``, or a tensor or
            array with exactly one element.

    Raises:
        InvalidArgumentError: ``value`` has more or fewer than one element (TF's text
            ``"tags and values not the same shape: [] != [...] (tag '...')"``) or is not real.
    """
    if isinstance(value, (float, int)):
        return float(value)
    if not isinstance(value, (torch.Tensor, np.ndarray, np.generic, list, tuple)):
        kind = type(value)
        if hasattr(kind, "__float__"):
            return float(value)
        if hasattr(kind, "__int__"):
            return float(int(value))
    arr = to_numpy(value)
    if arr.size != 1:
        raise errors.InvalidArgumentError(
            f"tags and values not the same shape: [] != {shape_str(arr.shape)} (tag '{tag}')"
        )
    if arr.dtype.kind not in "biuf":
        raise errors.InvalidArgumentError(
            f"scalar summary '{tag}' expects a real number, got dtype {arr.dtype}"
        )
    return float(arr.reshape(()))


def scalar_pb(tag: str, value: object) -> summary_pb2.Summary:
    """Encode one real number as a scalar summary.

    Args:
        tag: The summary tag (used as is).
        value: A real number: a Python number, or a tensor or array with exactly one element.

    Returns:
        ``Summary(value=[Value(tag=tag, simple_value=float32(value))])``.

    Raises:
        InvalidArgumentError: ``value`` has more or fewer than one element (TF's text
            ``"tags and values not the same shape: [] != [...] (tag '...')"``) or is not real.

    TF name: the ``ScalarSummary`` kernel.
    """
    summary = summary_pb2.Summary()
    summary.value.add(tag=tag, simple_value=scalar_value(tag, value))
    return summary
