"""The walk of one process's state at a save (``walk.walk_state(sharded=False)``) and its memo.

A save of one process's state walks it with the live tensors (parameters undetached) and takes
from the last walk what did not change (``WalkMemo``). These tests change what a training run
can change between saves and check, after each change, that the walk with the memo gives what
``flatten_state`` gives from scratch: the same skeleton, the same names in the same order, the
same data under each name, and the same frozen tensors (which incremental saves rely on).
Then they save through a ``Saver``, which uses this walk.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from torchsupervisor import Saver, Session
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.checkpoint.snapshot import Stager
from torchsupervisor.core.state import flatten_state
from torchsupervisor.core.walk import WalkMemo, walk_state
from torchsupervisor.errors import ShardedStateError


def _state():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    backbone.requires_grad_(False)
    head = nn.Linear(4, 2)
    side = nn.Linear(2, 2)  # Trainable, but no optimizer updates it.
    optimizer = torch.optim.Adam(head.parameters(), lr=0.1)
    state = {
        "backbone": backbone,
        "head": head,
        "side": side,
        "optimizer": optimizer,
        "bare": torch.arange(3.0),
        "array": np.arange(4, dtype=np.int64),
        "extra": {"lr": 0.1, "scale": torch.ones(2)},
    }
    return state


def _train(state):
    optimizer = state["optimizer"]
    optimizer.zero_grad()
    x = state["backbone"](torch.randn(8, 4))
    (state["head"](x).sum() + state["side"](x[:, :2]).sum()).backward()
    optimizer.step()


def _differences(state, memo) -> list[str]:
    """What differs between the memo's walk of ``state`` and ``flatten_state`` (empty: none)."""
    frozen: set[str] = set()
    skeleton, tensors = walk_state(
        state, keep_vars=True, memo=memo, sharded=False, detach=False, frozen=frozen
    )
    fresh_frozen: set[str] = set()
    fresh_skeleton, fresh = flatten_state(state, frozen=fresh_frozen)
    problems = []
    if skeleton != fresh_skeleton:
        problems.append("skeleton")
    if frozen != fresh_frozen:
        problems.append(f"frozen {sorted(frozen)} != {sorted(fresh_frozen)}")
    if list(tensors) != list(fresh):
        return [*problems, f"names {list(tensors)} != {list(fresh)}"]
    for name, tensor in tensors.items():
        other = fresh[name]
        if (tensor.data_ptr(), tensor.dtype, tensor.shape) != (
            other.data_ptr(),
            other.dtype,
            other.shape,
        ) or not torch.equal(tensor.detach(), other):
            problems.append(f"data of {name}")
    return problems


class _Holder:
    """A stateful object whose state dict is a given mapping."""

    def __init__(self, mapping):
        self.mapping = mapping

    def state_dict(self):
        return self.mapping


def _walked(memo, before) -> list[str]:
    """The mappings the last walk did not take from the memo."""
    return sorted(path for path, leaves in memo.last.items() if before.get(path) is not leaves)


def test_the_memo_walk_of_one_process_gives_what_flatten_state_gives():
    state = _state()
    _train(state)
    memo = WalkMemo()
    outcomes = {}

    def walk(label):
        before = dict(memo.last)
        outcomes[label] = (_differences(state, memo), _walked(memo, before))

    head, side, backbone = state["head"], state["side"], state["backbone"]
    walk("first")
    _train(state)  # Values change in place.
    walk("trained")
    side.weight.requires_grad_(False)  # Now frozen: the record of "side" must not be taken.
    walk("side frozen")
    walk("side frozen again")
    backbone.train()  # Its running statistics are now updated: not frozen any more.
    walk("backbone training")
    head.weight.data = torch.full((2, 4), 3.0)  # New memory behind the same parameter.
    walk("data replaced")
    head.bias = nn.Parameter(torch.zeros(2))  # A new parameter object.
    walk("parameter replaced")
    state["optimizer"].param_groups[0]["lr"] = 0.5
    walk("lr")
    state["extra"]["lr"] = 0.2  # A new float object.
    walk("float")
    state["bare"].requires_grad_(True)  # A bare tensor that trains: never frozen.
    walk("bare trains")
    # The very same mapping, now the state of another kind of object: never frozen there.
    state["extra"] = _Holder(state["extra"])
    walk("same mapping, other origin")

    problems = {label: p for label, (p, _) in outcomes.items() if p}
    assert not problems, problems
    walked = {label: paths for label, (_, paths) in outcomes.items()}
    assert {"backbone", "head", "side", "optimizer/state", "extra"} <= set(walked["first"])
    assert walked["trained"] == [] and walked["lr"] == [], walked
    assert walked["side frozen"] == ["side"] and walked["side frozen again"] == [], walked
    assert walked["backbone training"] == [], walked  # Volatility is read at every walk.
    assert walked["data replaced"] == [], walked  # The live parameter: read at the copy.
    assert walked["parameter replaced"] == ["head"], walked
    assert walked["float"] == ["extra"], walked
    assert walked["same mapping, other origin"] == ["extra"], walked


def test_the_walk_of_one_process_refuses_what_needs_a_sharded_save():
    class NeedsShardedSave:
        is_sharded_state = True

        def state_dict(self):
            return {}

    with pytest.raises(ShardedStateError, match="'optimizer'"):
        walk_state({"optimizer": NeedsShardedSave()}, keep_vars=True, sharded=False)


def _referencing(tmp_path):
    """A trained state saved 3 times: the third save references the frozen backbone (the
    second save of a directory is full: ``test_incremental.py``)."""
    state = _state()
    _train(state)
    saver = Saver(max_to_keep=10)
    sess = Session(state)
    path = str(tmp_path / "model.ckpt")
    for step in (1, 2, 3):
        saver.save(sess, path, global_step=step)
    return state, saver, sess, path


def test_a_parameter_frozen_between_saves_is_referenced_by_the_next_incremental_save(tmp_path):
    state, saver, sess, path = _referencing(tmp_path)
    reused_before = saver.last_save.bytes_reused
    assert reused_before > 0  # The backbone's weights.
    state["side"].requires_grad_(False)
    saver.save(sess, path, global_step=4)  # Copied once more: now frozen.
    assert saver.last_save.bytes_reused == reused_before
    saver.save(sess, path, global_step=5)
    side_bytes = sum(p.numel() * p.element_size() for p in state["side"].parameters())
    assert saver.last_save.bytes_reused == reused_before + side_bytes


def test_a_save_copies_the_live_parameters_outside_autograd(tmp_path):
    state = _state()
    _train(state)
    head = state["head"]
    path = Saver().save(Session(state), str(tmp_path / "model.ckpt"), global_step=1)
    assert head.weight.requires_grad and head.weight.grad_fn is None
    snapshot = Stager().stage({}, {"w": head.weight}, step=1, wall_time=0.0)
    staged = snapshot.tensors()["w"]
    assert not staged.requires_grad and staged.grad_fn is None  # No graph over the buffers.
    assert torch.equal(staged, head.weight.detach())
    reader = CheckpointReader(path)
    assert torch.equal(reader.get_tensor("head/weight"), head.weight.detach())
    head.weight.data = torch.full((2, 4), 7.0)  # The same parameter, new memory.
    path = Saver().save(Session(state), str(tmp_path / "model.ckpt"), global_step=2)
    assert torch.equal(CheckpointReader(path).get_tensor("head/weight"), torch.full((2, 4), 7.0))


class _OwnStateDict(nn.Module):
    """A module whose ``state_dict`` takes no ``keep_vars``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.arange(4.0))

    def state_dict(self):  # type: ignore[override]
        return {"weight": self.weight.detach() * 1}

    def load_state_dict(self, state_dict, strict=True):  # type: ignore[override]
        with torch.no_grad():
            self.weight.copy_(state_dict["weight"])


def test_a_module_with_its_own_state_dict_is_saved_and_restored(tmp_path):
    state = {"model": _OwnStateDict()}
    saver = Saver()
    path = saver.save(Session(state), str(tmp_path / "model.ckpt"), global_step=1)
    fresh = {"model": _OwnStateDict()}
    with torch.no_grad():
        fresh["model"].weight.zero_()
    Saver().restore(Session(fresh), path)
    assert torch.equal(fresh["model"].weight.detach(), torch.arange(4.0))


def test_new_data_behind_a_frozen_parameter_is_saved_not_referenced(tmp_path):
    # The walk hands the stager the live parameter; what a later save compares with must be
    # the memory that was copied, not the parameter (whose data ``.data =`` can replace
    # without a version-counter bump, as ``Module.to`` and weight swaps do).
    state, saver, sess, path = _referencing(tmp_path)
    weight = state["backbone"][0].weight
    assert saver.last_save.bytes_reused > 0
    weight.data = torch.full((4, 4), 5.0)  # Not a write: new memory, the same version.
    last = saver.save(sess, path, global_step=4)
    assert torch.equal(CheckpointReader(last).get_tensor("backbone/0.weight"), weight.detach())
    CheckpointReader(last).verify()


class _Counter:
    """A stateful object whose state dict is a plain value."""

    def state_dict(self) -> dict:
        return {"count": 3}


@pytest.mark.parametrize("memo", [False, True])
def test_a_walk_keeps_nothing_it_met_alive_once_it_returns(memo):
    # Without the garbage collector: what the walk met is released as soon as the caller
    # lets go (a data loader's workers, say, stop then, not at the next collection).
    import gc
    import weakref

    walks = WalkMemo() if memo else None
    stateful, model = _Counter(), nn.Linear(2, 2)
    refs = [weakref.ref(stateful), weakref.ref(model)]
    enabled = gc.isenabled()
    gc.disable()
    try:
        walk_state({"s": stateful, "m": model}, keep_vars=memo, memo=walks, frozen=set())
        del stateful, model
        if walks is not None:
            del walks  # The memo holds the model's state dict until the next walk.
        assert [r() for r in refs] == [None, None]
    finally:
        if enabled:
            gc.enable()


def test_an_equal_list_of_leaves_is_handed_over_as_the_last_walks_own_list():
    memo = WalkMemo()

    def walked(values: list) -> list:
        return walk_state({"o": {"params": values}}, keep_vars=True, memo=memo, sharded=False)[0][
            "o"
        ]["params"]

    first = walked([0, 1, 300, "w", None, True])
    again = walked([0, 1, 300, "w", None, True])  # A new list, equal item for item.
    assert again is first and again == [0, 1, 300, "w", None, True]
    # Equal but of another type (True == 1), another length or another item: a list of its
    # own, never the last one; and a list with a float (0.0 == -0.0) is never kept.
    changes = [
        [0, True, 300, "w", None, True],
        [0, 1, 300, "w", None],
        [0, 1, 301, "w", None, True],
    ]
    for values in changes:
        out = walked(values)
        assert (
            out is not first and out == values and list(map(type, out)) == list(map(type, values))
        )
        first = out
    with_float = walked([0.0, 1])
    assert walked([-0.0, 1]) is not with_float
    assert str(walked([-0.0, 1])[0]) == "-0.0"
    # Without a memo every walk makes its own.
    plain = walk_state({"o": {"params": [1, 2]}}, keep_vars=True, sharded=False)[0]
    assert plain["o"]["params"] == [1, 2]
