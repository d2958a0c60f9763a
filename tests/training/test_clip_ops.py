"""The clip helpers against TF's documented formulas and return values, computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from torchsupervisor.errors import InvalidArgumentError
from torchsupervisor.training.clip_ops import (
    clip_by_average_norm,
    clip_by_global_norm,
    clip_by_norm,
    clip_by_value,
    global_norm,
)

# ---------------------------------------------------------------------------- clip_by_value


def test_clip_by_value():
    t = torch.tensor([[-3.0, -1.0, 0.0], [1.0, 2.5, 7.0]])
    got = clip_by_value(t, -1.5, 2.0)
    assert got.tolist() == [[-1.5, -1.0, 0.0], [1.0, 2.0, 2.0]]
    assert got.dtype == t.dtype and t[0, 0].item() == -3.0  # A new tensor; t unchanged.


def test_clip_by_value_with_broadcast_bounds_and_ints():
    t = torch.tensor([[1, 5, 9], [1, 5, 9]])
    got = clip_by_value(t, torch.tensor([2, 0, 0]), torch.tensor([[8], [4]]))
    assert got.tolist() == [[2, 5, 8], [2, 4, 4]]
    assert got.dtype == torch.int64


def test_clip_by_value_min_above_max_gives_min_and_nan_stays():
    # TF computes maximum(minimum(t, max), min): with min > max every value becomes min.
    assert clip_by_value(torch.tensor([0.0, 10.0]), 5.0, 1.0).tolist() == [5.0, 5.0]
    assert math.isnan(clip_by_value(torch.tensor([float("nan")]), 0.0, 1.0).item())


def test_clip_by_value_errors():
    with pytest.raises(InvalidArgumentError, match="broadcast"):
        clip_by_value(torch.zeros(3), torch.zeros(2, 3), 1.0)
    with pytest.raises(TypeError, match="clip_value_max is a float"):
        clip_by_value(torch.tensor([1, 2]), 0, 1.5)
    with pytest.raises(TypeError, match="clip_value_min is a float"):
        clip_by_value(torch.tensor([1, 2]), torch.tensor(0.5), 2)


# ----------------------------------------------------------------------------- clip_by_norm


def test_clip_by_norm_shrinks_to_clip_norm():
    t = torch.tensor([[-3.0, 5.0, 0.0, 0.0]], dtype=torch.float64)  # norm sqrt(34)
    got = clip_by_norm(t, 4.0)
    assert got.flatten().tolist() == pytest.approx(
        [-3 * 4 / math.sqrt(34), 5 * 4 / math.sqrt(34), 0, 0]
    )
    assert torch.linalg.vector_norm(got).item() == pytest.approx(4.0)


def test_clip_by_norm_keeps_a_small_tensor():
    t = torch.tensor([3.0, 4.0], dtype=torch.float64)  # norm 5
    assert clip_by_norm(t, 5.0).tolist() == pytest.approx([3.0, 4.0])
    assert clip_by_norm(t, 6.0).tolist() == pytest.approx([3.0, 4.0])


def test_clip_by_norm_along_axes():
    t = torch.tensor([[3.0, 4.0], [0.6, 0.8]], dtype=torch.float64)
    # Rows (norms 5 and 1) clipped to 2: the first shrinks, the second stays.
    rows = clip_by_norm(t, 2.0, axes=[1])
    assert rows.flatten().tolist() == pytest.approx([1.2, 1.6, 0.6, 0.8])
    # Columns (norms sqrt(9.36), sqrt(16.64)) clipped to 2.
    cols = clip_by_norm(t, 2.0, axes=0)
    n0, n1 = math.sqrt(9.36), math.sqrt(16.64)
    assert cols.flatten().tolist() == pytest.approx([6 / n0, 8 / n1, 1.2 / n0, 1.6 / n1])


def test_clip_by_norm_zero_tensor_stays_zero_and_errors():
    assert clip_by_norm(torch.zeros(3), 1.0).tolist() == [0.0, 0.0, 0.0]
    assert clip_by_norm(torch.tensor(-5.0), 2.0).item() == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="clip_norm must be a 0-D"):
        clip_by_norm(torch.ones(3), torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="floating point"):
        clip_by_norm(torch.tensor([1, 2]), 1.0)


def test_clip_by_norm_gradient_through_a_zero_tensor_is_finite():
    # TF takes the square root of a "safe" sum (1 where the sum is 0): no NaN from sqrt'(0).
    t = torch.zeros(3, requires_grad=True)
    clip_by_norm(t, 1.0).sum().backward()
    assert t.grad.tolist() == [1.0, 1.0, 1.0]
    rows = torch.tensor([[0.0, 0.0], [3.0, 4.0]], requires_grad=True)
    clip_by_norm(rows, 1.0, axes=1).sum().backward()
    assert torch.isfinite(rows.grad).all()
    assert rows.grad[0].tolist() == [1.0, 1.0]


# --------------------------------------------------------------------- clip_by_average_norm


def test_clip_by_average_norm():
    t = torch.tensor([[-3.0, 5.0, 0.0, 0.0]], dtype=torch.float64)  # average norm sqrt(34)/4
    got = clip_by_average_norm(t, 0.9)
    scale = 0.9 / (math.sqrt(34) / 4)
    assert got.flatten().tolist() == pytest.approx([-3 * scale, 5 * scale, 0.0, 0.0])
    assert (torch.linalg.vector_norm(got) / got.numel()).item() == pytest.approx(0.9)
    # Average norm 1.4577 <= 2: unchanged.
    assert clip_by_average_norm(t, 2.0).flatten().tolist() == pytest.approx(t.flatten().tolist())
    with pytest.raises(TypeError, match="floating point"):
        clip_by_average_norm(torch.tensor([1, 2]), 1.0)


# ----------------------------------------------------------------- global norm and clipping


def test_global_norm_ignores_none():
    a = torch.tensor([3.0, 4.0])
    b = torch.tensor([[1.0, 2.0], [2.0, 4.0]])
    got = global_norm([a, None, b])
    assert got.dim() == 0
    assert got.item() == pytest.approx(math.sqrt(25 + 25))
    assert global_norm((None,)).item() == 0.0


def test_global_norm_of_half_tensors_does_not_overflow_in_float32():
    big = torch.full((4,), 60000.0, dtype=torch.float16)
    assert global_norm([big]).item() == pytest.approx(120000.0, rel=1e-3)
    assert global_norm([torch.ones(2, dtype=torch.float64)]).dtype == torch.float64


def test_t_list_must_be_a_sequence():
    for bad in (torch.ones(3), "abc", {torch.ones(1)}, iter([torch.ones(1)])):
        with pytest.raises(TypeError, match=r"^t_list should be a sequence$"):
            global_norm(bad)
        with pytest.raises(TypeError, match=r"^t_list should be a sequence$"):
            clip_by_global_norm(bad, 1.0)


def test_clip_by_global_norm_shrinks_all_by_one_ratio():
    a = torch.tensor([3.0, 4.0], dtype=torch.float64)
    b = torch.tensor([0.0, 12.0], dtype=torch.float64)  # global norm 13
    (ca, none, cb), norm = clip_by_global_norm([a, None, b], 6.5)
    assert none is None
    assert norm.item() == pytest.approx(13.0)
    assert ca.tolist() == pytest.approx([1.5, 2.0])
    assert cb.tolist() == pytest.approx([0.0, 6.0])
    assert a.tolist() == [3.0, 4.0]  # Inputs untouched.


def test_clip_by_global_norm_keeps_small_tensors_and_uses_use_norm():
    a = torch.tensor([3.0, 4.0], dtype=torch.float64)
    (ca,), norm = clip_by_global_norm([a], 10.0)
    assert norm.item() == pytest.approx(5.0)
    assert ca.tolist() == pytest.approx([3.0, 4.0])
    # use_norm replaces the computed norm (and is what is returned).
    (cu,), used = clip_by_global_norm([a], 2.0, use_norm=4.0)
    assert used.item() == 4.0
    assert cu.tolist() == pytest.approx([1.5, 2.0])
    with pytest.raises(ValueError, match="use_norm must be a 0-D"):
        clip_by_global_norm([a], 2.0, use_norm=torch.ones(2))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_clip_by_global_norm_inf_or_nan_norm_gives_all_nan(bad):
    a = torch.tensor([1.0, bad])
    b = torch.tensor([2.0, 3.0])
    (ca, none, cb), norm = clip_by_global_norm([a, None, b], 1.0)
    assert none is None
    assert math.isinf(norm.item()) if bad == float("inf") else math.isnan(norm.item())
    assert torch.isnan(ca).all() and torch.isnan(cb).all()


def test_clip_by_global_norm_of_zeros_is_zeros():
    (c,), norm = clip_by_global_norm([torch.zeros(3)], 1.0)
    assert norm.item() == 0.0
    assert c.tolist() == [0.0, 0.0, 0.0]


def test_clip_by_global_norm_keeps_dtypes():
    half = torch.tensor([3.0, 4.0], dtype=torch.float16)
    double = torch.tensor([0.0, 12.0], dtype=torch.float64)
    (ch, cd), norm = clip_by_global_norm([half, double], 6.5)
    assert ch.dtype == torch.float16 and cd.dtype == torch.float64
    assert norm.dtype == torch.float64
    assert ch.tolist() == pytest.approx([1.5, 2.0], rel=1e-3)
