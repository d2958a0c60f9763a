"""Clipping with TF's formulas and return values (new tensors; the inputs are not modified).

``torch.nn.utils.clip_grad_norm_`` clips gradients in place and returns only the norm;
TF's ``clip_by_global_norm`` returns ``(list_clipped, global_norm)``, keeps ``None`` entries,
and turns every entry into NaN when the norm is infinite or NaN (so a bad step is visible
instead of silently zeroed). To clip gradients the TF way::

    grads = [p.grad for p in model.parameters()]
    clipped, norm = clip_by_global_norm(grads, 5.0)
    for p, g in zip(model.parameters(), clipped):
        p.grad = g

TF names: ``tf.clip_by_value``, ``tf.clip_by_norm``, ``tf.compat.v1.clip_by_average_norm``,
``tf.clip_by_global_norm``, ``tf.compat.v1.global_norm`` (``tf.linalg.global_norm``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torchsupervisor.errors import InvalidArgumentError

__all__ = [
    "clip_by_average_norm",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "global_norm",
]


def _tensor(t: object, what: str = "t") -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        return t
    try:
        return torch.as_tensor(t)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{what} must be a tensor, got {type(t).__name__}: {t!r}") from e


def _require_float(t: torch.Tensor, fn: str) -> None:
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        raise TypeError(f"{fn} needs a floating point or complex tensor, got {t.dtype}")


def _scalar(value: object, like: torch.Tensor, what: str) -> torch.Tensor:
    """Return ``value`` as a 0-D tensor with ``like``'s real dtype and device."""
    dtype = like.real.dtype if like.dtype.is_complex else like.dtype
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{what} must be a 0-D (scalar) tensor, got shape {tuple(value.shape)}"
            )
        return value.detach().reshape(()).to(device=like.device, dtype=dtype)
    return torch.tensor(value, dtype=dtype, device=like.device)


def _squares(t: torch.Tensor) -> torch.Tensor:
    return t.abs().square() if t.dtype.is_complex else t * t


def _check_sequence(t_list: Any) -> list[Any]:
    if not isinstance(t_list, Sequence) or isinstance(t_list, str | bytes):
        raise TypeError("t_list should be a sequence")
    return list(t_list)


def clip_by_value(
    t: object, clip_value_min: Any, clip_value_max: Any, name: str | None = None
) -> torch.Tensor:
    """Return ``t`` with values below ``clip_value_min`` / above ``clip_value_max`` replaced.

    Computed as ``maximum(minimum(t, clip_value_max), clip_value_min)``, as TF does: if the
    minimum is greater than the maximum, every value becomes ``clip_value_min``. NaN stays NaN.

    Args:
        t: A tensor of any shape and real dtype.
        clip_value_min: A scalar, or a tensor broadcastable to ``t``'s shape.
        clip_value_max: A scalar, or a tensor broadcastable to ``t``'s shape.
        name: Unused (TF's op name).

    Returns:
        A new tensor with ``t``'s shape, dtype and device.

    Raises:
        InvalidArgumentError: If the bounds would broadcast the result to a bigger shape than
            ``t``'s (TF 1 raised ``ValueError``; ``InvalidArgumentError`` is one).
        TypeError: If ``t`` is an integer tensor and a bound is a float.

    TF name: ``tf.clip_by_value``.
    """
    del name
    t = _tensor(t)
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        for bound, what in ((clip_value_min, "clip_value_min"), (clip_value_max, "clip_value_max")):
            is_float = isinstance(bound, float) or (
                isinstance(bound, torch.Tensor) and bound.dtype.is_floating_point
            )
            if is_float:
                raise TypeError(f"clip_by_value: t is {t.dtype} but {what} is a float: {bound!r}")
    upper = torch.as_tensor(clip_value_max, dtype=t.dtype, device=t.device)
    lower = torch.as_tensor(clip_value_min, dtype=t.dtype, device=t.device)
    clipped = torch.maximum(torch.minimum(t, upper), lower)
    if clipped.shape != t.shape:
        raise InvalidArgumentError(
            f"clip_by_value: the bounds would broadcast t of shape {tuple(t.shape)} to "
            f"{tuple(clipped.shape)}"
        )
    return clipped


def clip_by_norm(
    t: object, clip_norm: Any, axes: int | Sequence[int] | None = None, name: str | None = None
) -> torch.Tensor:
    """Return ``t`` scaled so that its L2 norm (along ``axes``) is at most ``clip_norm``.

    ``t * clip_norm / max(l2norm(t, axes), clip_norm)``: unchanged (up to rounding) when the
    norm is at most ``clip_norm``, otherwise scaled to norm ``clip_norm``. With ``axes=[1]`` on
    a matrix each row is clipped separately. A zero tensor stays zero.

    Args:
        t: A floating point or complex tensor.
        clip_norm: The maximum norm: a positive scalar (number or 0-D tensor).
        axes: The dimensions to compute the norm over (an int or a list of ints); None: all.
        name: Unused (TF's op name).

    Returns:
        A new tensor with ``t``'s shape and dtype.

    Raises:
        ValueError: If ``clip_norm`` is not a scalar.
        TypeError: If ``t`` is not floating point or complex.

    TF name: ``tf.clip_by_norm``.
    """
    del name
    t = _tensor(t)
    _require_float(t, "clip_by_norm")
    clip = _scalar(clip_norm, t, "clip_norm")
    if axes is None:
        dims: tuple[int, ...] = tuple(range(t.dim()))
    elif isinstance(axes, int):
        dims = (axes,)
    else:
        dims = tuple(int(a) for a in axes)
    squares = _squares(t)
    total = squares.sum(dim=dims, keepdim=True) if dims else squares
    # As TF: the square root only sees positive sums, so a gradient through an all-zero t is 0
    # (not the NaN of sqrt'(0)); a NaN sum stays NaN.
    positive = total > 0
    norm = torch.where(positive, torch.where(positive, total, 1.0).sqrt(), total)
    return t * clip / torch.maximum(norm, clip)


def clip_by_average_norm(t: object, clip_norm: Any, name: str | None = None) -> torch.Tensor:
    """Return ``t`` scaled so that its average L2 norm (norm / size) is at most ``clip_norm``.

    ``t * clip_norm * min(n / l2norm(t), 1 / clip_norm)`` with ``n`` the number of elements,
    i.e. ``t * clip_norm / max(l2norm(t) / n, clip_norm)``.

    Args:
        t: A floating point tensor.
        clip_norm: The maximum average norm: a positive scalar.
        name: Unused (TF's op name).

    Returns and raises: as ``clip_by_norm``.

    TF name: ``tf.compat.v1.clip_by_average_norm`` (deprecated in TF 2 for
    ``clip_by_norm(t, clip_norm * size(t))``).
    """
    del name
    t = _tensor(t)
    _require_float(t, "clip_by_average_norm")
    clip = _scalar(clip_norm, t, "clip_norm")
    inverse_norm = torch.rsqrt(_squares(t).sum())
    return t * clip * torch.minimum(inverse_norm * t.numel(), 1.0 / clip)


def global_norm(t_list: Sequence[Any], name: str | None = None) -> torch.Tensor:
    """Return ``sqrt(sum(l2norm(t) ** 2 for t in t_list))``, ignoring None entries.

    Sums of squares are computed in float32 at least (float64 for float64 inputs), on the
    device of the first tensor. An empty list (or only None) has norm 0.

    Args:
        t_list: A list or tuple of floating point tensors (any shapes, devices) or None.
        name: Unused (TF's op name).

    Returns:
        A 0-D float tensor.

    Raises:
        TypeError: ``"t_list should be a sequence"`` (TF's text), or for an integer tensor.

    TF name: ``tf.compat.v1.global_norm`` (``tf.linalg.global_norm``).
    """
    del name
    tensors = [_tensor(t, "t_list entry") for t in _check_sequence(t_list) if t is not None]
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    device = tensors[0].device
    sums = []
    for t in tensors:
        _require_float(t, "global_norm")
        real = t.real.dtype if t.dtype.is_complex else t.dtype
        wide = torch.promote_types(real, torch.float32)
        sums.append(_squares(t.to(wide) if not t.dtype.is_complex else t).sum().to(device))
    dtype = sums[0].dtype
    for s in sums[1:]:
        dtype = torch.promote_types(dtype, s.dtype)
    return torch.stack([s.to(dtype) for s in sums]).sum().sqrt()


def clip_by_global_norm(
    t_list: Sequence[Any], clip_norm: Any, use_norm: Any = None, name: str | None = None
) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """Scale the tensors of ``t_list`` by one factor so that their global norm is <= ``clip_norm``.

    Each entry becomes ``t * clip_norm / max(global_norm, clip_norm)`` (computed as
    ``t * clip_norm * min(1 / global_norm, 1 / clip_norm)``, TF's form): unchanged (up to
    rounding) when the global norm is at most ``clip_norm``, otherwise all shrunk by the same
    ratio. If the global norm is infinite or NaN, every entry becomes NaN, to signal the error.
    None entries stay None.

    Args:
        t_list: A list or tuple of floating point tensors or None.
        clip_norm: The clipping ratio: a positive scalar.
        use_norm: The global norm, if already computed (a scalar); None: ``global_norm(t_list)``.
        name: Unused (TF's op name).

    Returns:
        ``(list_clipped, global_norm)``: new tensors (None where ``t_list`` had None), each with
        its input's shape, dtype and device, and the 0-D global norm used (``use_norm`` when
        given).

    Raises:
        TypeError: ``"t_list should be a sequence"`` (TF's text), or for an integer tensor.
        ValueError: If ``clip_norm`` or ``use_norm`` is not a scalar.

    TF name: ``tf.clip_by_global_norm``.
    """
    del name
    entries = _check_sequence(t_list)
    if use_norm is None:
        norm = global_norm(entries)
    else:
        norm = _tensor(use_norm, "use_norm")
        if norm.numel() != 1:
            raise ValueError(
                f"use_norm must be a 0-D (scalar) tensor, got shape {tuple(norm.shape)}"
            )
        if not norm.dtype.is_floating_point:
            norm = norm.to(torch.float32)
        norm = norm.reshape(())
    clip = _scalar(clip_norm, norm, "clip_norm")
    scale = clip * torch.minimum(1.0 / norm, 1.0 / clip)
    scale = torch.where(torch.isfinite(norm), scale, torch.full_like(scale, float("nan")))
    clipped: list[torch.Tensor | None] = []
    for t in entries:
        if t is None:
            clipped.append(None)
            continue
        t = _tensor(t, "t_list entry")
        _require_float(t, "clip_by_global_norm")
        real = t.real.dtype if t.dtype.is_complex else t.dtype
        clipped.append(t * scale.to(device=t.device, dtype=real))
    return clipped, norm
