"""Copies of the values given to ``SummaryWriter.add_*``, taken on the caller's thread.

A value must be copied when it is enqueued (training goes on changing tensors in place), but the
caller must not wait for the device: a CPU tensor is read or cloned at once, a tensor on another
device is cloned *on that device* (``DeviceCopy``, with a CUDA event marking when the copy is
done), and the writer thread brings it to the host later (``resolve``, ``resolve_step``)::

    caller:  snapshot_scalar / snapshot_array / snapshot_step -> queue
    writer:  resolve / resolve_step -> encoders
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch

from torchsupervisor import errors
from torchsupervisor.summary.encoders.scalar import scalar_value

__all__ = [
    "DeviceCopy",
    "resolve",
    "resolve_step",
    "snapshot_array",
    "snapshot_bins",
    "snapshot_scalar",
    "snapshot_step",
]


class DeviceCopy:
    """A tensor copied on its (non-CPU) device, with an event marking when the copy is done.

    Thread safety: made on the caller's thread, read (``get``) on the writer thread; the
    writer's queue lock orders the two.
    """

    __slots__ = ("event", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach().clone()
        self.event = None
        device = tensor.device
        if device.type == "cuda":
            # The clone was queued on the current stream of the tensor's device, which need
            # not be the current device: record the event there (Event.record() with no
            # stream would mark the current device's stream, and get() would not wait).
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))

    def get(self) -> torch.Tensor:
        """Wait until the copy is done (writer thread) and return it."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensor


def resolve(value: object) -> Any:
    """Return the value a snapshot stands for (waiting for a ``DeviceCopy``)."""
    return value.get() if type(value) is DeviceCopy else value


INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


def snapshot_step(step: Any) -> Any:
    """Snapshot a ``global_step`` argument: ``None``, an int, or a ``DeviceCopy``.

    Accepted: None, an integer (Python, numpy, or a float with an integral value) in the
    int64 range (the ``Event.step`` field), a ``GlobalStep``, or a one-element real tensor
    (a CPU one is read and checked now; a device one is read on the writer thread, and
    checked there).

    Raises:
        TypeError: ``step`` is not an integer (``1.5``, ``"3"``, a bool, a complex tensor).
        ValueError: ``step`` is outside the int64 range, or a tensor with more or fewer than
            one element.
    """
    if step is None:
        return step
    if type(step) is int:
        value = step
    elif isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise ValueError(f"global_step must have one element, got shape {list(step.shape)}")
        if step.dtype.is_complex or step.dtype == torch.bool:
            raise TypeError(f"global_step must be an integer tensor, got dtype {step.dtype}")
        if not step.is_cpu:
            return DeviceCopy(step)  # Read (and checked) on the writer thread.
        number = step.detach().item()
        if isinstance(number, float) and not number.is_integer():
            raise TypeError(f"global_step must be an integer, got {number!r}")
        value = int(number)
    elif isinstance(step, bool) or not isinstance(step, (numbers.Integral, float, np.floating)):
        if hasattr(step, "value") and type(step).__name__ == "GlobalStep":
            return snapshot_step(step.value)
        raise TypeError(f"global_step must be an integer, got {step!r} ({type(step).__name__})")
    elif isinstance(step, (float, np.floating)):
        if not float(step).is_integer():
            raise TypeError(f"global_step must be an integer, got {step!r}")
        value = int(step)
    else:
        value = int(step)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"global_step {value} is outside the int64 range of an event's step")
    return value


def resolve_step(step: Any) -> int | None:
    """Return the step a ``snapshot_step`` result stands for."""
    if type(step) is DeviceCopy:
        return int(step.get().item())
    return step


def snapshot_scalar(tag: str, value: object) -> Any:
    """Snapshot an ``add_scalar`` value: a float, or a ``DeviceCopy`` of a one-element tensor.

    Raises:
        InvalidArgumentError: ``value`` has more or fewer than one element, or is not real.
    """
    kind = type(value)
    if kind is float:
        return value
    if kind is int or kind is bool:
        return float(value)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise errors.InvalidArgumentError(
                f"tags and values not the same shape: [] != {list(value.shape)} (tag '{tag}')"
            )
        if value.is_cpu:
            return float(value.detach() if value.requires_grad else value)
        return DeviceCopy(value)
    return scalar_value(tag, value)


def snapshot_array(value: object, what: str | None = None) -> Any:
    """Snapshot an array-like value: a CPU copy, a ``DeviceCopy``, or the value itself.

    Args:
        value: A tensor (any device), a numpy array, a number, or a (nested) list or tuple of
            numbers.
        what: ``"histogram summary 'h'"`` to check here, on the caller's thread, that the
            values are real numbers (a string or None would otherwise be found only by the
            writer thread, and the event dropped with a log line); None: not checked.

    Raises:
        InvalidArgumentError: (with ``what``) the values are not real numbers.
    """
    if isinstance(value, torch.Tensor):
        if what is not None and value.dtype.is_complex:
            raise errors.InvalidArgumentError(
                f"{what} expects real numbers, got dtype {value.dtype}"
            )
        if value.is_cpu:
            return value.detach().clone()
        return DeviceCopy(value)
    if isinstance(value, np.ndarray):
        if what is not None and value.dtype.kind not in "biuf":
            raise errors.InvalidArgumentError(
                f"{what} expects real numbers, got dtype {value.dtype}"
            )
        return value.copy()
    if what is not None:
        if isinstance(value, (str, bytes)) or value is None:
            raise errors.InvalidArgumentError(
                f"{what} expects real numbers, got {type(value).__name__} {value!r:.50}"
            )
        if isinstance(value, (list, tuple)):
            try:
                kind = np.asarray(value).dtype.kind
            except (ValueError, TypeError) as e:  # Ragged or odd nesting.
                raise errors.InvalidArgumentError(f"{what} expects real numbers: {e}") from None
            if kind not in "biuf":
                raise errors.InvalidArgumentError(
                    f"{what} expects real numbers, got {type(value).__name__} {value!r:.50}"
                )
        elif not isinstance(value, (numbers.Real, np.generic)) or isinstance(value, np.str_):
            raise errors.InvalidArgumentError(
                f"{what} expects real numbers, got {type(value).__name__} {value!r:.50}"
            )
    if isinstance(value, list):
        return list(value)
    return value


def snapshot_bins(bins: Any) -> Any:
    """Snapshot an ``add_histogram`` ``bins`` argument (already checked by ``check_bins``)."""
    if isinstance(bins, str):
        return bins
    if isinstance(bins, (int, np.integer)):
        return int(bins)
    return np.asarray(bins, dtype=np.float64)
