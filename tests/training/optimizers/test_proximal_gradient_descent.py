"""ProximalGradientDescentOptimizer against TF's update rule computed by hand."""

from __future__ import annotations

import pytest
import torch

from torchsupervisor.errors import InvalidArgumentError
from torchsupervisor.training.optimizers import ProximalGradientDescentOptimizer

GRADS = [[0.1, -0.2], [0.3, 0.05], [-0.4, 0.1], [0.2, 0.2]]


def _sign(x: float) -> float:
    return (x > 0) - (x < 0)


def _by_hand(w, grads, lr, l1=0.0, l2=0.0):
    """prox = w - lr * g; w = sign(prox) * max(|prox| - lr * l1, 0) / (1 + lr * l2)."""
    w = list(w)
    for g in grads:
        for i, gi in enumerate(g):
            prox = w[i] - lr * gi
            w[i] = _sign(prox) * max(abs(prox) - lr * l1, 0.0) / (1 + lr * l2)
    return w


def _run(w, grads, dtype=torch.float64, **kwargs):
    param = torch.nn.Parameter(torch.tensor(w, dtype=dtype))
    opt = ProximalGradientDescentOptimizer([param], **kwargs)
    for g in grads:
        param.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return param.detach().tolist()


def test_first_step_by_hand():
    # w = [1, 2], g = [0.1, 0.2], lr = 3, l1 = 0.001, l2 = 2:
    # prox = [0.7, 1.4]; w = (prox - 0.003) / 7 = [0.0995714, 0.1995714].
    got = _run(
        [1.0, 2.0],
        [[0.1, 0.2]],
        learning_rate=3.0,
        l1_regularization_strength=0.001,
        l2_regularization_strength=2.0,
    )
    assert got == pytest.approx([0.697 / 7, 1.397 / 7], rel=1e-12)


@pytest.mark.parametrize(
    ("l1", "l2"), [(0.0, 0.0), (0.05, 0.0), (0.0, 0.5), (0.02, 0.3), (1.0, 0.1)]
)
def test_several_steps_match_the_rule_by_hand(l1, l2):
    expected = _by_hand([0.5, -1.0], GRADS, 0.4, l1, l2)
    got = _run(
        [0.5, -1.0],
        GRADS,
        learning_rate=0.4,
        l1_regularization_strength=l1,
        l2_regularization_strength=l2,
    )
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_without_regularization_it_is_sgd():
    sgd_param = torch.nn.Parameter(torch.tensor([0.5, -1.0], dtype=torch.float64))
    sgd = torch.optim.SGD([sgd_param], lr=0.4)
    for g in GRADS:
        sgd_param.grad = torch.tensor(g, dtype=torch.float64)
        sgd.step()
    assert _run([0.5, -1.0], GRADS, learning_rate=0.4) == pytest.approx(sgd_param.tolist())


def test_l1_zeroes_small_weights():
    assert _run([0.01, 5.0], [[0.0, 0.0]], learning_rate=1.0, l1_regularization_strength=0.1) == [
        0.0,
        4.9,
    ]


def test_tf_published_values_float32():
    # TF's proximal_gradient_descent_test: 10 steps, lr 3, l1 0.001, l2 2.
    options = {"learning_rate": 3.0, "l1_regularization_strength": 0.001}
    options["l2_regularization_strength"] = 2.0
    var0 = _run([1.0, 2.0], [[0.1, 0.2]] * 10, dtype=torch.float32, **options)
    var1 = _run([4.0, 3.0], [[0.01, 0.02]] * 10, dtype=torch.float32, **options)
    assert var0 == pytest.approx([-0.0495, -0.0995], abs=1e-6)
    assert var1 == pytest.approx([-0.0045, -0.0095], abs=1e-6)
    plain = _run([0.0, 0.0], [[0.1, 0.2]] * 3, dtype=torch.float32, learning_rate=3.0)
    assert plain == pytest.approx([-0.9, -1.8])


@pytest.mark.parametrize("key", ["l1_regularization_strength", "l2_regularization_strength"])
def test_negative_regularization_is_rejected(key):
    param = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(
        InvalidArgumentError, match=rf"^{key} -0.500000 needs to be positive or zero$"
    ):
        ProximalGradientDescentOptimizer([param], 0.1, **{key: -0.5})
    opt = ProximalGradientDescentOptimizer([param], 0.1)
    with pytest.raises(InvalidArgumentError, match=key):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], key: -0.5})


def test_skips_params_without_grad_and_rejects_sparse_grads():
    a = torch.nn.Parameter(torch.ones(2))
    b = torch.nn.Parameter(torch.ones(2))
    opt = ProximalGradientDescentOptimizer([a, b], 0.5)
    a.grad = torch.ones(2)
    assert opt.step(lambda: 3.0) == 3.0
    assert a.tolist() == [0.5, 0.5] and b.tolist() == [1.0, 1.0]
    embedding = torch.nn.Embedding(3, 2, sparse=True)
    sparse_opt = ProximalGradientDescentOptimizer(embedding.parameters(), 0.1)
    embedding(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        sparse_opt.step()
