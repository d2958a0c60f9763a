"""RMSPropOptimizer against TF 1's update computed by hand, TF's test values, and PyTorch's."""

from __future__ import annotations

import math

import pytest
import torch

from torchsupervisor import RMSPropOptimizer

GRADS = [[0.1, -0.2], [0.3, 0.05], [-0.4, 0.1], [0.2, 0.2]]


def _by_hand(w, grads, learning_rate, decay=0.9, momentum=0.0, epsilon=1e-10, centered=False):
    """TF 1's kernel: ms starts at 1; mom = momentum mom + lr g / sqrt(ms [- mg^2] + eps)."""
    w = list(w)
    ms, mg, mom = [1.0] * len(w), [0.0] * len(w), [0.0] * len(w)
    for g in grads:
        for i, gi in enumerate(g):
            ms[i] = decay * ms[i] + (1 - decay) * gi * gi
            denom = ms[i] + epsilon
            if centered:
                mg[i] = decay * mg[i] + (1 - decay) * gi
                denom -= mg[i] * mg[i]
            mom[i] = momentum * mom[i] + learning_rate * gi / math.sqrt(denom)
            w[i] -= mom[i]
    return w


def _run(w, grads, dtype=torch.float64, **kwargs):
    param = torch.nn.Parameter(torch.tensor(w, dtype=dtype))
    opt = RMSPropOptimizer([param], **kwargs)
    for g in grads:
        param.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return param.detach().tolist(), opt


def test_tfs_own_test_values_without_momentum():
    # TF 1's rmsprop_test (testWithoutMomentum): var [1, 2], grads 0.1, lr 2, epsilon 1.
    got, opt = _run([1.0, 2.0], [[0.1, 0.1]] * 2, learning_rate=2.0, epsilon=1.0)
    first = 0.1 * 2.0 / math.sqrt(0.901 + 1.0)
    second = 0.1 * 2.0 / math.sqrt(0.901 * 0.9 + 0.001 + 1.0)
    assert got == pytest.approx([1.0 - first - second, 2.0 - first - second], rel=1e-12)
    (state,) = opt.state.values()
    assert set(state) == {"rms", "momentum"}  # TF's slot names.
    assert state["rms"].tolist() == pytest.approx([0.901 * 0.9 + 0.001] * 2)


@pytest.mark.parametrize(
    ("momentum", "centered", "epsilon"),
    [(0.0, False, 1e-10), (0.9, False, 1e-10), (0.0, True, 1e-6), (0.5, True, 0.1)],
)
def test_every_option_follows_tfs_update(momentum, centered, epsilon):
    kwargs = dict(learning_rate=0.01, decay=0.8, momentum=momentum, epsilon=epsilon)
    got, opt = _run([1.0, -0.5], GRADS, centered=centered, **kwargs)
    assert got == pytest.approx(_by_hand([1.0, -0.5], GRADS, centered=centered, **kwargs))
    (state,) = opt.state.values()
    assert ("mg" in state) == centered


def test_torchs_rmsprop_is_another_update():
    # Why the class exists: three steps of torch.optim.RMSprop move several times further.
    grads = [[0.1]] * 3
    ours, _ = _run([0.0], grads, learning_rate=0.001)
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    torch_opt = torch.optim.RMSprop([param], lr=0.001, alpha=0.9, eps=1e-10)
    for g in grads:
        param.grad = torch.tensor(g, dtype=torch.float64)
        torch_opt.step()
    assert ours == pytest.approx(_by_hand([0.0], grads, learning_rate=0.001))
    assert abs(param.item()) > 5 * abs(ours[0])


def test_float32_state_round_trips_and_sparse_gradients_are_refused():
    got, opt = _run([1.0, 2.0], GRADS[:2], dtype=torch.float32, learning_rate=0.1, momentum=0.9)
    assert got == pytest.approx(
        _by_hand([1.0, 2.0], GRADS[:2], learning_rate=0.1, momentum=0.9), rel=1e-5
    )
    again = RMSPropOptimizer([torch.nn.Parameter(torch.tensor(got))], learning_rate=0.1)
    again.load_state_dict(opt.state_dict())
    (state,) = again.state.values()
    assert state["rms"].dtype == torch.float32
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match="RMSPropOptimizer does not support sparse gradients"):
        RMSPropOptimizer([param], learning_rate=0.1).step()
