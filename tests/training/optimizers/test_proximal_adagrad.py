"""ProximalAdagradOptimizer against TF's update rule computed by hand, and TF's values."""

from __future__ import annotations

import math

import pytest
import torch

from torchsupervisor.errors import InvalidArgumentError
from torchsupervisor.training.optimizers import ProximalAdagradOptimizer

GRADS = [[0.1, -0.2], [0.3, 0.05], [-0.4, 0.1], [0.2, 0.2]]


def _sign(x: float) -> float:
    return (x > 0) - (x < 0)


def _by_hand(w, grads, lr, a0=0.1, l1=0.0, l2=0.0):
    """a += g^2; r = lr / sqrt(a); v = w - r g; w = sign(v) max(|v| - r l1, 0) / (1 + r l2)."""
    w = list(w)
    a = [a0] * len(w)
    for g in grads:
        for i, gi in enumerate(g):
            a[i] += gi * gi
            rate = lr / math.sqrt(a[i])
            prox = w[i] - rate * gi
            w[i] = _sign(prox) * max(abs(prox) - rate * l1, 0.0) / (1 + rate * l2)
    return w


def _run(w, grads, dtype=torch.float64, **kwargs):
    param = torch.nn.Parameter(torch.tensor(w, dtype=dtype))
    opt = ProximalAdagradOptimizer([param], **kwargs)
    for g in grads:
        param.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return param.detach().tolist(), opt


def test_first_step_by_hand():
    # w = 1, g = 0.1, lr = 3, a = 0.1 + 0.01: r = 3 / sqrt(0.11) = 9.0453403,
    # v = 1 - 0.90453403 = 0.09546597, w = (v - r * 0.001) / (1 + r * 2).
    rate = 3 / math.sqrt(0.11)
    expected = (1 - rate * 0.1 - rate * 0.001) / (1 + 2 * rate)
    got, opt = _run(
        [1.0],
        [[0.1]],
        learning_rate=3.0,
        l1_regularization_strength=0.001,
        l2_regularization_strength=2.0,
    )
    assert got == pytest.approx([expected], rel=1e-12)
    param = opt.param_groups[0]["params"][0]
    assert opt.state[param]["accumulator"].tolist() == pytest.approx([0.11])


@pytest.mark.parametrize(
    ("a0", "l1", "l2"), [(0.1, 0.0, 0.0), (0.1, 0.05, 0.0), (0.5, 0.0, 0.3), (0.2, 0.02, 0.3)]
)
def test_several_steps_match_the_rule_by_hand(a0, l1, l2):
    expected = _by_hand([0.5, -1.0], GRADS, 0.4, a0, l1, l2)
    got, _ = _run(
        [0.5, -1.0],
        GRADS,
        learning_rate=0.4,
        initial_accumulator_value=a0,
        l1_regularization_strength=l1,
        l2_regularization_strength=l2,
    )
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_without_regularization_it_is_adagrad():
    param = torch.nn.Parameter(torch.tensor([0.5, -1.0], dtype=torch.float64))
    adagrad = torch.optim.Adagrad([param], lr=0.4, initial_accumulator_value=0.1, eps=0)
    for g in GRADS:
        param.grad = torch.tensor(g, dtype=torch.float64)
        adagrad.step()
    got, _ = _run([0.5, -1.0], GRADS, learning_rate=0.4)
    assert got == pytest.approx(param.tolist(), rel=1e-12)


def test_tf_published_values_float32():
    # TF's proximal_adagrad_test (the shrinkage uses the per-coordinate rate, as TF's kernel).
    def run(w, g, steps, **kwargs):
        return _run(w, [g] * steps, dtype=torch.float32, learning_rate=3.0, **kwargs)[0]

    assert run([1.0, 2.0], [0.1, 0.2], 3) == pytest.approx([-1.60261, -2.296985], 1e-5)
    assert run([4.0, 3.0], [0.01, 0.02], 3) == pytest.approx([3.715679, 2.433051], 1e-5)
    l1 = {"l1_regularization_strength": 0.001}
    assert run([1.0, 2.0], [0.1, 0.2], 10, **l1) == pytest.approx([-6.663634, -9.190331], 1e-5)
    assert run([4.0, 3.0], [0.01, 0.02], 10, **l1) == pytest.approx([2.959304, 1.029232], 1e-5)


def test_argument_errors():
    param = torch.nn.Parameter(torch.zeros(1))
    for bad in (0.0, -0.1):
        with pytest.raises(
            ValueError, match=rf"^initial_accumulator_value must be positive: {bad}$"
        ):
            ProximalAdagradOptimizer([param], 0.1, initial_accumulator_value=bad)
    with pytest.raises(InvalidArgumentError, match=r"l1_regularization_strength -1.000000"):
        ProximalAdagradOptimizer([param], 0.1, l1_regularization_strength=-1.0)
    with pytest.raises(InvalidArgumentError, match=r"l2_regularization_strength -1.000000"):
        ProximalAdagradOptimizer([param], 0.1, l2_regularization_strength=-1.0)
    opt = ProximalAdagradOptimizer([param], 0.1)
    with pytest.raises(ValueError, match="initial_accumulator_value must be positive"):
        opt.add_param_group(
            {"params": [torch.nn.Parameter(torch.zeros(1))], "initial_accumulator_value": 0.0}
        )


def test_state_dict_resumes_exactly_and_sparse_is_rejected():
    full, _ = _run([0.5, -1.0], GRADS, learning_rate=0.4, l1_regularization_strength=0.01)
    first, opt = _run([0.5, -1.0], GRADS[:2], learning_rate=0.4, l1_regularization_strength=0.01)
    resumed = torch.nn.Parameter(torch.tensor(first, dtype=torch.float64))
    opt2 = ProximalAdagradOptimizer([resumed], 0.4, l1_regularization_strength=0.01)
    opt2.load_state_dict(opt.state_dict())
    for g in GRADS[2:]:
        resumed.grad = torch.tensor(g, dtype=torch.float64)
        opt2.step()
    assert resumed.tolist() == full
    embedding = torch.nn.Embedding(3, 2, sparse=True)
    sparse_opt = ProximalAdagradOptimizer(embedding.parameters(), 0.1)
    embedding(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        sparse_opt.step()
