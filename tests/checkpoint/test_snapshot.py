"""Shard layout and step-boundary snapshots into reusable staging buffers."""

from __future__ import annotations

import pytest
import torch

from torchsupervisor.checkpoint.format import DATA_ALIGNMENT_BYTES
from torchsupervisor.checkpoint.snapshot import Stager, plan_layout


def _tensors():
    return {
        "b_u8": torch.arange(5, dtype=torch.uint8),
        "a_f32": torch.randn(3, 4),
        "c_f64": torch.randn(7, dtype=torch.float64),
        "d_bf16": torch.randn(3, dtype=torch.bfloat16),
        "e_bool": torch.tensor([True, False, True]),
        "f_scalar": torch.tensor(3, dtype=torch.int64),
        "g_empty": torch.empty(0, 4),
        "h_cplx": torch.randn(2, dtype=torch.complex64),
    }


def test_layout_orders_by_item_size_then_name_and_aligns():
    layout = plan_layout(_tensors())
    (shard,) = layout.shards
    names = [name for name, _ in shard.entries]
    # None is a whole number of 64-byte lines: by item size, then name.
    assert names == ["c_f64", "f_scalar", "h_cplx", "a_f32", "g_empty", "d_bf16", "b_u8", "e_bool"]
    position = 0
    for _, entry in shard.entries:
        assert entry.begin == position
        assert entry.begin % entry.dtype.itemsize == 0
        position = entry.end
    assert shard.data_offset % DATA_ALIGNMENT_BYTES == 0


def test_tensors_of_whole_cache_lines_come_first_so_a_small_one_shifts_none_of_them():
    # An Adam state: each parameter's 4-byte ``step`` sorts between the large tensors by name.
    tensors = {}
    for i in range(3):
        tensors[f"state/{i}/exp_avg"] = torch.zeros(1024)
        tensors[f"state/{i}/exp_avg_sq"] = torch.zeros(1024)
        tensors[f"state/{i}/step"] = torch.tensor(1.0)
    tensors["half"] = torch.zeros(32, dtype=torch.float16)  # 64 bytes: a whole line.
    tensors["odd"] = torch.zeros(3, dtype=torch.float64)
    (shard,) = plan_layout(tensors).shards
    names = [name for name, _ in shard.entries]
    lines = [f"state/{i}/{k}" for i in range(3) for k in ("exp_avg", "exp_avg_sq")] + ["half"]
    assert names == lines + ["odd"] + [f"state/{i}/step" for i in range(3)]
    position = 0
    for name, entry in shard.entries:
        assert entry.begin == position  # No gaps: any safetensors reader reads the shard.
        assert entry.begin % (DATA_ALIGNMENT_BYTES if name in lines else entry.dtype.itemsize) == 0
        position = entry.end


def test_layout_splits_shards_without_splitting_tensors():
    tensors = {f"t{i}": torch.zeros(100) for i in range(5)}  # 400 bytes each
    tensors["big"] = torch.zeros(1000)  # 4000 bytes, larger than a shard
    layout = plan_layout(tensors, max_shard_bytes=1000)
    sizes = [[name for name, _ in s.entries] for s in layout.shards]
    assert sizes == [["big"], ["t0", "t1"], ["t2", "t3"], ["t4"]]
    for i, shard in enumerate(layout.shards):
        assert all(entry.shard == i for _, entry in shard.entries)
        assert shard.entries[0][1].begin == 0


def _values(snapshot, name):
    for i, shard in enumerate(snapshot.layout.shards):
        for n, entry in shard.entries:
            if n == name:
                start = shard.data_offset
                raw = bytes(snapshot.shard_view(i)[start + entry.begin : start + entry.end])
                if not raw:
                    return torch.empty(entry.shape, dtype=entry.dtype)
                flat = torch.frombuffer(bytearray(raw), dtype=entry.dtype)
                return flat.reshape(entry.shape)
    raise KeyError(name)


def test_snapshot_holds_exact_values_and_never_sees_later_mutations():
    tensors = _tensors()
    tensors["strided"] = torch.arange(12.0).reshape(3, 4).t()  # Not contiguous.
    expected = {k: v.clone() for k, v in tensors.items()}
    snapshot = Stager().stage({}, tensors, step=5, wall_time=1.0)
    for t in tensors.values():  # The training step continues right after the snapshot.
        if t.numel():
            t.copy_(torch.ones_like(t) if t.dtype != torch.bool else ~t)
    for name, value in expected.items():
        assert torch.equal(_values(snapshot, name), value), name
    assert snapshot.step == 5


def test_tensors_are_the_staged_copies_made_once_per_buffer_set():
    from torchsupervisor.checkpoint.snapshot import _entry_view

    stager = Stager()
    tensors = _tensors()
    first = stager.stage({}, tensors, step=1, wall_time=1.0)
    copies = first.tensors()
    assert copies.keys() == tensors.keys()
    for name, value in tensors.items():
        assert torch.equal(copies[name], value), name
    # The views made at allocation are the layout's entries over the staging buffer.
    shard = first.layout.shards[0]
    built = {
        name: _entry_view(first.buffers[0], shard.data_offset, entry)
        if entry.end > entry.begin
        else torch.empty(entry.shape, dtype=entry.dtype)
        for name, entry in shard.entries
    }
    assert built.keys() == copies.keys()
    for name, copy in copies.items():
        assert torch.equal(built[name], copy) and built[name].shape == copy.shape, name
    stager.release(first)
    second = stager.stage(
        {},
        {k: v + 1 if v.dtype.is_floating_point else v for k, v in tensors.items()},
        step=2,
        wall_time=2.0,
    )
    again = second.tensors()
    assert all(again[n] is copies[n] for n in copies)  # The same views over reused buffers...
    assert torch.equal(again["a_f32"], tensors["a_f32"] + 1)  # ...holding the new values.


def test_buffers_are_reused_for_the_same_layout_only():
    stager = Stager()
    tensors = {"w": torch.randn(64), "b": torch.randn(8)}
    first = stager.stage({}, tensors, step=1, wall_time=1.0)
    pointers = [b.data_ptr() for b in first.buffers]
    # Not released yet: a second snapshot must not share the buffers.
    second = stager.stage({}, tensors, step=2, wall_time=2.0)
    assert [b.data_ptr() for b in second.buffers] != pointers
    stager.release(first)
    third = stager.stage({}, tensors, step=3, wall_time=3.0)
    assert [b.data_ptr() for b in third.buffers] == pointers
    stager.release(third)
    other = stager.stage({}, {"w": torch.randn(65)}, step=4, wall_time=4.0)
    assert [b.data_ptr() for b in other.buffers] != pointers


@pytest.mark.parametrize(
    "change",
    ["broadcastable shape", "shape that does not broadcast", "dtype", "name gone", "name added"],
)
def test_a_changed_state_is_copied_into_buffers_laid_out_for_it(change):
    # Buffers laid out for the last state must not take one whose shapes still broadcast
    # into them (a (1,) tensor into a (4,) buffer) or whose dtypes convert (float64 into
    # float32): the snapshot holds exactly the new tensors, with their own layout.
    stager = Stager()
    tensors = {"w": torch.randn(4), "b": torch.randn(1), "n": torch.arange(3)}
    first = stager.stage({}, tensors, step=1, wall_time=1.0)
    stager.release(first)
    changed = dict(tensors)
    if change == "broadcastable shape":
        changed["w"] = torch.full((1,), 5.0)
    elif change == "shape that does not broadcast":
        changed["w"] = torch.randn(3)
    elif change == "dtype":
        changed["w"] = torch.randn(4, dtype=torch.float64)
    elif change == "name gone":
        del changed["b"]
    else:
        changed["z"] = torch.ones(2)
    second = stager.stage({}, changed, step=2, wall_time=2.0)
    staged = second.tensors()
    assert sorted(staged) == sorted(changed)
    for name, tensor in changed.items():
        assert staged[name].dtype == tensor.dtype and torch.equal(staged[name], tensor), name
    assert second.layout == plan_layout(changed)
    stager.release(second)
    third = stager.stage({}, changed, step=3, wall_time=3.0)  # Now the same: reused.
    assert [b.data_ptr() for b in third.buffers] == [b.data_ptr() for b in second.buffers]
    assert all(torch.equal(third.tensors()[n], t) for n, t in changed.items())


def test_buffer_starts_with_the_safetensors_header():
    snapshot = Stager().stage({}, {"w": torch.ones(2)}, step=None, wall_time=0.0)
    shard = snapshot.layout.shards[0]
    assert bytes(snapshot.shard_view(0)[: shard.data_offset]) == shard.header
    assert len(snapshot.shard_view(0)) == shard.size_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_state_is_staged_in_pinned_buffers_and_fenced(tmp_path):
    """GPU tensors are copied into pinned host buffers with non-blocking copies, and
    ``stage`` returns only once they have landed: kernels queued right after it (the next
    training step) never reach the snapshot."""
    torch.manual_seed(0)
    big = torch.randn(16 << 20, device="cuda")  # 64 MiB: a copy that takes a while.
    tensors = {
        "big": big,
        "w": torch.randn(33, 7, device="cuda", dtype=torch.bfloat16),
        "step": torch.tensor(7, device="cuda"),
        "cpu": torch.arange(5.0),  # A CPU tensor in a GPU state.
    }
    expected = {name: t.cpu() for name, t in tensors.items()}
    torch.cuda.synchronize()
    stager = Stager()
    snapshot = stager.stage({}, tensors, step=1, wall_time=0.0)
    for t in tensors.values():  # Queued on the stream right after the snapshot.
        t.mul_(2)
    assert all(b.is_pinned() for b in snapshot.buffers)
    for name, value in expected.items():  # Read at once, without synchronizing.
        assert torch.equal(_values(snapshot, name), value), name
    torch.cuda.synchronize()
    pointers = [b.data_ptr() for b in snapshot.buffers]
    stager.release(snapshot)
    second = stager.stage({}, tensors, step=2, wall_time=0.0)
    assert [b.data_ptr() for b in second.buffers] == pointers  # Reused, still pinned.
    assert all(b.is_pinned() for b in second.buffers)
    for name, t in tensors.items():
        assert torch.equal(_values(second, name), t.cpu()), name
    # The same path end to end: a GPU state round-trips through a checkpoint.
    from torchsupervisor import Saver, Session

    state = {"model": torch.nn.Linear(8, 4).cuda()}
    prefix = Saver().save(Session(state), str(tmp_path / "m"), global_step=1)
    fresh = {"model": torch.nn.Linear(8, 4).cuda()}
    Saver().restore(Session(fresh), prefix)
    for a, b in zip(state["model"].parameters(), fresh["model"].parameters()):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_staging_without_wait_returns_events_and_later_kernels_do_not_reach_it():
    """``wait=False`` returns once the copies are queued (no device-wide sync); the events
    mark their end, and kernels queued right after (the next step) run after the copies."""
    torch.manual_seed(0)
    tensors = {"big": torch.randn(16 << 20, device="cuda"), "cpu": torch.arange(5.0)}
    expected = {name: t.cpu() for name, t in tensors.items()}
    torch.cuda.synchronize()
    snapshot = Stager().stage({}, tensors, step=1, wall_time=0.0, wait=False)
    assert len(snapshot.copies) == 1  # One device, one event.
    for t in tensors.values():
        t.mul_(2)  # Queued after the copy on the same stream.
    snapshot.wait_copied()
    for name, value in expected.items():
        assert torch.equal(_values(snapshot, name), value), name


def test_a_host_state_is_copied_at_once_and_has_no_copies_to_wait_for():
    tensors = _tensors()
    expected = {name: t.clone() for name, t in tensors.items()}
    snapshot = Stager().stage({}, tensors, step=1, wall_time=0.0, wait=False)
    assert snapshot.copies == ()
    for t in tensors.values():
        if t.dtype != torch.bool and t.numel():
            t.add_(1)
    for name, value in expected.items():
        assert torch.equal(_values(snapshot, name), value), name


def test_the_writer_waits_for_the_device_copies_before_it_reads_a_buffer(tmp_path, monkeypatch):
    """What a GPU run relies on, checked with the CPU path: ``SnapshotWriter.stage`` asks
    for ``wait=False`` and its ``persist`` waits for the copies before the commit reads."""
    from fake_copies import fake_device_copies

    from torchsupervisor import Saver, Session
    from torchsupervisor.checkpoint import writers

    order = []
    fake_device_copies(order, (writers, "persist", "commit reads the buffers"), monkeypatch.setattr)
    saver = Saver()
    future = saver.save_async(Session({"w": torch.ones(4)}), str(tmp_path / "m"), global_step=1)
    assert future.result(60) == str(tmp_path / "m-1")
    saver.close()
    # The release of the buffers waits for them too (at once here: a save given up before
    # it waited must not hand buffers that a copy still writes to the next snapshot).
    assert order == [
        "staged, wait=False",
        "copies done",
        "commit reads the buffers",
        "copies done",
    ]
