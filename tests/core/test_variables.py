"""Uninitialized state detection and materialization."""

from __future__ import annotations

import torch
from torch import nn

from torchsupervisor import (
    Session,
    global_variables_initializer,
    local_variables_initializer,
    report_uninitialized_variables,
)


def test_meta_modules_are_reported_and_materialized_in_place():
    real = nn.Linear(2, 2)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model = nn.Sequential(meta, real)
    before = real.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sess = Session({"model": model, "optimizer": opt})
    ready = report_uninitialized_variables()
    assert ready(sess)[:2] == ["model/0.0.weight", "model/0.0.bias"]
    assert len(ready(sess)) == 7
    global_variables_initializer()(sess)
    assert ready(sess) == []
    assert torch.equal(real.weight, before)  # Real modules are untouched.
    assert opt.param_groups[0]["params"][0] is meta[0].weight  # Optimizer still valid.
    assert meta[0].weight.abs().sum() > 0 and torch.equal(meta[1].running_var, torch.ones(4))
    local_variables_initializer()()


def test_lazy_modules_are_reported_until_their_first_forward():
    lazy = nn.LazyLinear(3)
    sess = Session({"m": lazy})
    assert report_uninitialized_variables()(sess) == ["m/weight", "m/bias"]
    assert report_uninitialized_variables(var_list=[])(sess) == []
    lazy(torch.ones(1, 5))
    assert report_uninitialized_variables()(sess) == []
