"""Asynchronous sharded saves: ``Saver.save_async`` of an FSDP2 state by 2 real gloo ranks.

The training thread only copies its local shards; the write, the ranks' agreement and the
commit run on the writer threads through their own process group, while training goes on
(FSDP2's collectives on the default group at the same time).
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import weakref

import safetensors.torch
import torch
import torch.distributed as dist
from test_sharded import REFERENCE, _build, _files, _full_tensors, _state, _train_step

from torchsupervisor import CheckpointReader, Saver, latest_checkpoint
from torchsupervisor.checkpoint.sharded.in_place import InPlaceShard
from torchsupervisor.checkpoint.sharded.metadata import ShardedManifest
from torchsupervisor.checkpoint.sharded.replay import PlanCache
from torchsupervisor.checkpoint.writers import ShardedWriter
from torchsupervisor.distributed import env
from torchsupervisor.testing import FaultyStorage, run_world, save_cache_of

WAIT_SECS = 60.0


def async_save_rank(rank: int, world_size: int, directory: str) -> dict:
    """Save at step 3 asynchronously; change every tensor before the writer starts; train on
    while a second save (step 5) is written; restore both into a fresh model."""
    model, optimizer = _build(0, world_size)
    for step in range(3):
        _train_step(model, optimizer, step)
    state = _state(model, optimizer, 3)
    state["extra"]["lrs"] = [0.1, 0.01]  # Plain values the training thread changes below.
    reference = _full_tensors(state)
    if rank == 0:
        safetensors.torch.save_file(reference, os.path.join(directory, REFERENCE))
    # The writer waits until the training thread has changed the live state.
    changed = threading.Event()
    persist = ShardedWriter.persist

    def gated(self, *args, **kwargs):
        assert changed.wait(WAIT_SECS)
        return persist(self, *args, **kwargs)

    ShardedWriter.persist = gated
    placed = []  # What each shard write found in place: (bytes in place, chunks copied after).
    write = InPlaceShard.write

    def recorded(self, staged, tensors, tensor_bytes=None):
        out = write(self, staged, tensors, tensor_bytes)
        crcs, blocks, parts = out
        assert len(crcs) == len(blocks) == len(self.entries)
        placed.append((parts[0].nbytes, len(parts) - 1, self.entries[-1][1].end))
        return out

    InPlaceShard.write = recorded
    # Whether each save replayed the plan of the one before (replay.PlanCache): asked only
    # where every rank had one that fits.
    replayed = []
    replay = PlanCache.replay

    def noted(self, *args, **kwargs):
        outcome = replay(self, *args, **kwargs)
        replayed.append(outcome is not None)
        return outcome

    PlanCache.replay = noted
    saver = Saver(var_list=state, max_to_keep=None)
    save_path = os.path.join(directory, "model.ckpt")
    future = saver.save_async(None, save_path, global_step=3)
    in_flight = saver.in_flight
    _train_step(model, optimizer, 3)  # FSDP2 collectives while the save is in flight.
    state["global_step"] = 4
    state["extra"]["lrs"][0] = 9.9  # The manifest is encoded later, by the writer.
    state["extra"]["lrs"].append(1.0)
    state["extra"]["tag"] = "changed"
    changed.set()
    first = future.result(WAIT_SECS)
    ShardedWriter.persist = persist
    stats = saver.last_save
    # Back to back, with training (and its collectives) running beside the writer.
    _train_step(model, optimizer, 4)
    state["global_step"] = 5
    reference5 = _full_tensors(state)
    second = saver.save_async(None, save_path, global_step=5)  # The staging buffers reused.
    _train_step(model, optimizer, 5)
    assert second.result(WAIT_SECS).endswith("model.ckpt-5")
    saver.close()
    InPlaceShard.write = write
    PlanCache.replay = replay
    # Restore each into fresh values: the state of its step, not the one changed after it.
    equal = []
    for prefix, expected, step in ((first, reference, 3), (second.result(), reference5, 5)):
        model2, optimizer2 = _build(1, world_size)
        fresh = _state(model2, optimizer2, 0)
        Saver(var_list=fresh).restore(None, prefix)
        restored = _full_tensors(fresh)
        equal.append(
            sorted(restored) == sorted(expected)
            and all(torch.equal(restored[n], t) for n, t in expected.items())
            and fresh["global_step"] == step
        )
    with open(first + ".index", "rb") as f:
        extra = ShardedManifest.from_bytes(f.read()).tree["dict"]["extra"]
    return {
        "in_flight": in_flight,
        "extra": extra,
        "first": os.path.basename(first),
        "equal": equal,
        "stall": stats.stall_secs,
        "total": stats.total_secs,
        "placed": placed,
        "replayed": replayed,
    }


def async_fail_rank(rank: int, world_size: int, directory: str, on_rank: int) -> tuple:
    """An asynchronous save whose shard write fails on ``on_rank``: what each rank's future
    says, and whether training can save again afterwards."""
    model, optimizer = _build(0, world_size)
    _train_step(model, optimizer, 0)
    storage = FaultyStorage()
    storage.fail("write", path_contains=".data-", errno=errno.ENOSPC, rank=on_rank)
    state = _state(model, optimizer, 1)
    saver = Saver(var_list=state, storage=storage)
    future = saver.save_async(None, os.path.join(directory, "model.ckpt"), global_step=1)
    _train_step(model, optimizer, 1)
    error = future.exception(WAIT_SECS)
    state["global_step"] = 2
    again = saver.save_async(None, os.path.join(directory, "model.ckpt"), global_step=2)
    return type(error).__name__, str(error), os.path.basename(again.result(WAIT_SECS))


def test_an_async_sharded_save_is_the_state_at_its_step_while_training_goes_on(tmp_path):
    results = run_world(async_save_rank, str(tmp_path))
    for result in results:
        assert result["in_flight"]  # save_async returned before the save was written.
        assert result["first"] == "model.ckpt-3"
        # The plain values as they were at step 3, not as training changed them after.
        assert result["extra"]["dict"]["lrs"] == [0.1, 0.01]
        assert result["extra"]["dict"]["tag"] == "run-a"
        assert result["equal"] == [True, True]  # Steps 3 and 5, each as it was.
        assert result["stall"] < result["total"]
        # DCP planned the first save (no rank had a plan to replay); the second (the same
        # layout) replayed its plan, through the writers' own process group, and restores as
        # its step was.
        assert result["replayed"] == [True], result["replayed"]
        # Both shards of both saves were written from the staging buffers, the local shards
        # in place (header + data, most of the file) and the replicated tensors that DCP
        # gave the rank (Adam's steps) copied after them.
        assert len(result["placed"]) == 2 and None not in result["placed"], result
        for in_place, copied, data in result["placed"]:
            assert in_place > data > 0 and copied in (0, 1)
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "model.ckpt-5")
    for prefix in ("model.ckpt-3", "model.ckpt-5"):
        CheckpointReader(str(tmp_path / prefix)).verify()  # Every byte against its CRC-32C.
        for shard in sorted(tmp_path.glob(f"{prefix}.data-*")):
            assert safetensors.torch.load_file(str(shard))  # A valid safetensors file.
    names = _files(tmp_path)
    assert {"model.ckpt-3.index", "model.ckpt-5.index", "checkpoint"} <= names
    assert not [n for n in names if ".tmp" in n]


def test_a_failed_async_sharded_save_fails_on_every_rank_and_commits_nothing(tmp_path):
    results = run_world(async_fail_rank, str(tmp_path), 1)
    for kind, message, again in results:
        assert kind == "CheckpointSaveError", message
        assert "failed on rank 1: [Errno 28] No space left" in message, message
        assert again == "model.ckpt-2"  # The next save works.
    names = _files(tmp_path)
    assert not [n for n in names if n.startswith("model.ckpt-1")], names
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "model.ckpt-2")


class _Loader:
    """A stateful object whose ``state_dict`` raises at its ``failing`` call (a data loader
    whose worker died, on one rank)."""

    def __init__(self, failing: int | None) -> None:
        self.calls, self.failing = 0, failing

    def state_dict(self) -> dict:
        self.calls += 1
        if self.calls == self.failing:
            raise RuntimeError("the loader's worker died")
        return {"position": self.calls}

    def load_state_dict(self, state: dict) -> None:
        pass


def _outcome(save) -> str:
    try:
        return os.path.basename(save())
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def rank_alone_fails_rank(rank: int, world_size: int, directory: str) -> list[str]:
    """Errors met by rank 1 alone before the collective: a ``state_dict`` that raises
    (asynchronous save), a bad step (synchronous save), a dtype the format cannot hold
    (found as the staging copies it), a directory missing (asynchronous save: found by the
    writer); a save that works after each."""
    model, optimizer = _build(0, world_size)
    _train_step(model, optimizer, 0)
    state = _state(model, optimizer, 1)
    state["loader"] = _Loader(failing=2 if rank == 1 else None)
    saver = Saver(state, max_to_keep=None)
    prefix = os.path.join(directory, "model.ckpt")
    outcomes = []
    for step in (1, 2, 3, 4, 5, 6, 7, 8):
        state.pop("z", None)
        if step == 7 and rank == 1:  # A directory not shared with rank 1, say.
            future = saver.save_async(None, os.path.join(directory, "gone", "model.ckpt"), 7)
            outcomes.append(_outcome(functools.partial(future.result, WAIT_SECS)))
            continue
        if step == 5 and rank == 1:
            state["z"] = torch.zeros(2, dtype=torch.complex128)
        if step == 3:
            bad = -1 if rank == 1 else step
            outcomes.append(_outcome(functools.partial(saver.save, None, prefix, bad)))
        else:
            future = saver.save_async(None, prefix, global_step=step)
            outcomes.append(_outcome(functools.partial(future.result, WAIT_SECS)))
    saver.close()
    return outcomes


def test_an_error_on_one_rank_before_the_collective_fails_that_save_on_every_rank(tmp_path):
    """A rank that raised alone left the other waiting in the collective, where its next
    save met the other's: one checkpoint was written from two steps' states (it verified),
    and every later save failed."""
    for outcomes in run_world(rank_alone_fails_rank, str(tmp_path)):
        first, second, third, fourth, fifth, sixth, seventh, eighth = outcomes
        assert (first, fourth, sixth) == ("model.ckpt-1", "model.ckpt-4", "model.ckpt-6")
        assert "doesn't exist" in seventh and eighth == "model.ckpt-8", outcomes
        assert second.startswith("RuntimeError: the loader's worker died"), outcomes
        assert third.startswith("ValueError") and "-1" in third, outcomes
        assert fifth.startswith("TypeError") and "complex128" in fifth, outcomes
    names = _files(tmp_path)
    failed = ("model.ckpt-2", "model.ckpt-3", "model.ckpt-5", "model.ckpt-7")
    assert not [n for n in names if n.startswith(failed)], names
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "model.ckpt-8")
    CheckpointReader(str(tmp_path / "model.ckpt-8")).verify()


def rank_saves_alone_rank(rank: int, world_size: int, directory: str) -> list[str]:
    """Rank 0 saves at step 2 and rank 1 does not (the caller's mistake); then both save at
    steps 3 and 4, and rank 1 at step 5 too (to meet rank 0's last save)."""
    model, optimizer = _build(0, world_size)
    _train_step(model, optimizer, 0)
    saver = Saver(_state(model, optimizer, 1), max_to_keep=None)
    prefix = os.path.join(directory, "model.ckpt")
    futures = []
    for step in (1, 2, 3, 4, 5):
        if (step == 2 and rank == 1) or (step == 5 and rank == 0):
            continue
        futures.append(saver.save_async(None, prefix, global_step=step))
    outcomes = [_outcome(lambda f=f: f.result(WAIT_SECS)) for f in futures]
    saver.close()
    return outcomes


def test_ranks_at_different_saves_write_nothing_and_say_so(tmp_path):
    for outcomes in run_world(rank_saves_alone_rank, str(tmp_path)):
        first, *rest = outcomes
        assert first == "model.ckpt-1" and len(rest) == 3, outcomes
        for outcome in rest:
            assert outcome.startswith("CheckpointSaveError") and "different saves" in outcome
    names = _files(tmp_path)
    assert {n.split(".")[1] for n in names if n.startswith("model.")} == {"ckpt-1"}, names
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "model.ckpt-1")


def stage_rank(rank: int, world_size: int) -> dict:
    """Stage an FSDP2 state twice with the same buffers: what the staged tensors are."""
    from torch.distributed.tensor import DTensor

    from torchsupervisor.checkpoint.sharded.staging import StageMemo, prepare, stage
    from torchsupervisor.checkpoint.snapshot import Stager

    model, optimizer = _build(0, world_size)
    state = _state(model, optimizer, 3)
    stager, memo, seen, checks = Stager(), StageMemo(), [], []
    for _ in range(2):
        save = prepare(state, "unused", global_step=3, wall_time=0.0, keep_vars=True)
        live = dict(save.tensors)
        stage(save, stager, memo)
        buffer = save.snapshot.buffers[0]
        start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
        for name, staged in save.tensors.items():
            source = live[name]
            is_dtensor = isinstance(source, DTensor)
            local = staged.to_local() if is_dtensor else staged
            checks.append(
                start <= local.data_ptr() < end  # Over the host staging buffer: no copy.
                and local.device.type == "cpu"
                and type(staged) is type(source)
                and staged.shape == source.shape
                and (
                    not is_dtensor
                    or (staged.placements, staged.device_mesh)
                    == (source.placements, source.device_mesh)
                )
                and torch.equal(local, source.to_local() if is_dtensor else source)
                and not staged.requires_grad  # The live parameters are staged undetached.
            )
        seen.append({n: id(t) for n, t in save.tensors.items() if isinstance(t, DTensor)})
        save.release()
    leaves = all(p.is_leaf and p.grad_fn is None and p.requires_grad for p in model.parameters())
    return {"all": all(checks), "reused": bool(seen[0]) and seen[0] == seen[1], "leaves": leaves}


def test_staging_copies_the_local_shards_into_host_buffers_and_reuses_the_dtensors():
    (result,) = run_world(stage_rank, world_size=1)
    assert result == {"all": True, "reused": True, "leaves": True}


def flatten_rank(rank: int, world_size: int) -> dict:
    """What a save's flattening keeps of the live state, and where the staging puts what."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from torchsupervisor.checkpoint.sharded.staging import _in_place_layout
    from torchsupervisor.core.walk import walk_state

    model, optimizer = _build(0, world_size)
    state = {**_state(model, optimizer, 3), "head": torch.nn.Linear(2, 2)}  # Not sharded.
    params = {f"model/{n}": p for n, p in model.named_parameters()}
    _, kept = walk_state(state, keep_vars=True)
    _, detached = walk_state(state)
    optimizer_state = {id(t) for s in optimizer.state.values() for t in s.values()}
    plain = {n: t for n, t in kept.items() if not isinstance(t, DTensor)}
    mesh = init_device_mesh("cpu", (world_size,))
    values = torch.arange(8.0).reshape(4, 2)
    layout = _in_place_layout(
        DTensor,
        {
            "sharded": distribute_tensor(values, mesh, [Shard(0)]),
            "replicated": distribute_tensor(values, mesh, [Replicate()]),
            "sharded_too": distribute_tensor(values + 1, mesh, [Shard(0)]),
            "plain": values,
        },
    )
    return {
        "kept": all(kept[n] is p for n, p in params.items()),
        "detached": all(not detached[n].requires_grad for n in params),
        # Plain tensors: the optimizer's own (steps) as they are, a parameter detached.
        "plain": sorted(
            "optimizer" if id(t) in optimizer_state else ("detached" if not t.requires_grad else n)
            for n, t in plain.items()
        ),
        "same_names": list(kept) == list(detached),
        "layout": layout,
    }


def test_a_save_keeps_the_live_parameters_and_lays_replicated_tensors_in_the_tail():
    (result,) = run_world(flatten_rank, world_size=1)
    assert result["plain"].count("optimizer") > 0  # Adam's steps.
    # Header room per sharded tensor: "[" + "o:e" per dimension ("0:4", "0:2") + "," + "]".
    assert result == {
        "kept": True,
        "detached": True,
        "plain": ["detached"] * 2 + ["optimizer"] * result["plain"].count("optimizer"),
        "same_names": True,
        "layout": (["replicated", "plain"], 64 + 2 * (2 + (2 + 2) + (2 + 2))),
    }


def teardown_rank(rank: int, world_size: int, directory: str) -> dict:
    """Two asynchronous saves (the second replays the first's plan), then the program ends
    its process group while the saver object still exists, as a script's last lines do."""
    model, optimizer = _build(0, world_size)
    _train_step(model, optimizer, 0)
    saver = Saver(var_list=_state(model, optimizer, 1), max_to_keep=1)
    for step in (1, 2):
        saver.save_async(None, os.path.join(directory, "model.ckpt"), global_step=step).result(
            WAIT_SECS
        )
    saver.close()
    background = weakref.ref(env.background_group())
    replayed = save_cache_of(saver).plans.replayed
    dist.destroy_process_group()
    return {"replayed": replayed, "background_alive": background() is not None}


def test_ending_the_process_group_ends_the_writers_group_too(tmp_path):
    # A group that outlives destroy_process_group keeps its gloo threads until the
    # interpreter's shutdown, where they can abort the process after a successful run
    # ("terminate called without an active exception"). Neither the saver (its kept plan)
    # nor the module's cache of the background group may hold it.
    for result in run_world(teardown_rank, str(tmp_path)):
        assert result["replayed"] == 1, result
        assert not result["background_alive"], result


def copy_order_rank(rank: int, world_size: int, directory: str) -> list[str]:
    """An asynchronous sharded save whose staging reports one (fake) CUDA copy event."""
    from fake_copies import fake_device_copies

    from torchsupervisor.checkpoint import writers

    order = []
    fake_device_copies(order, (writers, "write_sharded", "write reads the buffers"))
    model, optimizer = _build(0, world_size)
    _train_step(model, optimizer, 0)
    saver = Saver(var_list=_state(model, optimizer, 1))
    saver.save_async(None, os.path.join(directory, "model.ckpt"), global_step=1).result(WAIT_SECS)
    saver.close()
    return order


def test_the_sharded_writer_waits_for_the_device_copies_before_it_reads_a_buffer(tmp_path):
    # What a GPU run relies on, checked with the CPU path: the sharded staging only queues
    # the copies (no wait on the training thread); the writer thread waits for them before
    # the collective write reads the buffers (and the release that follows, again at once).
    for order in run_world(copy_order_rank, str(tmp_path)):
        assert order[:3] == ["staged, wait=False", "copies done", "write reads the buffers"]
