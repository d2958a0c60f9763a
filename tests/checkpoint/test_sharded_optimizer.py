"""``ShardedOptimizerState.state_dict``: DCP names the parameters once; later calls remap
``optimizer.state_dict()`` with those names while the parameters stay the same objects, and
ask DCP again whenever they may have changed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint.state_dict as dcp_state_dict
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState
from torchsupervisor.testing import run_world


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _same(a, b) -> bool:
    """Equal structure and keys in the same order; tensors equal in dtype, shape and values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.fixture
def dcp_calls(monkeypatch):
    """Counts the calls of DCP's ``get_optimizer_state_dict``."""
    calls = []
    real = dcp_state_dict.get_optimizer_state_dict

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp_state_dict, "get_optimizer_state_dict", counted)
    return calls


def test_later_calls_remap_without_dcp_and_match_it(dcp_calls):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    state = ShardedOptimizerState(model, optimizer)
    state.state_dict()  # Creates the state (DCP steps an empty optimizer once).
    assert len(dcp_calls) == 1
    for _ in range(3):
        _step(model, optimizer)
        optimizer.param_groups[0]["lr"] *= 0.5  # A schedule: the groups are read afresh.
        ours = state.state_dict()
        assert _same(ours, dcp_state_dict.get_optimizer_state_dict(model, optimizer))
    assert len(dcp_calls) == 1 + 3  # Only the comparisons above asked DCP.
    assert list(ours["state"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert ours["param_groups"][0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert ours["state"]["2.bias"]["exp_avg"] is optimizer.state[model[2].bias]["exp_avg"]


def test_wrappers_names_are_dcps(dcp_calls):
    model = _model()
    model[0] = checkpoint_wrapper(model[0])  # Its parameters' module path gains a part.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = ShardedOptimizerState(model, optimizer)
    _step(model, optimizer)
    state.state_dict()
    ours = state.state_dict()
    assert len(dcp_calls) == 1
    assert list(ours["state"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert _same(ours, dcp_state_dict.get_optimizer_state_dict(model, optimizer))


def test_a_changed_parameter_set_asks_dcp_again(dcp_calls):
    model = _model()
    optimizer = torch.optim.Adam(model[0].parameters(), lr=0.1)
    state = ShardedOptimizerState(model, optimizer)
    _step(model, optimizer)
    assert list(state.state_dict()["state"]) == ["0.weight", "0.bias"]
    optimizer.add_param_group({"params": list(model[2].parameters())})
    _step(model, optimizer)
    assert list(state.state_dict()["state"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert len(dcp_calls) == 2
    # The same parameter objects under other names: the model's names are compared too.
    model._modules["head"] = model._modules.pop("2")
    renamed = state.state_dict()
    assert len(dcp_calls) == 3
    assert _same(renamed, dcp_state_dict.get_optimizer_state_dict(model, optimizer))
    assert list(renamed["state"]) == ["0.weight", "0.bias", "head.weight", "head.bias"]


class _Tagged(torch.nn.Linear):
    """A Linear of another class (FSDP2 changes a module's class the same way)."""


@pytest.mark.parametrize(
    "change",
    ["module wrapped", "parameters reordered", "module class", "children reordered", "replaced"],
)
def test_any_change_of_the_modules_asks_dcp_again(dcp_calls, change):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    state = ShardedOptimizerState(model, optimizer)
    _step(model, optimizer)
    state.state_dict()
    state.state_dict()
    assert len(dcp_calls) == 1  # Nothing changed: remapped.
    if change == "module wrapped":
        model[0] = checkpoint_wrapper(model[0])  # The same parameters, deeper in the tree.
    elif change == "parameters reordered":
        model[2]._parameters["weight"] = model[2]._parameters.pop("weight")
    elif change == "replaced":  # The optimizer's parameter is no longer the model's.
        model[2].bias = torch.nn.Parameter(model[2].bias.detach().clone())
        with pytest.raises(KeyError):  # What DCP raises: nothing is remapped silently.
            state.state_dict()
        assert len(dcp_calls) == 2
        return
    elif change == "module class":
        model[2].__class__ = _Tagged
    else:
        model._modules["0"] = model._modules.pop("0")  # The same modules, in another order.
    ours = state.state_dict()
    assert len(dcp_calls) == 2, change
    assert _same(ours, dcp_state_dict.get_optimizer_state_dict(model, optimizer))


def test_explicit_options_always_ask_dcp(dcp_calls):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    options = dcp_state_dict.StateDictOptions(flatten_optimizer_state_dict=True)
    state = ShardedOptimizerState(model, optimizer, options=options)
    _step(model, optimizer)
    first, second = state.state_dict(), state.state_dict()
    assert len(dcp_calls) == 2
    assert _same(first, second) and "state.0.weight.exp_avg" in first


def test_a_parameter_listed_twice_stays_with_dcp(dcp_calls):
    model = _model()
    params = list(model.parameters())
    with pytest.warns(UserWarning, match="duplicate parameters"):
        optimizer = torch.optim.SGD(params + params[:1], lr=0.1)
    state = ShardedOptimizerState(model, optimizer)
    state.state_dict(), state.state_dict()
    assert len(dcp_calls) == 2


def remap_rank(rank: int, world_size: int, directory: str) -> list[str]:
    """FSDP2 on every rank: the remapped state is DCP's, the same DTensors under the same names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = _model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = ShardedOptimizerState(model, optimizer)
    state.state_dict()
    _step(model, optimizer)
    ours = state.state_dict()
    theirs = dcp_state_dict.get_optimizer_state_dict(model, optimizer)
    assert list(ours["state"]) == list(theirs["state"])
    for name, slots in ours["state"].items():
        for slot, value in slots.items():
            assert value is theirs["state"][name][slot], (name, slot)
    assert isinstance(ours["state"]["0.weight"]["exp_avg"], DTensor)
    assert ours["param_groups"] == theirs["param_groups"]
    return list(ours["state"])


def test_fsdp2_ranks_remap_to_dcps_names(tmp_path):
    for names in run_world(remap_rank, str(tmp_path), world_size=2):
        assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_several_groups_and_a_schedule_give_dcps_state_without_dcp(dcp_calls):
    # The names learnt at the first call remap ``optimizer.state_dict()``: exactly what DCP
    # gives (the same keys in the same order, the state's; the same state objects; the
    # groups' hyperparameters read afresh).
    model = _model()
    optimizer = torch.optim.AdamW(
        [
            {"params": list(model[2].parameters()), "lr": 0.01},  # Stepped first below.
            {"params": list(model[0].parameters()), "weight_decay": 0.5},
        ],
        lr=0.1,
    )
    state = ShardedOptimizerState(model, optimizer)
    _step(model, optimizer)
    state.state_dict()
    for lr in (0.2, 0.3):
        optimizer.param_groups[1]["lr"] = lr
        ours = state.state_dict()
        assert list(ours["state"]) == ["2.weight", "2.bias", "0.weight", "0.bias"]
        assert ours["param_groups"][1]["lr"] == lr
        theirs = dcp_state_dict.get_optimizer_state_dict(model, optimizer)
        assert _same(ours, theirs)
        assert all(ours["state"][n] is optimizer.state[p] for n, p in _named(model, optimizer))
    assert len(dcp_calls) == 1 + 2  # Only the comparisons asked DCP.


def _named(model, optimizer):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [(by_id[id(p)], p) for p in optimizer.state]


@pytest.mark.parametrize("hook", ["pre", "post", "subclass"])
def test_an_optimizer_with_state_dict_hooks_is_packed_by_torch(dcp_calls, hook):
    # A hook may change what ``state_dict`` returns: torch's own call runs it.
    model = _model()

    class Tagging(torch.optim.Adam):
        def state_dict(self):
            result = super().state_dict()
            result["param_groups"][0]["tag"] = "subclass"
            return result

    kind = Tagging if hook == "subclass" else torch.optim.Adam
    optimizer = kind(model.parameters(), lr=0.1)
    state = ShardedOptimizerState(model, optimizer)
    _step(model, optimizer)
    state.state_dict()

    if hook == "pre":
        optimizer.register_state_dict_pre_hook(
            lambda optimizer: optimizer.param_groups[0].__setitem__("tag", "pre")
        )
    elif hook == "post":
        optimizer.register_state_dict_post_hook(
            lambda optimizer, result: result["param_groups"][0].__setitem__("tag", "post")
        )
    ours = state.state_dict()
    assert ours["param_groups"][0]["tag"] == hook
    assert len(dcp_calls) == 1


def test_a_state_key_that_is_no_parameter_goes_to_dcp(dcp_calls):
    # The names learnt are the parameters'; anything else in the state is left to torch and
    # DCP, which raise for it as they would without the names learnt.
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    state = ShardedOptimizerState(model, optimizer)
    _step(model, optimizer)
    state.state_dict()
    optimizer.state["extra"] = {"x": 1}
    with pytest.raises(KeyError, match="extra"):
        dcp_state_dict.get_optimizer_state_dict(model, optimizer)
    with pytest.raises(KeyError, match="extra"):
        state.state_dict()
    assert len(dcp_calls) == 3
