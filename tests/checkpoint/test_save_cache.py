"""The save cache changes no byte: the same saves with the cache on and off give equal files.

Random states (nested containers, tensors of many dtypes and shapes, plain values, modules,
optimizers) go through a run of saves, synchronous and in the background, with what a
training run changes between them (a step, values in place, a tensor replaced, a key added
or removed, a parameter frozen, a plain value); the run is made twice, with
``TORCHSUPERVISOR_SAVE_CACHE`` on and off, and every file is compared byte for byte. The
same for FSDP2 (DTensor) states on 2 ranks.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from test_sharded import _build, _state, _train_step

from torchsupervisor import GlobalStep, Saver
from torchsupervisor.checkpoint.save_cache import SAVE_CACHE_ENV, SaveCache, save_cache_enabled
from torchsupervisor.testing import FakeClock, run_world

WAIT_SECS = 60.0
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8]
_DTYPES += [torch.uint8, torch.bool]
_LOCK = ".torchsupervisor-writer.lock"


def _tensor(rng: random.Random) -> torch.Tensor:
    shape = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
    dtype = rng.choice(_DTYPES)
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    values = torch.randn(shape, generator=generator) * 10
    return values > 0 if dtype == torch.bool else values.to(dtype)


def _tree(rng: random.Random, depth: int) -> object:
    kind = rng.random()
    if depth >= 3 or kind < 0.35:
        return _tensor(rng)
    if kind < 0.5:
        return rng.choice([1, -7, 2.5, "text", None, True, b"\x00\x01"])
    if kind < 0.8:
        return {f"k{i}": _tree(rng, depth + 1) for i in range(rng.randint(0, 4))}
    items = [_tree(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return items if rng.random() < 0.5 else tuple(items)


def _tensors_of(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors_of(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors_of(v)]
    return []


def _run(seed: int, directory: str) -> None:
    """One run of saves of a random state, with changes between them."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    optimizer = rng.choice(
        [
            lambda p: torch.optim.Adam(p, lr=0.01),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        ]
    )(model.parameters())
    state: dict = {
        "model": model,
        "optimizer": optimizer,
        "global_step": GlobalStep(),
        "extra": {f"e{i}": _tree(rng, 0) for i in range(4)},
    }
    saver = Saver(var_list=state, clock=FakeClock(), max_to_keep=None)
    save_path = os.path.join(directory, "model.ckpt")
    for save in range(5):
        model(torch.randn(3, 5)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        state["global_step"].increment()
        change = rng.choice(["none", "in place", "replace", "add", "remove", "freeze", "plain"])
        extra = state["extra"]
        if change == "in place":
            for t in _tensors_of(extra):
                if t.dtype.is_floating_point:
                    t.add_(1)
        elif change == "replace":
            extra[rng.choice(sorted(extra))] = _tensor(rng)
        elif change == "add":
            extra[f"new{save}"] = _tree(rng, 1)
        elif change == "remove" and extra:
            del extra[rng.choice(sorted(extra))]
        elif change == "freeze":
            model[0].weight.requires_grad_(not model[0].weight.requires_grad)
        elif change == "plain":
            extra["lr"] = rng.random()
        step = state["global_step"]
        if rng.random() < 0.5:
            saver.save(None, save_path, global_step=step)
        else:
            saver.save_async(None, save_path, global_step=step).result(WAIT_SECS)
    saver.close()


def _files(directory: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name != _LOCK:
            with open(os.path.join(directory, name), "rb") as f:
                out[name] = f.read()
    return out


def _both_ways(tmp_path, monkeypatch, run) -> tuple[dict[str, bytes], dict[str, bytes]]:
    runs = []
    for setting in ("1", "0"):
        monkeypatch.setenv(SAVE_CACHE_ENV, setting)
        directory = tmp_path / f"cache-{setting}"
        directory.mkdir()
        run(str(directory))
        runs.append(_files(str(directory)))
    return runs[0], runs[1]


@pytest.mark.parametrize("seed", range(8))
def test_random_states_give_the_same_bytes_with_and_without_the_cache(tmp_path, monkeypatch, seed):
    cached, uncached = _both_ways(tmp_path, monkeypatch, lambda d: _run(seed, d))
    assert list(cached) == list(uncached)
    assert len([n for n in cached if n.endswith(".index")]) == 5
    for name in cached:
        assert cached[name] == uncached[name], name


def sharded_run(rank: int, world_size: int, directory: str, cache: str) -> None:
    """Asynchronous sharded saves of an FSDP2 state, training between them."""
    os.environ[SAVE_CACHE_ENV] = cache
    from torch.distributed.tensor import Shard, distribute_tensor

    model, optimizer = _build(0, world_size)
    state = _state(model, optimizer, 1)
    mesh = model[0].weight.device_mesh
    state["extra"]["d"] = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    saver = Saver(var_list=state, clock=FakeClock(), max_to_keep=None)
    save_path = os.path.join(directory, "model.ckpt")
    for step in range(1, 5):
        _train_step(model, optimizer, step)
        state["global_step"] = step
        if step == 3:
            state["extra"]["tag"] = "changed"
            state["extra"]["added"] = torch.ones(3)
        saver.save_async(None, save_path, global_step=step).result(WAIT_SECS)
    saver.close()


def test_sharded_states_give_the_same_bytes_with_and_without_the_cache(tmp_path, monkeypatch):
    def run(directory: str) -> None:
        cache = os.environ[SAVE_CACHE_ENV]
        run_world(sharded_run, directory, cache, world_size=2, timeout_secs=240)

    cached, uncached = _both_ways(tmp_path, monkeypatch, run)
    assert len([n for n in cached if n.endswith(".index")]) == 4
    assert list(cached) == list(uncached)
    for name in cached:
        assert cached[name] == uncached[name], name


@pytest.mark.parametrize(("value", "on"), [("1", True), ("0", False), ("off", False), ("", True)])
def test_the_switch(monkeypatch, value, on):
    monkeypatch.setenv(SAVE_CACHE_ENV, value)
    assert save_cache_enabled() is on
    assert SaveCache.create().enabled is on
    assert SaveCache.create(enabled=True).enabled and not SaveCache.create(enabled=False).enabled
