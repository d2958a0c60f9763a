"""``in_place_shard``: a rank's shard written from the staging buffer, and when it is not;
``ShardMemo``: the layout of the last one, for the next save of the very same chunks."""

from __future__ import annotations

import dataclasses

import crc32c
import pytest
import safetensors.torch
import torch

from torchsupervisor.checkpoint.sharded.in_place import ShardMemo, in_place_shard, plan_in_place
from torchsupervisor.checkpoint.snapshot import Stager


def _staged(tensors, tail=(), spare=256):
    return Stager().stage(None, tensors, step=None, wall_time=0.0, tail=tail, header_spare=spare)


def _file(tmp_path, placed):
    path = tmp_path / "shard.safetensors"
    path.write_bytes(b"".join(bytes(p) for p in placed[2]))
    return path


def test_the_staged_tensors_are_written_in_place_under_their_chunk_names(tmp_path):
    state = {
        "a": torch.arange(10.0),
        "b": torch.ones(3, 4),
        "s": torch.tensor(7, dtype=torch.int64),
    }
    snapshot = _staged(state, tail=["s"])
    views = snapshot.tensors()
    written = {"a[0:10]": views["a"], "b[0:3,0:4]": views["b"], "s": views["s"]}
    entries, header, parts = in_place_shard(snapshot, written)
    buffer = snapshot.buffers[0]
    # The local shards straight from the staging buffer; the replicated step copied after.
    assert parts[0].nbytes == len(header) + 88 and len(parts) == 2
    assert torch.frombuffer(parts[0], dtype=torch.uint8).data_ptr() == buffer.data_ptr()
    loaded = safetensors.torch.load_file(str(_file(tmp_path, (entries, header, parts))))
    assert sorted(loaded) == sorted(written)
    assert all(torch.equal(loaded[n], t) for n, t in written.items())
    for name, entry in entries:  # Each CRC-32C is of the bytes in the file.
        data = loaded[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert entry.crc32c == crc32c.crc32c(data)
    assert len(header) % 4096 == 0


def test_chunks_that_are_not_staged_views_are_copied_after_the_ones_in_place(tmp_path):
    state = {"a": torch.arange(16.0), "b": torch.arange(4.0)}
    snapshot = _staged(state)
    other = torch.full((2, 2), 3.0)
    written = {"a": snapshot.tensors()["a"], "b": snapshot.tensors()["b"][:2], "c": other}
    entries, header, parts = in_place_shard(snapshot, written)
    assert [name for name, _ in entries] == ["a", "b", "c"]  # "b" is a part: copied.
    loaded = safetensors.torch.load_file(str(_file(tmp_path, (entries, header, parts))))
    assert torch.equal(loaded["b"], torch.arange(2.0)) and torch.equal(loaded["c"], other)


@pytest.mark.parametrize(
    "case",
    [
        "nothing staged",
        "gap first",
        "header too long",
        "misaligned tail",
        "misaligned behind a line",
    ],
)
def test_the_writer_copies_everything_when_the_layout_does_not_allow_it(case):
    state = {"a": torch.arange(3.0), "b": torch.arange(5.0)}
    snapshot = _staged(state, spare=0 if case == "header too long" else 256)
    views = snapshot.tensors()
    written = {
        "nothing staged": {"a": torch.arange(3.0)},
        "gap first": {"b": views["b"]},  # "a" comes first in the layout and is not written.
        "header too long": {"a" * 5000: views["a"], "b": views["b"]},
        "misaligned tail": {"a": views["a"], "z": torch.zeros(1, dtype=torch.float64)},
        # The copied rest starts with a whole 64-byte line of bytes, then a float64: "a" ends
        # at byte 12, where the bytes would fit but the float64 after them would not.
        "misaligned behind a line": {
            "a": views["a"],
            "w": torch.zeros(64, dtype=torch.uint8),
            "z": torch.zeros(1, dtype=torch.float64),
        },
    }[case]
    assert snapshot.layout.shards[0].entries[0][0] == "a"
    assert in_place_shard(snapshot, written) is None


def test_a_layout_planned_once_writes_each_later_save_of_the_same_chunks(tmp_path):
    state = {"a": torch.arange(10.0), "s": torch.tensor(7, dtype=torch.int64)}
    stager = Stager()
    snapshot = stager.stage(None, state, step=None, wall_time=0.0, tail=["s"], header_spare=256)
    views = snapshot.tensors()
    written = {"a[0:10]": views["a"], "s": views["s"]}
    planned = plan_in_place(snapshot, written)
    assert planned is not None
    for value in (1.0, -2.5):  # New bytes in the same buffer, as the next save stages them.
        views["a"].fill_(value)
        views["s"].fill_(int(value * 10))
        crcs, _, parts = planned.write(snapshot, written)
        placed = in_place_shard(snapshot, written)  # As if planned anew.
        assert [(n, e.with_fields(crc32c=c)) for (n, e), c in zip(planned.entries, crcs)] == (
            placed[0]
        )
        assert [bytes(p) for p in parts] == [bytes(p) for p in placed[2]]
        loaded = safetensors.torch.load_file(str(_file(tmp_path, placed)))
        assert torch.equal(loaded["a[0:10]"], torch.full((10,), value))
        assert loaded["s"].item() == int(value * 10)
        for name, entry in placed[0]:  # The CRCs are of this save's bytes.
            data = loaded[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            assert entry.crc32c == crc32c.crc32c(data)


@pytest.mark.parametrize("change", ["none", "plan", "table value", "table key", "buffer", "layout"])
def test_the_shard_memo_gives_the_last_layout_only_for_the_very_same_chunks(change):
    state = {"a": torch.arange(4.0), "b": torch.ones(2)}
    snapshot = _staged(state)
    views = snapshot.tensors()
    table = {"a": object(), "b": object()}  # The staged table the chunks came from.
    written = {"a": views["a"], "b": views["b"]}
    planned = plan_in_place(snapshot, written)
    plan, keys = object(), {"a": ("a", (0,)), "b": ("b", (0,))}
    memo = ShardMemo()
    rows = [("a", (0,), "a", torch.float32, (4,), 0, 16)]  # Kept with the layout as given.
    memo.keep(plan, table, snapshot, written, keys, planned, rows)
    if change == "plan":
        plan = object()  # DCP planned again (a plan of equal content is not the same plan).
    elif change == "table value":
        table = {"a": table["a"], "b": object()}
    elif change == "table key":
        table = {"b": table["b"], "a": table["a"]}
    elif change == "buffer":  # Other buffers of the same layout (a second set, say).
        snapshot = dataclasses.replace(snapshot, buffers=(snapshot.buffers[0].clone(),))
    elif change == "layout":
        snapshot = dataclasses.replace(snapshot, layout=dataclasses.replace(snapshot.layout))
    taken = memo.take(plan, dict(table), snapshot)
    if change == "none":
        assert taken == (written, keys, planned, rows) and memo.taken == 1
        assert memo.take(plan, table, snapshot) is not None  # Kept for the save after.
    else:
        assert taken is None and memo.taken == 0
        # Nothing is kept once it did not hold: its buffer is not held either.
        assert memo.take(plan, table, snapshot) is None
