"""A sharded state's local view (``tiers/local_shards``) and the steps every rank holds
(``tiers/agreed.common_steps``)."""

from __future__ import annotations

import pytest
import torch

from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState
from torchsupervisor.errors import InvalidArgumentError
from torchsupervisor.testing import run_world
from torchsupervisor.tiers.agreed import common_steps
from torchsupervisor.tiers.local_shards import LocalShards, local_view


def _copy(node):
    if isinstance(node, torch.Tensor):
        return node.detach().clone()
    if isinstance(node, dict):
        return {key: _copy(value) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_copy(value) for value in node)
    return node


def _differences(a, b, path=""):
    if isinstance(a, torch.Tensor):
        same = type(b) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [path]
        return [d for key in a for d in _differences(a[key], b[key], f"{path}/{key}")]
    if isinstance(a, (list, tuple)):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}/{i}")]
    return [] if a == b else [path]


def round_trip_rank(rank: int, world_size: int) -> list[str]:
    """FSDP2 + AdamW: the local view's state dict holds plain local shards; loading a copy
    taken before two more steps brings back exactly those shards; another layout is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": ShardedOptimizerState(model, optimizer), "step": 3}
    view = local_view(state)
    assert isinstance(view["model"], LocalShards) and isinstance(view["optimizer"], LocalShards)
    assert view["step"] == 3

    def train():
        model(torch.randn(6, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    train()
    taken = {name: _copy(view[name].state_dict()) for name in ("model", "optimizer")}
    shard = taken["model"]["0.weight"]
    assert type(shard) is torch.Tensor and shard.shape == ((3 if rank == 0 else 2), 4)  # 5 rows.
    assert type(taken["optimizer"]["state"]["0.weight"]["exp_avg"]) is torch.Tensor
    train()
    train()
    for name in ("model", "optimizer"):
        view[name].load_state_dict(_copy(taken[name]))
    found = [d for n in taken for d in _differences(taken[n], view[n].state_dict(), n)]
    wrong = _copy(taken["model"])
    wrong["0.weight"] = torch.zeros(4, 4)
    with pytest.raises(InvalidArgumentError, match=r"local shard of '/0.weight' is \(4, 4\)"):
        view["model"].load_state_dict(wrong)
    return found


def test_the_local_view_of_an_fsdp2_state_round_trips_its_shards():
    assert run_world(round_trip_rank, world_size=2) == [[], []]


@pytest.mark.parametrize(
    "held, common",
    [
        ([[9, 10], [9, 10]], [10, 9]),
        ([[9, 10, 11], [8, 9]], [9]),  # One rank's writer two snapshots ahead.
        ([[10], [9]], []),
        ([[1, 2], []], []),  # A rank without snapshots: nothing is common.
        ([[5]], [5]),
    ],
)
def test_the_steps_every_rank_holds_newest_first(held, common):
    assert common_steps(held) == common
