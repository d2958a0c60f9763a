"""Every TF optimizer rejects a sparse gradient before it changes any parameter or state."""

from __future__ import annotations

import pytest
import torch

from torchsupervisor.core.global_step import GlobalStep
from torchsupervisor.training.optimizers import (
    AdagradDAOptimizer,
    FtrlOptimizer,
    ProximalAdagradOptimizer,
    ProximalGradientDescentOptimizer,
)

OPTIMIZERS = {
    "AdagradDAOptimizer": lambda params: AdagradDAOptimizer(
        params, 0.1, GlobalStep(), l1_regularization_strength=0.01
    ),
    "FtrlOptimizer": lambda params: FtrlOptimizer(params, 0.1, l1_regularization_strength=0.01),
    "ProximalAdagradOptimizer": lambda params: ProximalAdagradOptimizer(params, 0.1),
    "ProximalGradientDescentOptimizer": lambda params: ProximalGradientDescentOptimizer(
        params, 0.1
    ),
}


def _dense_then_sparse():
    dense = torch.nn.Parameter(torch.tensor([0.5, -1.0]))
    dense.grad = torch.tensor([0.3, -0.2])
    embedding = torch.nn.Embedding(3, 2, sparse=True)
    embedding(torch.tensor([1])).sum().backward()
    return dense, embedding.weight


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("groups", [False, True], ids=["one_group", "two_groups"])
def test_sparse_gradient_on_the_second_parameter_leaves_the_first_unchanged(name, groups):
    dense, sparse = _dense_then_sparse()
    params = [{"params": [dense]}, {"params": [sparse]}] if groups else [dense, sparse]
    opt = OPTIMIZERS[name](params)
    before = (dense.detach().clone(), sparse.detach().clone())
    with pytest.raises(RuntimeError, match=rf"^{name} does not support sparse gradients$"):
        opt.step()
    assert torch.equal(dense, before[0])
    assert torch.equal(sparse, before[1])
    assert opt.state_dict()["state"] == {}
    # Without the sparse gradient, the same optimizer then updates the first parameter.
    sparse.grad = None
    opt.step()
    assert not torch.equal(dense, before[0])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_closure_runs_before_the_sparse_check(name):
    dense, sparse = _dense_then_sparse()
    opt = OPTIMIZERS[name]([dense, sparse])
    calls = []
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step(lambda: calls.append(torch.is_grad_enabled()))
    assert calls == [True]
