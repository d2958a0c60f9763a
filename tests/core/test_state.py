"""Flattening the state to names and tensors, and loading a tree back into live objects."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from torchsupervisor.core.state import TensorRef, TensorSpec, flatten_state
from torchsupervisor.core.state_load import check_state, find_subtree, load_state
from torchsupervisor.errors import InvalidArgumentError, NotFoundError


def test_names_are_slash_joined_paths():
    model = nn.Sequential(nn.Linear(2, 3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    skeleton, tensors = flatten_state({"model": model, "optimizer": opt})
    assert set(tensors) == {
        "model/0.weight",
        "model/0.bias",
        "optimizer/state/0/step",
        "optimizer/state/0/exp_avg",
        "optimizer/state/0/exp_avg_sq",
        "optimizer/state/1/step",
        "optimizer/state/1/exp_avg",
        "optimizer/state/1/exp_avg_sq",
    }
    assert skeleton["model"]["0.weight"] == TensorRef("model/0.weight")
    assert skeleton["optimizer"]["param_groups"][0]["params"] == [0, 1]
    assert not tensors["model/0.weight"].requires_grad


def test_the_table_holds_no_tensor_inside_autograd():
    plain = torch.zeros(2)
    trained = torch.zeros(2, requires_grad=True)
    history = trained * 2  # A tensor with a grad_fn.
    frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
    _, tensors = flatten_state({"p": plain, "t": trained, "h": history, "f": frozen})
    assert tensors["p"] is plain  # Outside autograd already: no detached copy (0.4 us each).
    for name in ("t", "h", "f"):
        assert not tensors[name].requires_grad and tensors[name].grad_fn is None, name
        assert type(tensors[name]) is torch.Tensor, name
    assert tensors["h"].data_ptr() == history.data_ptr()


def test_colliding_names_get_suffixes():
    _, tensors = flatten_state({"a/b": torch.zeros(1), "a": {"b": torch.ones(1)}})
    assert set(tensors) == {"a/b", "a/b#1"}


def test_numpy_values_and_arrays():
    skeleton, _ = flatten_state({"x": {"n": np.int64(3), "arr": np.arange(3)}})
    assert skeleton["x"]["n"] == 3 and type(skeleton["x"]["n"]) is int
    assert skeleton["x"]["arr"] == TensorRef("x/arr", ndarray=True)
    with pytest.raises(TypeError, match=r"'x/o'.*need pickle"):
        flatten_state({"x": {"o": np.array([object()])}})


@pytest.mark.parametrize(
    "value,match",
    [
        (torch.zeros(2).to_sparse(), "layout"),
        (nn.parameter.UninitializedParameter(), "not initialized"),
        (torch.empty(2, device="meta"), "not initialized"),
    ],
)
def test_unsaveable_tensors(value, match):
    with pytest.raises(ValueError, match=match):
        flatten_state({"t": value})


def test_bad_keys():
    with pytest.raises(TypeError, match="State names must be str"):
        flatten_state({1: torch.zeros(1)})
    with pytest.raises(TypeError, match=r"'d'.*dict key \(1, 2\)"):
        flatten_state({"d": {(1, 2): 3}})


def test_find_subtree_paths_and_dotted_module_keys():
    tree = {"model": {"enc.conv.weight": 1, "enc.conv.bias": 2, "head.weight": 3}, "opt": {0: "x"}}
    assert find_subtree(tree, "model") is tree["model"]
    assert find_subtree(tree, "model/enc") == {"conv.weight": 1, "conv.bias": 2}
    assert find_subtree(tree, "model/enc/conv") == {"weight": 1, "bias": 2}
    assert find_subtree(tree, "opt/0") == "x"
    for missing in ("nope", "model/dec", "opt/1/x"):
        with pytest.raises(KeyError):
            find_subtree(tree, missing)


def test_load_state_into_plain_and_nested_mappings():
    inner = torch.zeros(2)
    state = {"nested": {"t": inner, "n": 1}, "plain": 5}
    load_state(state, {"nested": {"t": torch.ones(2), "n": 2, "new": 3}, "plain": 6}, source="ck")
    assert torch.equal(inner, torch.ones(2)) and state["nested"]["t"] is inner
    assert state["nested"] == {"t": inner, "n": 2, "new": 3} and state["plain"] == 6
    with pytest.raises(NotFoundError, match="Key nested/n not found in checkpoint ck"):
        load_state({"nested": {"n": 1}}, {"nested": {}}, source="ck")
    missing = []
    load_state({"a": 1, "b": 2}, {"a": 3}, source="ck", on_missing=missing.append)
    assert missing == ["b"]


def test_load_state_type_mismatch():
    with pytest.raises(InvalidArgumentError, match="'t' is a tensor in the state but int"):
        load_state({"t": torch.zeros(1)}, {"t": 3}, source="ck")
    arr = np.zeros(3)
    with pytest.raises(InvalidArgumentError, match="Shape of 'a'"):
        load_state({"a": arr}, {"a": np.zeros(4)}, source="ck")


def _spec(t, name="x"):
    return TensorSpec(name, t.dtype, tuple(t.shape))


def test_check_state_compares_specs_and_changes_nothing():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    state = {"model": model, "opt": opt, "t": torch.zeros(4), "a": np.zeros(2), "n": 3}

    def specs(obj):
        if isinstance(obj, torch.Tensor):
            return _spec(obj)
        if isinstance(obj, np.ndarray):
            return _spec(torch.from_numpy(obj))
        if isinstance(obj, dict):
            return {k: specs(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [specs(v) for v in obj]
        return obj

    tree = {
        "model": specs(model.state_dict()),
        "opt": specs(opt.state_dict()),
        "t": _spec(torch.zeros(4)),
        "a": _spec(torch.zeros(2, dtype=torch.float64)),
        "n": 5,
    }
    assert check_state(state, tree, source="ck") == []
    assert state["n"] == 3  # Nothing loaded.
    # An optimizer state of another shape is found too (torch's own load would not see it).
    tree["opt"]["state"][0]["exp_avg"] = TensorSpec("x", torch.float32, (7, 7))
    with pytest.raises(InvalidArgumentError, match=r"Shape of 'opt/state/0/exp_avg' .*\(2, 3\)"):
        check_state(state, tree, source="ck")
    tree["opt"] = specs(opt.state_dict())
    tree["a"] = _spec(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(InvalidArgumentError, match=r"Shape of 'a' in the state \(2,\)"):
        check_state(state, tree, source="ck")
    tree["a"] = _spec(torch.zeros(2, dtype=torch.float32))
    (message,) = check_state(state, tree, source="ck")
    assert message.startswith("Dtype of 'a' changed: float32 in checkpoint ck, float64")
    with pytest.raises(InvalidArgumentError, match="'t' is a tensor in the state but int"):
        check_state(state, {**tree, "t": 3}, source="ck")
    missing = []
    check_state({"gone": torch.zeros(1)}, {}, source="ck", on_missing=missing.append)
    assert missing == ["gone"]
    with pytest.raises(NotFoundError, match="Key gone not found in checkpoint ck"):
        check_state({"gone": torch.zeros(1)}, {}, source="ck")


class _Renaming(nn.Module):
    """Accepts the entries of an older version under another name."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "old_weight" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "old_weight")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def test_check_state_leaves_modules_that_load_their_own_way_to_them():
    tree = {"model": {"old_name": TensorSpec("x", torch.float32, (9,))}}
    hooked = torch.nn.Linear(3, 2)
    hooked._register_load_state_dict_pre_hook(lambda *args, **kwargs: None)
    assert check_state({"model": hooked}, tree, source="ck") == []
    model = nn.Sequential(nn.Linear(3, 3), _Renaming())
    tree = {"model": {"0.weight": TensorSpec("x", torch.float32, (3, 3)), "1.old_weight": 0}}
    assert check_state({"model": model}, tree, source="ck") == []
    # Standard modules, BatchNorm's own loader included, are checked.
    norm = nn.BatchNorm1d(3)
    with pytest.raises(InvalidArgumentError, match=r"missing keys \['running_var'"):
        tree = {"model": {k: _spec(v) for k, v in norm.state_dict().items() if k != "running_var"}}
        check_state({"model": norm}, tree, source="ck")


class _WithoutStorage(nn.Parameter):
    """A parameter whose storage cannot be read, as a DTensor's (FSDP2) cannot."""

    def untyped_storage(self):
        raise RuntimeError("Attempted to access the data pointer on an invalid python storage.")


def test_frozen_tensors_with_tensors_without_storage_of_their_own():
    backbone = nn.Linear(2, 2).requires_grad_(False).eval()
    head = nn.Linear(2, 2)
    head.weight = _WithoutStorage(head.weight.detach().clone(), requires_grad=False)
    frozen: set[str] = set()
    _, tensors = flatten_state({"backbone": backbone, "head": head}, frozen=frozen)
    assert len(tensors) == 4
    assert frozen == {"backbone/weight", "backbone/bias", "head/weight"}  # head/bias trains.
    # A trainable one: its memory is unknown, so no other tensor is provably apart from it.
    head.weight.requires_grad_(True)
    frozen.clear()
    flatten_state({"backbone": backbone, "head": head}, frozen=frozen)
    assert frozen == set()
