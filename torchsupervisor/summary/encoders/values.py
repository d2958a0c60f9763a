"""What every encoder does first: read its input as a numpy array, and TF's batch conventions.

Inputs may be torch tensors on any device, numpy arrays, Python numbers or (nested) lists; a
tensor is detached and copied to the host here, so encoders themselves only see numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from torchsupervisor import errors

__all__ = ["check_max_outputs", "output_tag", "shape_str", "to_numpy"]


def to_numpy(value: object) -> np.ndarray:
    """Return ``value`` as a numpy array (a torch tensor is detached and copied to the host).

    Tensors of dtypes numpy lacks (bfloat16, float8 variants, ...) are widened to float32.
    """
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.is_conj():
            t = t.resolve_conj()
        try:
            return t.numpy()
        except (TypeError, RuntimeError):
            return t.float().numpy()
    if isinstance(value, np.ndarray):
        return value
    return np.asarray(value)


def shape_str(shape: Sequence[int]) -> str:
    """Format a shape as TF's error messages do: ``[2,3]``, ``[]``."""
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


def check_max_outputs(max_outputs: int) -> None:
    """Reject a ``max_outputs`` below 1 (the image and audio kernels' argument).

    Raises:
        InvalidArgumentError: ``max_outputs < 1``.
    """
    if max_outputs < 1:
        raise errors.InvalidArgumentError(f"max_outputs must be at least 1, got {max_outputs}")


def output_tag(tag: str, kind: str, max_outputs: int, index: int) -> str:
    """Return the tag of output ``index`` of a batch summary, as TF names it.

    ``"<tag>/<kind>"`` if ``max_outputs == 1``, else ``"<tag>/<kind>/<index>"`` (this depends
    on ``max_outputs``, not on the batch size).
    """
    return f"{tag}/{kind}" if max_outputs == 1 else f"{tag}/{kind}/{index}"
