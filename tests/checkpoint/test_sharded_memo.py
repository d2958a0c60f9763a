"""What an asynchronous sharded save reuses from the save before: the walk's and the stage's memos.

Between two saves the state is mostly the very same objects, so the walk of the state
(``WalkMemo``) and the staged table (``StageMemo``) are taken from the last save while nothing
of them changed. These tests change what a training run can change between saves (values in
place, a learning rate, an optimizer's state tensor replaced, a parameter's local tensor
swapped as FSDP2 does, a key added or moved, a tensor that starts requiring gradients) and
check that the result is exactly that of a walk or stage from scratch, on real FSDP2 states.
"""

from __future__ import annotations

import os

import torch
from test_sharded import _build, _full_tensors, _state, _train_step

from torchsupervisor import Saver
from torchsupervisor.core.tree import encode_tree
from torchsupervisor.core.walk import walk_state
from torchsupervisor.testing import run_world, save_cache_of

WAIT_SECS = 60.0


def _same_walk(memo_walk, fresh_walk, memo_local, fresh_local, detached) -> list[str]:
    """What differs between a walk with the memo and one from scratch (empty: nothing).

    ``detached``: the names of plain tensors that require gradients: each walk detaches them
    (a new tensor object over the same data)."""
    (skeleton, tensors), (fresh_skeleton, fresh_tensors) = memo_walk, fresh_walk
    problems = []
    if skeleton != fresh_skeleton:
        problems.append("skeleton")
    if list(tensors) != list(fresh_tensors) or list(memo_local) != list(tensors):
        problems.append(f"names {list(tensors)} != {list(fresh_tensors)}")
        return problems
    for name, tensor in tensors.items():
        fresh = fresh_tensors[name]
        if name in detached:
            same = fresh.data_ptr() == tensor.data_ptr() and not tensor.requires_grad
            if not same or memo_local[name].data_ptr() != fresh.data_ptr():
                problems.append(f"detached {name}")
            continue
        if tensor is not fresh:
            problems.append(f"tensor {name}")
        if memo_local[name] is not fresh_local[name]:
            problems.append(f"local {name}")
    return problems


def walk_memo_rank(rank: int, world_size: int) -> list[tuple[str, list[str], list[str]]]:
    """Walk an FSDP2 state with and without the memo after each kind of change; what differs
    and which mappings were walked again."""
    from collections import OrderedDict

    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from torchsupervisor.core.walk import WalkMemo, walk_state

    model, optimizer = _build(0, world_size)
    _train_step(model, optimizer, 0)
    mesh = model[0].weight.device_mesh
    loose = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    extra = OrderedDict(a=loose, b=torch.zeros(3), lr=0.1)
    state = {**_state(model, optimizer, 1), "loose": extra, "a": {"b/c": torch.ones(2)}}
    state["a/b"] = {"c": torch.ones(1)}  # "a/b/c" twice: "a/b/c#1" (not memoized).
    memo = WalkMemo()
    outcomes = []

    def walk(label: str) -> None:
        before = dict(memo.last)
        local: dict = {}
        fresh_local: dict = {}
        ours = walk_state(state, keep_vars=True, local=local, memo=memo)
        fresh = walk_state(state, keep_vars=True, local=fresh_local)
        walked = sorted(p for p, leaves in memo.last.items() if before.get(p) is not leaves)
        detached = {"loose/b"} if extra["b"].requires_grad else set()
        outcomes.append((label, _same_walk(ours, fresh, local, fresh_local, detached), walked))

    param = model[0].weight
    first = optimizer.state[param]
    walk("first")
    _train_step(model, optimizer, 1)  # Values change in place: nothing is walked again.
    walk("trained")
    optimizer.param_groups[0]["lr"] = 0.5  # Param groups are walked at each save anyway.
    walk("lr")
    first["exp_avg"] = first["exp_avg"] * 2  # A new DTensor for one state entry.
    walk("exp_avg replaced")
    # FSDP2 swaps a parameter's local tensor (``reset_sharded_param``): the memo must see it.
    param._local_tensor = param._local_tensor.clone() + 1
    walk("local swapped")
    loose._local_tensor = loose._local_tensor.clone()
    walk("loose local swapped")
    extra["lr"] = 0.2  # A new float object.
    walk("float")
    extra.move_to_end("a")  # The same objects in another order.
    walk("moved")
    extra["b"].requires_grad_(True)  # Now detached by the walk: a new object each time.
    walk("requires grad")
    walk("requires grad again")
    first["new"] = torch.ones(1)
    walk("key added")
    del first["new"]
    walk("key removed")
    assert isinstance(first["exp_avg"], DTensor)
    return outcomes


def test_the_walk_memo_gives_what_a_walk_from_scratch_gives():
    (outcomes,) = run_world(walk_memo_rank, world_size=1)
    problems = {label: problems for label, problems, _ in outcomes if problems}
    assert not problems, problems
    walked = {label: paths for label, _, paths in outcomes}
    first_state = "optimizer/state/0.weight"
    assert "model" in walked["first"] and first_state in walked["first"], walked["first"]
    # "a/b"'s tensor was renamed "a/b/c#1" after "a"'s "a/b/c": never taken as it was.
    assert "a" in walked["first"] and "a/b" not in walked["first"], walked["first"]
    assert walked["trained"] == [] and walked["lr"] == [], walked
    # The optimizer's state is taken whole, or each parameter's as far as it is the same.
    assert "optimizer/state" in walked["first"]
    assert walked["exp_avg replaced"] == ["optimizer/state", first_state]
    assert walked["local swapped"] == ["model"]
    assert walked["loose local swapped"] == ["loose"] and walked["float"] == ["loose"]
    assert walked["moved"] == ["loose"]
    assert walked["requires grad"] == walked["requires grad again"] == [], walked
    assert walked["key added"] == walked["key removed"] == ["optimizer/state", first_state]


def stage_memo_rank(
    rank: int, world_size: int, directory: str
) -> list[tuple[str, bool, bool, bool, bool]]:
    """Save asynchronously after each kind of change, training on while each save is written;
    read each checkpoint back whole and compare it with the state at its step. Also: whether
    the staged table was the last save's, whether the shard was written with the last
    save's chunks and layout (``in_place.ShardMemo``), and whether the rank's rows went to
    the coordinator without being sent again (``packed.SentRows``)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from torchsupervisor import CheckpointReader

    model, optimizer = _build(0, world_size)
    _train_step(model, optimizer, 0)
    state = _state(model, optimizer, 1)
    mesh = model[0].weight.device_mesh
    state["extra"]["d"] = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    saver = Saver(var_list=state, max_to_keep=None)
    memo = save_cache_of(saver).staged
    shards = save_cache_of(saver).plans.shards
    sent = save_cache_of(saver).plans.sent
    save_path = os.path.join(directory, "model.ckpt")
    outcomes = []

    trees = save_cache_of(saver).plans.trees  # The coordinator's (``tree_memo``).
    taken_trees = []

    def save(label: str, step: int) -> None:
        state["global_step"] = step
        reference = _full_tensors(state)  # What the save must hold (a collective).
        tree = encode_tree(walk_state(state)[0])  # What its manifest's tree must be.
        last, taken, spared = memo.last, shards.taken, sent.spared
        future = saver.save_async(None, save_path, global_step=step)
        reused = last is not None and memo.last is last
        _train_step(model, optimizer, step)  # Changes every value before the write ends.
        reader = CheckpointReader(future.result(WAIT_SECS))
        reader.verify()  # Every byte against its CRC-32C.
        same = sorted(reader.read_tensors()) == sorted(reference) and all(
            torch.equal(reader.get_tensor(name), tensor) for name, tensor in reference.items()
        )
        assert reader.manifest.tree == tree, label
        outcomes.append((label, same, reused, shards.taken > taken, sent.spared > spared))
        taken_trees.append(trees.taken)

    save("first", 1)
    save("second", 2)  # The same tensors: the staged table is the last save's.
    save("third", 3)
    param = model[2].bias
    param._local_tensor = param._local_tensor.clone() * -3  # FSDP2 swaps a local tensor.
    save("local swapped", 4)
    save("after the swap", 5)
    first = optimizer.state[model[0].weight]
    first["exp_avg_sq"] = first["exp_avg_sq"] + 1  # A new DTensor in the optimizer's state.
    save("state replaced", 6)
    # Another placement, the same local shape: (4, 2) in two rows each, now (2, 2) whole.
    local = torch.full((4 // world_size, 2), 7.0 + rank)
    state["extra"]["d"] = distribute_tensor(local, mesh, [Replicate()])
    save("placement changed", 7)
    saver.close()
    # The coordinator's replayed saves encoded their tree from the last one's containers
    # where the walk handed over the very same ones.
    assert (max(taken_trees) > 0) == (rank == 0), taken_trees
    return outcomes


def test_the_stage_memo_saves_what_the_state_holds_at_each_step(tmp_path):
    for outcomes in run_world(stage_memo_rank, str(tmp_path)):
        assert [same for _, same, *_ in outcomes] == [True] * 7, outcomes
        # A swapped local tensor is copied from where it is now; its DTensor is the same.
        assert {label for label, _, reused, *_ in outcomes if reused} == {
            "second",
            "third",
            "local swapped",
            "after the swap",
        }, outcomes
        # The writer took the last shard's chunks and layout where the plan was replayed and
        # the staged table held the very same objects (the first replayed save only keeps
        # them; a replaced state tensor is staged into the same buffer, under the same
        # DTensor); a new placement is planned by DCP. Each checkpoint above is still the
        # state of its step, every byte checked.
        took = {label for label, _, _, took, _ in outcomes if took}
        assert took == {"third", "local swapped", "after the swap", "state replaced"}, outcomes
        # Those shards' rows were the last save's: the coordinator took them as received then
        # (and each checkpoint above still holds its step's state).
        assert {label for label, *_, spared in outcomes if spared} == took, outcomes
