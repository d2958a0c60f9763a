"""FtrlOptimizer against TF's update rule, computed by hand, and TF's published values."""

from __future__ import annotations

import math

import pytest
import torch

from torchsupervisor.training.optimizers import FtrlOptimizer

GRADS = [[0.1, -0.2], [0.3, 0.05], [-0.4, 0.1], [0.2, 0.2], [0.0, -0.3]]


def _sign(x: float) -> float:
    return (x > 0) - (x < 0)


def _by_hand(w, grads, lr, lr_power=-0.5, n0=0.1, l1=0.0, l2=0.0, shrinkage=0.0, beta=0.0):
    """TF's documented FTRL rule, one coordinate at a time, in plain Python floats."""
    w = list(w)
    n = [n0] * len(w)
    z = [0.0] * len(w)
    l2 = l2 + beta / (2 * lr)
    for g in grads:
        for i, gi in enumerate(g):
            g_s = gi + 2 * shrinkage * w[i]
            n_new = n[i] + gi * gi
            z[i] += g_s - (n_new ** (-lr_power) - n[i] ** (-lr_power)) / lr * w[i]
            quadratic = 1.0 / (n_new**lr_power * lr) + 2 * l2
            w[i] = (_sign(z[i]) * l1 - z[i]) / quadratic if abs(z[i]) > l1 else 0.0
            n[i] = n_new
    return w


def _run(w, grads, dtype=torch.float64, **kwargs):
    param = torch.nn.Parameter(torch.tensor(w, dtype=dtype))
    opt = FtrlOptimizer([param], **kwargs)
    for g in grads:
        param.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return param.detach().tolist(), opt


def test_first_step_by_hand():
    # w=1, g=0.1, lr=3, n=0.1, l1=0.001, l2=2: n'=0.11,
    # z = 0.1 - (sqrt(.11) - sqrt(.1)) / 3 = 0.0948551, quadratic = sqrt(.11)/3 + 4,
    # w = (0.001 - z) / quadratic.
    z = 0.1 - (math.sqrt(0.11) - math.sqrt(0.1)) / 3
    expected = (0.001 - z) / (math.sqrt(0.11) / 3 + 4)
    got, opt = _run(
        [1.0],
        [[0.1]],
        learning_rate=3.0,
        l1_regularization_strength=0.001,
        l2_regularization_strength=2.0,
    )
    assert got == pytest.approx([expected], rel=1e-12)
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert state["accum"].tolist() == pytest.approx([0.11])
    assert state["linear"].tolist() == pytest.approx([z])


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"l1_regularization_strength": 0.05},
        {"l2_regularization_strength": 0.5},
        {"l1_regularization_strength": 0.01, "l2_regularization_strength": 0.2},
        {"learning_rate_power": -0.3, "l1_regularization_strength": 0.01},
        {"learning_rate_power": 0.0},
        {"initial_accumulator_value": 0.0, "l2_regularization_strength": 0.1},
        {"l2_shrinkage_regularization_strength": 0.3, "l1_regularization_strength": 0.01},
        {"beta": 0.7, "l2_regularization_strength": 0.1},
    ],
)
def test_several_steps_match_the_rule_by_hand(options):
    by_hand_options = {
        "lr_power": options.get("learning_rate_power", -0.5),
        "n0": options.get("initial_accumulator_value", 0.1),
        "l1": options.get("l1_regularization_strength", 0.0),
        "l2": options.get("l2_regularization_strength", 0.0),
        "shrinkage": options.get("l2_shrinkage_regularization_strength", 0.0),
        "beta": options.get("beta", 0.0),
    }
    expected = _by_hand([0.5, -1.0], GRADS, 0.7, **by_hand_options)
    got, _ = _run([0.5, -1.0], GRADS, learning_rate=0.7, **options)
    assert got == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_l1_sets_small_weights_to_exactly_zero():
    got, _ = _run([0.0, 0.0], [[0.01, 2.0]], learning_rate=1.0, l1_regularization_strength=0.5)
    assert got[0] == 0.0
    assert got[1] != 0.0


def test_tf_published_values_float32():
    # TF's ftrl_test: 10 steps from [1, 2] / [4, 3] with constant gradients.
    def run(w, g, **kwargs):
        return _run(w, [g] * 10, dtype=torch.float32, learning_rate=3.0, **kwargs)[0]

    reg = {"l1_regularization_strength": 0.001, "l2_regularization_strength": 2.0}
    assert run([1.0, 2.0], [0.1, 0.2], **reg) == pytest.approx([-0.24059935, -0.46829352], 1e-5)
    assert run([4.0, 3.0], [0.01, 0.02], **reg) == pytest.approx([-0.02406147, -0.04830509], 1e-5)
    shrink = {**reg, "l2_shrinkage_regularization_strength": 0.1}
    assert run([1.0, 2.0], [0.1, 0.2], **shrink) == pytest.approx([-0.22578995, -0.44345796], 1e-5)
    assert run([4.0, 3.0], [0.01, 0.02], **shrink) == pytest.approx(
        [-0.14378493, -0.13229476], 1e-5
    )
    three = _run([0.0, 0.0], [[0.1, 0.2]] * 3, dtype=torch.float32, learning_rate=3.0)[0]
    assert three == pytest.approx([-2.60260963, -4.29698515], 1e-5)


def test_equivalent_to_adagrad_and_sgd_without_regularization_from_zero():
    adagrad_param = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    adagrad = torch.optim.Adagrad([adagrad_param], lr=3.0, initial_accumulator_value=0.1, eps=0)
    sgd_param = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    sgd = torch.optim.SGD([sgd_param], lr=3.0)
    for g in GRADS:
        for p, opt in ((adagrad_param, adagrad), (sgd_param, sgd)):
            p.grad = torch.tensor(g, dtype=torch.float64)
            opt.step()
    ftrl_adagrad, _ = _run([0.0, 0.0], GRADS, learning_rate=3.0)
    ftrl_sgd, _ = _run([0.0, 0.0], GRADS, learning_rate=3.0, learning_rate_power=0.0)
    assert ftrl_adagrad == pytest.approx(adagrad_param.tolist(), rel=1e-10)
    assert ftrl_sgd == pytest.approx(sgd_param.tolist(), rel=1e-10)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"initial_accumulator_value": -0.1},
            "initial_accumulator_value -0.100000 needs to be positive or zero",
        ),
        ({"learning_rate_power": 0.5}, "learning_rate_power 0.500000 needs to be negative or zero"),
        (
            {"l1_regularization_strength": -1.0},
            "l1_regularization_strength -1.000000 needs to be positive or zero",
        ),
        (
            {"l2_regularization_strength": -1.0},
            "l2_regularization_strength -1.000000 needs to be positive or zero",
        ),
        (
            {"l2_shrinkage_regularization_strength": -1.0},
            "l2_shrinkage_regularization_strength -1.000000 needs to be positive or zero",
        ),
    ],
)
def test_invalid_arguments_raise_tf_errors(options, message):
    param = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match=rf"^{message}$"):
        FtrlOptimizer([param], 0.1, **options)
    opt = FtrlOptimizer([param], 0.1)
    with pytest.raises(ValueError, match=rf"^{message}$"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], **options})
    assert len(opt.param_groups) == 1


def test_groups_skip_params_without_grad_sparse_grads_and_closure():
    a = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    b = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    opt = FtrlOptimizer([{"params": [a]}, {"params": [b], "lr": 0.5}], 1.0)
    a.grad = torch.tensor([0.1, 0.2], dtype=torch.float64)
    loss = opt.step(lambda: torch.tensor(7.0))
    assert loss.item() == 7.0
    assert b.tolist() == [1.0, 1.0] and b not in opt.state
    assert a.tolist() == pytest.approx(_by_hand([1.0, 1.0], [[0.1, 0.2]], 1.0))
    b.grad = torch.tensor([0.1, 0.2], dtype=torch.float64)
    a.grad = None
    opt.step()
    assert b.tolist() == pytest.approx(_by_hand([1.0, 1.0], [[0.1, 0.2]], 0.5))
    embedding = torch.nn.Embedding(3, 2, sparse=True)
    sparse_opt = FtrlOptimizer(embedding.parameters(), 0.1)
    embedding(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        sparse_opt.step()


def test_state_dict_resumes_exactly():
    full, _ = _run([0.5, -1.0], GRADS, learning_rate=0.7, l1_regularization_strength=0.01)
    param = torch.nn.Parameter(torch.tensor([0.5, -1.0], dtype=torch.float64))
    opt = FtrlOptimizer([param], 0.7, l1_regularization_strength=0.01)
    for g in GRADS[:2]:
        param.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    saved_param, saved_state = param.detach().clone(), opt.state_dict()
    resumed = torch.nn.Parameter(saved_param)
    opt2 = FtrlOptimizer([resumed], 0.7, l1_regularization_strength=0.01)
    opt2.load_state_dict(saved_state)
    for g in GRADS[2:]:
        resumed.grad = torch.tensor(g, dtype=torch.float64)
        opt2.step()
    assert resumed.tolist() == full
