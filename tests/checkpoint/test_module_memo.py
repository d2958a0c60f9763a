"""``ModuleStateMemo``: a module's state dict taken from the last save while it cannot differ.

Each test changes one thing a state dict depends on and checks that the memo's answer is
exactly what ``state_dict(keep_vars=True)`` gives now (the same keys, in order, and the very
same objects), and whether the memo took the last result or called the module.
"""

from __future__ import annotations

import pytest
import torch
from test_sharded import _build, _train_step

from torchsupervisor.core.module_memo import ModuleStateMemo
from torchsupervisor.testing import run_world


class _Counter(torch.nn.Module):
    """A module whose state is more than its tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))
        self.count = 0

    def get_extra_state(self) -> int:
        self.count += 1
        return self.count

    def set_extra_state(self, state: int) -> None:
        self.count = state


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Sequential(torch.nn.Linear(4, 2))
    )


def _same(ours: dict, theirs: dict) -> bool:
    """The same keys in order and the very same objects (a tensor a module makes at each
    call, as ``Other`` does below, equal)."""
    return list(ours) == list(theirs) and all(
        ours[k] is theirs[k] or (k.endswith("other") and torch.equal(ours[k], theirs[k]))
        for k in theirs
    )


def _change(model: torch.nn.Module, change: str) -> None:
    inner = model[2]
    if change == "parameter replaced":
        inner[0].bias = torch.nn.Parameter(torch.zeros(2))
    elif change == "parameter removed":
        inner[0].bias = None
    elif change == "buffer replaced":
        model[1].running_mean = torch.zeros(4)
    elif change == "buffer made non-persistent":
        model[1]._non_persistent_buffers_set.add("running_var")
    elif change == "buffer added":
        inner[0].register_buffer("scale", torch.ones(1))
    elif change == "child replaced":
        inner[0] = torch.nn.Linear(4, 2)
    elif change == "child added":
        inner.append(torch.nn.Linear(2, 2))
    elif change == "child removed":
        del inner[0]
    elif change == "class changed":

        class Other(torch.nn.Linear):
            def _save_to_state_dict(self, destination, prefix, keep_vars):
                destination[prefix + "other"] = torch.zeros(1)

        inner[0].__class__ = Other
    elif change == "pre-hook":
        inner[0].register_state_dict_pre_hook(lambda *args: None)
    elif change == "post-hook":

        def renamed(module, state_dict, prefix, local_metadata):
            state_dict[prefix + "renamed"] = state_dict.pop(prefix + "weight")

        inner[0]._register_state_dict_hook(renamed)
    else:
        assert change == "nothing"


CHANGES = [
    "nothing",
    "parameter replaced",
    "parameter removed",
    "buffer replaced",
    "buffer made non-persistent",
    "buffer added",
    "child replaced",
    "child added",
    "child removed",
    "class changed",
    "pre-hook",
    "post-hook",
]


@pytest.mark.parametrize("change", CHANGES)
def test_the_memo_gives_what_the_module_gives_after_any_change(change):
    model, memo = _model(), ModuleStateMemo()
    memo.begin_walk()
    memo.state_dict(model, "model")
    memo.end_walk()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # Values change in place at every step: no change at all.
    _change(model, change)
    memo.begin_walk()
    ours = memo.state_dict(model, "model")
    memo.end_walk()
    assert _same(ours, model.state_dict(keep_vars=True))
    assert memo.taken == (1 if change == "nothing" else 0)
    # Whatever changed, the next call with nothing changed since is right again; a module
    # with a hook other than FSDP2's is called each time.
    memo.begin_walk()
    again = memo.state_dict(model, "model")
    memo.end_walk()
    assert _same(again, model.state_dict(keep_vars=True))
    hooked = change in ("pre-hook", "post-hook", "class changed")
    assert memo.taken == (2 if change == "nothing" else 0 if hooked else 1)


def test_a_module_with_extra_state_is_called_at_every_save():
    model, memo = torch.nn.Sequential(_Counter()), ModuleStateMemo()
    for count in (1, 2, 3):
        memo.begin_walk()
        assert memo.state_dict(model, "m")["0._extra_state"] == count
        memo.end_walk()
    assert memo.taken == 0


def test_a_module_not_met_by_a_walk_is_let_go():
    model, memo = _model(), ModuleStateMemo()
    memo.begin_walk()
    memo.state_dict(model, "model")
    memo.end_walk()
    memo.begin_walk()
    memo.end_walk()  # The state no longer has "model": its modules are not held.
    assert memo.last == {}
    memo.begin_walk()
    memo.state_dict(model, "model")  # Called again, and recorded again.
    memo.end_walk()
    assert memo.taken == 0 and memo.last["model"].tree.modules[0] is model


def fsdp2_rank(rank: int, world_size: int) -> list[tuple[str, bool, bool]]:
    """An FSDP2 model: its pre-hooks are FSDP2's, so the memo takes the last result while
    the registered parameters are the sharded ones, and calls the module (whose hook
    reshards) when they are not."""
    from torch.distributed.tensor import DTensor

    model, optimizer = _build(0, world_size)
    _train_step(model, optimizer, 0)
    memo, outcomes = ModuleStateMemo(), []

    def call(label: str) -> None:
        taken = memo.taken
        memo.begin_walk()
        ours = memo.state_dict(model, "model")
        memo.end_walk()
        theirs = model.state_dict(keep_vars=True)
        sharded = all(isinstance(v, DTensor) for v in theirs.values())
        outcomes.append((label, _same(ours, theirs) and sharded, memo.taken > taken))

    call("first")
    _train_step(model, optimizer, 1)
    call("trained")
    for layer in (model[0], model[2]):  # Their own parameter groups (the root has none).
        layer.unshard()  # Registers the unsharded parameters until the next reshard.
    assert not isinstance(model[0].weight, DTensor)
    call("unsharded")
    call("resharded by the hook")
    return outcomes


def test_an_fsdp2_model_is_taken_while_it_holds_its_sharded_parameters():
    (outcomes,) = run_world(fsdp2_rank, world_size=1)
    assert outcomes == [
        ("first", True, False),
        ("trained", True, True),
        ("unsharded", True, False),
        ("resharded by the hook", True, True),
    ], outcomes
