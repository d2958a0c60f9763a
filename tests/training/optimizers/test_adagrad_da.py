"""AdagradDAOptimizer against TF's update rule computed by hand, with the global step."""

from __future__ import annotations

import math

import pytest
import torch

from torchsupervisor import GlobalStep
from torchsupervisor.errors import InvalidArgumentError
from torchsupervisor.training.optimizers import AdagradDAOptimizer

GRADS = [[0.1, -0.2], [0.3, 0.05], [-0.4, 0.1], [0.2, 0.2]]


def _sign(x: float) -> float:
    return (x > 0) - (x < 0)


def _by_hand(n_params, grads, lr, h0=0.1, l1=0.0, l2=0.0, first_step=0):
    """G += g; H += g^2; t = step + 1; w = -lr * shrink_l1(G, l1 t) / (l2 t lr + sqrt(H))."""
    sums, squares, w = [0.0] * n_params, [h0] * n_params, [None] * n_params
    for k, g in enumerate(grads):
        t = first_step + k + 1
        for i, gi in enumerate(g):
            sums[i] += gi
            squares[i] += gi * gi
            shrunk = _sign(sums[i]) * max(abs(sums[i]) - l1 * t, 0.0) if l1 > 0 else sums[i]
            w[i] = -lr * shrunk / (l2 * t * lr + math.sqrt(squares[i]))
    return w


def _run(w, grads, step=None, dtype=torch.float64, **kwargs):
    param = torch.nn.Parameter(torch.tensor(w, dtype=dtype))
    step = GlobalStep() if step is None else step
    opt = AdagradDAOptimizer([param], global_step=step, **kwargs)
    step.bind(opt)
    for g in grads:
        param.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return param.detach().tolist(), opt


def test_first_step_by_hand():
    # t = 1, G = 0.1, H = 0.11: w = -3 * (0.1 - 0.001) / (2 * 3 + sqrt(0.11)).
    expected = -3 * 0.099 / (6 + math.sqrt(0.11))
    got, _ = _run(
        [1.0],
        [[0.1]],
        learning_rate=3.0,
        l1_regularization_strength=0.001,
        l2_regularization_strength=2.0,
    )
    assert got == pytest.approx([expected], rel=1e-12)


@pytest.mark.parametrize(
    ("h0", "l1", "l2"), [(0.1, 0.0, 0.0), (0.1, 0.05, 0.0), (0.5, 0.0, 0.3), (0.2, 0.02, 0.3)]
)
def test_several_steps_match_the_rule_by_hand(h0, l1, l2):
    expected = _by_hand(2, GRADS, 0.4, h0, l1, l2)
    got, _ = _run(
        [0.5, -1.0],
        GRADS,
        learning_rate=0.4,
        initial_gradient_squared_accumulator_value=h0,
        l1_regularization_strength=l1,
        l2_regularization_strength=l2,
    )
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_the_global_step_sets_t():
    # From step 100, t = 101, 102, ...: the L1 threshold l1 * t and the L2 term grow with it.
    got, _ = _run(
        [0.0, 0.0],
        GRADS,
        step=GlobalStep(100),
        learning_rate=0.4,
        l1_regularization_strength=0.001,
        l2_regularization_strength=0.01,
    )
    expected = _by_hand(2, GRADS, 0.4, l1=0.001, l2=0.01, first_step=100)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got != pytest.approx(_by_hand(2, GRADS, 0.4, l1=0.001, l2=0.01), rel=1e-6)


def test_an_integer_tensor_step():
    counter = torch.tensor(4)
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = AdagradDAOptimizer([param], 1.0, counter, l2_regularization_strength=1.0)
    param.grad = torch.tensor([0.5], dtype=torch.float64)
    opt.step()
    # t = 5: w = -1 * 0.5 / (1 * 5 * 1 + sqrt(0.1 + 0.25)).
    assert param.tolist() == pytest.approx([-0.5 / (5 + math.sqrt(0.35))])


def test_tf_published_values_float32():
    def run(w, g, **kwargs):
        return _run(w, [g], dtype=torch.float32, learning_rate=3.0, **kwargs)[0]

    assert run([1.0, 2.0], [0.1, 0.2]) == pytest.approx([-0.904534, -1.603567], 1e-5)
    assert run([4.0, 3.0], [0.01, 0.02]) == pytest.approx([-0.094821, -0.189358], 1e-4)
    l1 = {"l1_regularization_strength": 0.001}
    assert run([1.0, 2.0], [0.1, 0.2], **l1) == pytest.approx([-0.895489, -1.59555], 1e-5)
    assert run([4.0, 3.0], [0.01, 0.02], **l1) == pytest.approx([-0.085339, -0.17989], 1e-4)


def test_argument_errors():
    param = torch.nn.Parameter(torch.zeros(1))
    step = GlobalStep()
    for bad in (0.0, -1.0):
        with pytest.raises(
            ValueError,
            match=rf"^initial_gradient_squared_accumulator_value must be positive: {bad}$",
        ):
            AdagradDAOptimizer([param], 0.1, step, initial_gradient_squared_accumulator_value=bad)
    with pytest.raises(InvalidArgumentError, match=r"l1_regularization_strength -1.000000"):
        AdagradDAOptimizer([param], 0.1, step, l1_regularization_strength=-1.0)
    with pytest.raises(ValueError, match="needs global_step"):
        AdagradDAOptimizer([param], 0.1, None)
    with pytest.raises(TypeError, match="global_step must be a GlobalStep"):
        AdagradDAOptimizer([param], 0.1, 3)
    with pytest.raises(TypeError, match="integer"):
        AdagradDAOptimizer([param], 0.1, torch.tensor(1.0))


def test_state_dict_resumes_exactly_with_the_restored_step():
    full, _ = _run([0.5, -1.0], GRADS, learning_rate=0.4, l1_regularization_strength=0.01)
    step = GlobalStep()
    first, opt = _run(
        [0.5, -1.0], GRADS[:2], step=step, learning_rate=0.4, l1_regularization_strength=0.01
    )
    assert step.value == 2
    resumed = torch.nn.Parameter(torch.tensor(first, dtype=torch.float64))
    step2 = GlobalStep()
    opt2 = AdagradDAOptimizer([resumed], 0.4, step2, l1_regularization_strength=0.01)
    step2.bind(opt2)
    opt2.load_state_dict(opt.state_dict())
    step2.load_state_dict(step.state_dict())
    for g in GRADS[2:]:
        resumed.grad = torch.tensor(g, dtype=torch.float64)
        opt2.step()
    assert resumed.tolist() == full
    embedding = torch.nn.Embedding(3, 2, sparse=True)
    sparse_opt = AdagradDAOptimizer(embedding.parameters(), 0.1, GlobalStep())
    embedding(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        sparse_opt.step()
