"""``Saver([var1, var2])``: TF's list of variables, named by their paths in the state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchsupervisor import GlobalStep, Saver, Session
from torchsupervisor.checkpoint.reader import CheckpointReader


class Net(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, classes)


def _state(seed: int, classes: int = 3) -> dict:
    torch.manual_seed(seed)
    net = Net(classes)
    return {
        "model": net,
        "optimizer": torch.optim.SGD(net.parameters(), lr=0.1),
        "step": GlobalStep(),
    }


def test_the_how_tos_pre_trained_saver_restores_only_the_listed_variables(tmp_path):
    # The seed's pre-trained-model example: a saver over some variables of the new model
    # restores them from a checkpoint of another model (a head of another size).
    pretrained = _state(seed=0, classes=10)
    with torch.no_grad():
        pretrained["model"].backbone[1].running_mean.fill_(0.5)
    pre_path = Saver().save(Session(pretrained), str(tmp_path / "pre.ckpt"))

    state = _state(seed=1)
    net = state["model"]
    head_before = net.head.weight.detach().clone()
    pre_train_saver = Saver([net.backbone[0].weight, net.backbone[0].bias, net.backbone[1]])
    pre_train_saver.restore(Session(state), pre_path)
    old = pretrained["model"].backbone
    assert torch.equal(net.backbone[0].weight, old[0].weight)
    assert torch.equal(net.backbone[0].bias, old[0].bias)
    assert torch.equal(net.backbone[1].running_mean, torch.full((4,), 0.5))  # The sub-module.
    assert torch.equal(net.head.weight, head_before)  # Not listed: untouched.


def test_a_list_saves_each_object_under_its_path_in_the_state(tmp_path):
    state = _state(seed=0)
    net = state["model"]
    path = Saver([net.head.weight, state["optimizer"], "step"]).save(
        Session(state), str(tmp_path / "model.ckpt")
    )
    reader = CheckpointReader(path)
    assert torch.equal(reader.get_tensor("model/head.weight"), net.head.weight.detach())
    assert set(reader.manifest.tree["dict"]) == {"model/head.weight", "optimizer", "step"}
    # The same names as a checkpoint of the whole state: either restores from the other.
    whole = Saver().save(Session(_state(seed=5)), str(tmp_path / "whole.ckpt"))
    Saver([net.head.weight]).restore(Session(state), whole)
    assert torch.equal(net.head.weight, _state(seed=5)["model"].head.weight)


def test_an_object_outside_the_state_or_of_another_kind_is_refused_clearly(tmp_path):
    state = _state(seed=0)
    stray = torch.zeros(3)
    with pytest.raises(
        ValueError, match=r"var_list item 1 \(a Tensor of shape \[3\].*not in the session's state"
    ):
        Saver([state["model"].head.bias, stray]).save(Session(state), str(tmp_path / "m"))
    with pytest.raises(
        TypeError, match=r"var_list item 0 must be a state name, a tensor or a stateful object.*int"
    ):
        Saver([3])
    with pytest.raises(ValueError, match="needs a session"):
        Saver([state["model"].head.bias]).save(None, str(tmp_path / "m"))
    assert not (tmp_path / "checkpoint").exists()  # Nothing written by a refused save.
