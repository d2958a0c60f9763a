"""Sharded saves that replay the previous save's plan (``replay.PlanCache``): the same files
as a save DCP plans, DCP again whenever any rank's layout changed, and a failure on any rank
still reaching every rank with nothing committed.

The ranks are real processes of a real gloo process group (``testing.run_world``)."""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
from typing import Any

import pytest
import torch
from test_sharded import _build as build_model
from test_sharded import _full_tensors
from test_sharded import _train_step as train_step

from torchsupervisor import CheckpointReader
from torchsupervisor.checkpoint.sharded.collective import load_sharded, write_sharded
from torchsupervisor.checkpoint.sharded.metadata import ShardedManifest
from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState
from torchsupervisor.checkpoint.sharded.replay import PlanCache, layout_of
from torchsupervisor.checkpoint.sharded.staging import prepare
from torchsupervisor.testing import FaultyStorage, run_world


def _build(seed: int, world_size: int) -> dict:
    """``test_sharded``'s FSDP2 model and Adam, as a state with a step."""
    model, optimizer = build_model(seed, world_size)
    return {"model": model, "optimizer": ShardedOptimizerState(model, optimizer), "step": 0}


def _train(state: dict) -> None:
    train_step(state["model"], state["optimizer"].optimizer, state["step"])
    state["step"] += 1


def _save(state: dict, directory: str, step: int, plans: PlanCache | None, **kwargs) -> bytes:
    save = prepare(
        state, os.path.join(directory, f"model.ckpt-{step}"), global_step=step, wall_time=0.0
    )
    return write_sharded(save, plans=plans, write_state=False, **kwargs)


def _layout(manifest: bytes) -> tuple:
    """A manifest without its step and its shard files' names (which name the step)."""
    parsed = ShardedManifest.from_bytes(manifest)
    shards = tuple(dataclasses.replace(s, file="") for s in parsed.shards)
    return parsed.tensors, shards, parsed.sharded_tensors, parsed.world_size, parsed.tree


def replay_rank(rank: int, world_size: int, directory: str) -> tuple[int, bool]:
    """Three saves with one layout: the 2nd and 3rd replay the plan; each verifies and
    restores; the 3rd's manifest and shards are those of a save of the same state that DCP
    plans."""
    state = _build(0, world_size)
    plans = PlanCache()
    manifests, layouts = [], []
    for step in (1, 2, 3):
        _train(state)
        manifests.append(_save(state, directory, step, plans))
        layouts.append(plans.chunk_layout)
    assert plans.replayed == 2
    # The coordinator's replayed saves reused the chunk layout of the first (checked below
    # against a save that DCP plans), the first of them kept with its own chunk names (an
    # equal mapping), which the second's then are; the other rank builds none.
    if rank == 0:
        assert layouts[0] is not None and layouts[1] is layouts[2]
        assert layouts[1].sharded is layouts[0].sharded and layouts[1].names == layouts[0].names
    else:
        assert layouts == [None, None, None]
    planned = _save(state, directory, 4, None)  # The same state, planned by DCP.
    same = _layout(manifests[-1]) == _layout(planned)
    expected = _full_tensors(state)
    for step in (1, 2, 3):
        if rank == 0:
            CheckpointReader(os.path.join(directory, f"model.ckpt-{step}")).verify()
    fresh = _build(1, world_size)
    load_sharded(fresh, os.path.join(directory, "model.ckpt-3"))
    restored = _full_tensors(fresh)
    assert sorted(restored) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(restored[name], tensor), name
    return plans.replayed, same


def test_saves_of_one_layout_replay_the_plan_and_write_what_dcp_would(tmp_path):
    for replayed, same in run_world(replay_rank, str(tmp_path)):
        assert replayed == 2 and same


def test_a_chunk_layout_fits_only_the_same_metadata_and_names():
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from torchsupervisor.checkpoint.sharded.writer import ChunkLayout, _sharded_tensors

    def md() -> TensorStorageMetadata:
        chunks = [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 4])),
            ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 4])),
        ]
        props = TensorProperties(dtype=torch.float32)
        return TensorStorageMetadata(props, torch.Size([4, 4]), chunks)

    metadata = {"w": md()}
    names = {("w", (0, 0)): "w[0:2,0:4]", ("w", (2, 0)): "w[2:4,0:4]"}
    layout = ChunkLayout(dict(metadata), names, _sharded_tensors(metadata, names))
    assert [c.entry for c in layout.sharded["w"].chunks] == ["w[0:2,0:4]", "w[2:4,0:4]"]
    assert layout.fits(dict(metadata), dict(names))
    assert not layout.fits({"w": md()}, names)  # Equal metadata, but not the same objects.
    assert not layout.fits({**metadata, "b": md()}, names)
    assert not layout.fits(metadata, {**names, ("w", (2, 0)): "other"})


def test_packed_and_dcp_write_results_give_the_same_chunks():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from torchsupervisor.checkpoint.format import ShardEntry, TensorEntry
    from torchsupervisor.checkpoint.sharded.packed import PackedWrite, StoredChunk, written_chunks

    shard = ShardEntry("m.ckpt-1.data-00001-of-00002", 200, 64, 7, 8)
    entry = TensorEntry(1, torch.float32, (2, 4), 0, 32, 99)
    blocks = (1, (5, 6))  # A block a row: the rows' CRCs.
    packed = PackedWrite(
        shard,
        1,
        [("w", (2, 0), "w[2:4,0:4]", torch.float32, (2, 4), 0, 32)],
        [99],
        blocks=[blocks],
    )
    dcp = [
        WriteResult(
            index=MetadataIndex("w", torch.Size([2, 0])),
            size_in_bytes=32,
            storage_data=StoredChunk(shard, "w[2:4,0:4]", entry, blocks),
        )
    ]
    expected = [(("w", (2, 0)), "w[2:4,0:4]", shard, entry, blocks)]
    assert list(written_chunks([packed])) == list(written_chunks([dcp])) == expected
    assert list(written_chunks([PackedWrite(None, None, [], []), dcp])) == expected
    foreign = [WriteResult(index=MetadataIndex("w"), size_in_bytes=0, storage_data="x")]
    with pytest.raises(TypeError, match="unexpected write result for 'w'"):
        list(written_chunks([foreign]))
    for bad in (
        PackedWrite(shard, 1, packed.rows, []),  # A CRC short.
        PackedWrite(None, None, packed.rows, [99]),  # Chunks without a shard.
        PackedWrite(shard, None, [], []),  # A shard without its index.
        PackedWrite(shard, 1, None, [99], 3),  # Rows sent before: only a table memo has them.
        PackedWrite(shard, 1, packed.rows, [99], blocks=[]),  # Blocks short.
    ):
        with pytest.raises(ValueError, match="inconsistent"):
            list(written_chunks([bad]))


def _packed_results(crcs: list[int], second_begin: int = 0) -> list[Any]:
    """Two ranks' ``PackedWrite``s, as a replayed save of 2 tensors sends them."""
    from torchsupervisor.checkpoint.format import ShardEntry
    from torchsupervisor.checkpoint.sharded.packed import PackedWrite

    f32 = torch.float32
    return [
        PackedWrite(
            ShardEntry("m.ckpt-1.data-00000-of-00002", 200, 64, 1, 2),
            0,
            [("w", (0, 0), "w[0:2,0:4]", f32, (2, 4), 0, 32), ("b", (), "b", f32, (4,), 32, 48)],
            crcs[:2],
        ),
        PackedWrite(
            ShardEntry("m.ckpt-1.data-00001-of-00002", 200, 64, 3, 4),
            1,
            [("w", (2, 0), "w[2:4,0:4]", f32, (2, 4), second_begin, second_begin + 32)],
            crcs[2:],
        ),
    ]


def test_the_coordinators_table_is_kept_while_every_ranks_rows_are_the_same():
    from torchsupervisor.checkpoint import format as fmt
    from torchsupervisor.checkpoint.sharded.packed import TableMemo
    from torchsupervisor.checkpoint.sharded.writer import _table

    memo = TableMemo()
    made = []  # Each save's (names by key, entry names): the same objects while kept.
    for crcs, begin in (([1, 2, 3], 0), ([4, 5, 6], 0), ([7, 8, 9], 64), ([1, 1, 1], 64)):
        results = _packed_results(crcs, begin)
        shards, names, tensors, _ = memo.table(results)
        want_shards, want_names, want_tensors, _ = _table(results)  # Made from nothing.
        assert (shards, names) == (want_shards, want_names)
        assert list(tensors.items()) == list(want_tensors.items())  # Sorted, the same entries.
        assert dict(tensors) == want_tensors and len(tensors) == 3 and "b" in tensors
        assert fmt.tensors_field(tensors).text == fmt.tensors_field(want_tensors).text
        made.append((names, tensors.names))
    same = [a[0] is b[0] and a[1] is b[1] for a, b in itertools.pairwise(made)]
    assert same == [True, False, True]  # Only the CRCs changed; a row changed; only the CRCs.
    kept_order = made[-1][1]
    memo.forget()
    assert memo.table(_packed_results([1, 1, 1], 64))[2].names is not kept_order
    twice = _packed_results([1, 2, 3])
    twice[1].rows[0] = ("b", (), "b", torch.float32, (4,), 0, 16)  # Another chunk named "b".
    with pytest.raises(ValueError, match="same entry name"):
        memo.table(twice)
    with pytest.raises(ValueError, match="3 names, 3 layouts and 2 CRCs"):
        fmt.PackedTensors(["a", "b", "c"], [(0,)] * 3, [1, 2])


def test_rows_sent_once_are_taken_from_what_the_coordinator_received():
    from torchsupervisor.checkpoint.sharded.packed import SentRows, TableMemo
    from torchsupervisor.checkpoint.sharded.writer import _table

    memo, senders = TableMemo(), [SentRows(), SentRows()]
    first = _packed_results([1, 2, 3])  # Each rank's rows: the same lists from now on.

    def save(crcs: list[int], rows_of: list[Any] = first) -> list[Any]:
        written = [
            dataclasses.replace(p, rows=own.rows) for p, own in zip(_packed_results(crcs), rows_of)
        ]
        return [sender.pack(w) for sender, w in zip(senders, written)]

    sent = save([1, 2, 3])
    assert [p.rows is not None for p in sent] == [True, True]
    assert [p.rows_number for p in sent] == [1, 1]
    memo.table(sent)
    for crcs in ([4, 5, 6], [7, 8, 9]):
        spared = save(crcs)
        assert [(p.rows, p.rows_number) for p in spared] == [(None, 1), (None, 1)]
        _, names, tensors, _ = memo.table(spared)
        _, want_names, want_tensors, _ = _table(_packed_results(crcs))  # Made from the rows.
        assert names == want_names and dict(tensors) == want_tensors
    assert [s.spared for s in senders] == [2, 2]
    # Rank 1's rows change (a new list): sent again, under a new number.
    moved = _packed_results([1, 2, 3], 64)
    changed = save([1, 2, 3], [first[0], moved[1]])
    assert [(p.rows is None, p.rows_number) for p in changed] == [(True, 1), (False, 2)]
    assert dict(memo.table(changed)[2]) == _table(_packed_results([1, 2, 3], 64))[2]
    # Rows the coordinator does not hold (forgotten, or another number) fail the table,
    # never make it from other rows.
    memo.forget()
    with pytest.raises(ValueError, match="rows #1 were not sent"):
        memo.table(save([1, 2, 3], [first[0], moved[1]]))
    for sender in senders:
        sender.forget()  # As ``PlanCache.forget`` does on every rank: sent again.
    again = save([1, 2, 3], [first[0], moved[1]])
    assert [p.rows_number for p in again] == [2, 3] and memo.table(again)
    wrong = [again[0], dataclasses.replace(again[1], rows=None, rows_number=2)]
    with pytest.raises(ValueError, match="rows #2 were not sent"):
        memo.table(wrong)


def changed_rank(rank: int, world_size: int, directory: str) -> list[int]:
    """A new tensor in the state, a changed dtype, and one rank without a kept plan: each
    sends every rank back to DCP; the next save of the same layout replays again."""
    state = _build(0, world_size)
    plans = PlanCache()
    counts = []
    _save(state, directory, 1, plans)
    state["extra"] = torch.arange(4, dtype=torch.float32)
    _save(state, directory, 2, plans)  # A new tensor: planned.
    counts.append(plans.replayed)
    _save(state, directory, 3, plans)  # Replayed.
    counts.append(plans.replayed)
    state["extra"] = state["extra"].to(torch.float64)
    manifest = ShardedManifest.from_bytes(_save(state, directory, 4, plans))
    counts.append(plans.replayed)
    assert manifest.tensors["extra"].dtype == torch.float64
    if rank == 1:
        plans.forget()  # Only this rank: every rank must still plan with DCP.
    _save(state, directory, 5, plans)
    counts.append(plans.replayed)
    _save(state, directory, 6, plans)
    counts.append(plans.replayed)
    if rank == 0:
        for step in range(1, 7):
            CheckpointReader(os.path.join(directory, f"model.ckpt-{step}")).verify()
    return counts


def test_a_changed_layout_on_any_rank_is_planned_again(tmp_path):
    for counts in run_world(changed_rank, str(tmp_path)):
        assert counts == [0, 1, 1, 1, 2]


def same_object_rank(rank: int, world_size: int, directory: str) -> tuple[list[int], str]:
    """Unstaged saves of the very same tensor objects; then one of them changes dtype in
    place (``.data`` assigned, as ``module.half()`` does): that save is planned again."""
    state = {"a": torch.arange(4.0), "b": torch.ones(2, dtype=torch.int64)}
    plans, counts = PlanCache(), []
    for step in (1, 2):
        _save(state, directory, step, plans)
        counts.append(plans.replayed)
    state["a"].data = state["a"].data.to(torch.float64)
    manifest = ShardedManifest.from_bytes(_save(state, directory, 3, plans))
    counts.append(plans.replayed)
    if rank == 0:
        CheckpointReader(os.path.join(directory, "model.ckpt-3")).verify()
    return counts, str(manifest.tensors["a"].dtype)


def test_a_tensor_that_changed_dtype_in_place_is_planned_again(tmp_path):
    for counts, dtype in run_world(same_object_rank, str(tmp_path)):
        assert counts == [0, 1, 1] and dtype == "torch.float64", (counts, dtype)


def fail_rank(
    rank: int, world_size: int, directory: str, operation: str, path_contains: str, on_rank: int
) -> tuple[str, str, int, int]:
    """A replayed save whose ``operation`` fails on ``on_rank``: the error on this rank, and
    the replay counts after it and after the next two saves (planned, then replayed)."""
    state = _build(0, world_size)
    plans = PlanCache()
    _save(state, directory, 1, plans)
    storage = FaultyStorage()
    code = errno.ENOSPC if operation == "write" else errno.EIO
    storage.fail(operation, path_contains=path_contains, errno=code, rank=on_rank)
    with pytest.raises(Exception) as caught:
        _save(state, directory, 2, plans, storage=storage)
    failed = plans.replayed
    _save(state, directory, 3, plans)
    _save(state, directory, 4, plans)
    if rank == 0:
        CheckpointReader(os.path.join(directory, "model.ckpt-1")).verify()
        CheckpointReader(os.path.join(directory, "model.ckpt-4")).verify()
    return type(caught.value).__name__, str(caught.value), failed, plans.replayed


@pytest.mark.parametrize(
    "operation, path_contains, on_rank",
    [("write", ".data-", 0), ("write", ".data-", 1), ("open", ".index.tmp", 0)],
)
def test_a_failed_replayed_save_fails_everywhere_and_commits_nothing(
    tmp_path, operation, path_contains, on_rank
):
    results = run_world(fail_rank, str(tmp_path), operation, path_contains, on_rank)
    for kind, message, failed, replayed in results:
        assert kind == "CheckpointSaveError", message
        if operation == "write":
            assert f"failed on rank {on_rank}: [Errno 28] No space left" in message, message
        else:
            assert "Input/output error" in message and ".index" in message, message
        assert (failed, replayed) == (1, 2)  # The failed save forgot the plan.
    names = set(os.listdir(tmp_path))
    assert not any(n.startswith("model.ckpt-2") for n in names), names
    assert {"model.ckpt-1.index", "model.ckpt-3.index", "model.ckpt-4.index"} <= names


def test_layout_names_what_a_plan_is_made_from():
    tensors = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.int64)}
    layout, held = layout_of(tensors)
    assert layout == (("a", torch.float32, (2, 3)), ("b", torch.int64, (4,)))
    assert held == []
    assert layout_of({"b": tensors["b"], "a": tensors["a"]})[0] != layout  # Order counts.


def overwrite_rank(rank: int, world_size: int, directory: str) -> tuple[str, int]:
    """The same step saved again: replayed, it overwrites the older checkpoint; a save of it
    that fails on rank 1 before writing (a value that cannot be saved) leaves it whole."""
    state = _build(0, world_size)
    plans = PlanCache()
    _save(state, directory, 1, plans)
    _train(state)
    _save(state, directory, 1, plans)  # Replayed over the older one.
    assert plans.replayed == 1
    expected = _full_tensors(state)
    if rank == 1:
        state["bad"] = object()  # Only this rank: its save fails before the collective.
    with pytest.raises(Exception) as caught:
        _save(state, directory, 1, plans)
    state.pop("bad", None)
    fresh = _build(1, world_size)
    load_sharded(fresh, os.path.join(directory, "model.ckpt-1"))
    restored = _full_tensors(fresh)
    for name, tensor in expected.items():
        assert torch.equal(restored[name], tensor), name
    return type(caught.value).__name__, plans.replayed


def test_a_failed_save_of_the_same_step_leaves_the_older_checkpoint(tmp_path):
    for kind, replayed in run_world(overwrite_rank, str(tmp_path)):
        assert kind == "TypeError" and replayed == 1


def retire_count_rank(rank: int, world_size: int, directory: str) -> tuple[list[int], int]:
    """Replayed saves to new prefixes and to one already saved: the coordinator retires only
    where the prefix holds an older save's files (it found them before the ranks agreed);
    the retirements made, counted after each save, and the saves replayed."""
    from torchsupervisor.checkpoint import commit

    retire, counts = commit.retire, []

    def counted(*args: Any) -> None:
        counts[-1] += 1
        retire(*args)

    state = _build(0, world_size)
    plans = PlanCache()
    commit.retire = counted
    try:
        for step in (1, 2, 2, 3):  # Planned by DCP (which retires), then replayed.
            counts.append(counts[-1] if counts else 0)
            _train(state)
            _save(state, directory, step, plans)
    finally:
        commit.retire = retire
    if rank == 0:
        for step in (1, 2, 3):
            CheckpointReader(os.path.join(directory, f"model.ckpt-{step}")).verify()
    return counts, plans.replayed


def test_a_replayed_save_retires_only_where_an_older_save_was(tmp_path):
    results = run_world(retire_count_rank, str(tmp_path))
    assert results[0] == ([1, 1, 2, 2], 3), results  # The coordinator.
    assert results[1] == ([0, 0, 0, 0], 3), results


class _ExistsFailsOnce(FaultyStorage):
    """``exists`` of a path ending in ``suffix`` raises once (the coordinator's look for an
    older save's files, before the ranks agree)."""

    def __init__(self, suffix: str) -> None:
        super().__init__()
        self.suffix, self.raised = suffix, 0

    def exists(self, path: str) -> bool:
        if path.endswith(self.suffix) and not self.raised:
            self.raised += 1
            raise OSError(errno.EIO, "injected", path)
        return super().exists(path)


def checks_raise_rank(rank: int, world_size: int, directory: str) -> tuple:
    """The checks each rank makes before the ranks agree raise on one rank; no rank may then
    be left alone in the agreement's all-reduce. At step 2 rank 1's ``PlanCache.fits``
    raises: DCP plans the save on every rank. At step 3 the coordinator's look for an older
    save's files raises: the replay retires first, as if there were some. The retirements
    and replays counted after each save, and what the look raised."""
    from torchsupervisor.checkpoint import commit

    retire, retired, replayed = commit.retire, [], []

    def counted(*args: Any, **kwargs: Any) -> None:
        retired[-1] += 1
        retire(*args, **kwargs)

    def raising(*args: Any) -> bool:
        raise RuntimeError("injected")

    state = _build(0, world_size)
    plans = PlanCache()
    storage = _ExistsFailsOnce("model.ckpt-3.index") if rank == 0 else None
    commit.retire = counted
    try:
        for step in (1, 2, 3):
            retired.append(retired[-1] if retired else 0)
            _train(state)
            if step == 2 and rank == 1:
                plans.fits = raising  # type: ignore[method-assign]
            _save(state, directory, step, plans, storage=storage)
            plans.__dict__.pop("fits", None)
            replayed.append(plans.replayed)
    finally:
        commit.retire = retire
    if rank == 0:
        for step in (1, 2, 3):
            CheckpointReader(os.path.join(directory, f"model.ckpt-{step}")).verify()
    return retired, replayed, storage.raised if storage is not None else None


def test_a_check_that_raises_before_the_ranks_agree_leaves_no_rank_alone(tmp_path):
    results = run_world(checks_raise_rank, str(tmp_path), timeout_secs=90)
    # Step 2 is planned by DCP (which retires on the coordinator), step 3 replayed after a
    # retirement that a replay to a new prefix would not have made.
    assert results[0] == ([1, 2, 3], [0, 0, 1], 1), results  # The coordinator.
    assert results[1] == ([0, 0, 0], [0, 0, 1], None), results


def retire_fail_rank(rank: int, world_size: int, directory: str, times: int | None) -> tuple:
    """The same step saved again while deleting its older index fails ``times`` times on the
    coordinator: the replay gives way to DCP, which retires again (and reports a failure to
    every rank)."""
    state = _build(0, world_size)
    plans = PlanCache()
    _save(state, directory, 1, plans)
    storage = FaultyStorage()
    storage.fail("delete", path_contains=".index", errno=errno.EPERM, times=times, rank=0)
    try:
        _save(state, directory, 1, plans, storage=storage)
        outcome = "saved"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    if rank == 0:
        CheckpointReader(os.path.join(directory, "model.ckpt-1")).verify()
    return outcome, plans.replayed


@pytest.mark.parametrize("times", [1, None])
def test_an_older_index_that_cannot_be_retired_sends_the_save_to_dcp(tmp_path, times):
    for outcome, replayed in run_world(retire_fail_rank, str(tmp_path), times):
        assert replayed == 0
        if times == 1:
            assert outcome == "saved"
        else:
            assert outcome.startswith("PermissionError") and "model.ckpt-1.index" in outcome


def test_a_replayed_plan_is_refused_for_what_this_save_found_wrong(tmp_path):
    from torch.distributed.checkpoint.planner import SavePlan

    from torchsupervisor.checkpoint.sharded.writer import ShardedStorageWriter

    def writer(prefix: str, error: BaseException | None = None) -> ShardedStorageWriter:
        return ShardedStorageWriter(
            prefix, skeleton={}, global_step=1, wall_time=0.0, error=error, tensor_names=()
        )

    plan = SavePlan([])
    ok = writer(str(tmp_path / "model.ckpt-1"))
    assert ok.prepare_replayed_plan(plan) is plan  # The plan itself, as it was checked then.
    carried = writer(str(tmp_path / "model.ckpt-1"), TypeError("rank 1's state"))
    with pytest.raises(TypeError, match="rank 1's state"):
        carried.prepare_replayed_plan(plan)
    assert isinstance(carried.error, TypeError)  # Remembered for the collective's report.
    missing = writer(str(tmp_path / "gone" / "model.ckpt-1"))
    with pytest.raises(ValueError, match="doesn't exist, can't save"):
        missing.prepare_replayed_plan(plan)
