"""Staging buffers that are the memory tier's files (``storage.slots``): a slot becomes a data
file by a rename, comes back when retention deletes it, and is never written while it is a
snapshot's or read by a peer send."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from torchsupervisor.checkpoint.snapshot import Stager
from torchsupervisor.storage.private import MemoryTierStorage
from torchsupervisor.storage.slots import STAGE_PREFIX, SlotFiles


def _storage(tmp_path) -> tuple[MemoryTierStorage, SlotFiles]:
    storage = MemoryTierStorage()
    storage.slots = SlotFiles(str(tmp_path))
    return storage, storage.slots


def _stages(tmp_path) -> list[str]:
    return sorted(n for n in os.listdir(tmp_path) if n.startswith(STAGE_PREFIX))


def test_a_slot_becomes_the_data_file_by_a_rename_and_comes_back_at_its_deletion(tmp_path):
    storage, slots = _storage(tmp_path)
    buffer = slots.allocate(4096)
    (name,) = _stages(tmp_path)
    inode = os.stat(tmp_path / name).st_ino
    assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600
    buffer.copy_(torch.arange(4096) % 251)
    data = str(tmp_path / "model.ckpt-1.data-00000-of-00001")
    storage.put(data, [buffer.numpy()])
    assert _stages(tmp_path) == [] and os.stat(data).st_ino == inode
    with open(data, "rb") as f:
        assert f.read() == bytes(buffer.numpy())  # The copy into the mapping: the file.
    assert slots.is_committed(data) and not slots.reusable(buffer)
    storage.delete(data)  # Retention: a free slot again, the same pages.
    assert not os.path.exists(data) and storage.spares(str(tmp_path)) == []
    (name,) = _stages(tmp_path)
    assert os.stat(tmp_path / name).st_ino == inode and slots.reusable(buffer)


def test_what_is_not_a_whole_free_slot_is_written_as_before(tmp_path):
    storage, slots = _storage(tmp_path)
    buffer = slots.allocate(8192)
    half = str(tmp_path / "model.ckpt-1.data-00000-of-00001")
    storage.put(half, [buffer[:4096].numpy()])  # Part of a slot: copied.
    other = str(tmp_path / "model.ckpt-2.data-00000-of-00001")
    storage.put(other, [b"x" * 100])  # Not a slot.
    assert len(_stages(tmp_path)) == 1 and slots.reusable(buffer)
    assert not slots.is_committed(half) and not slots.is_committed(other)
    storage.delete(other)  # Unlinked: with slots, no data file becomes a spare.
    assert not os.path.exists(other) and storage.spares(str(tmp_path)) == []


def test_a_slot_deleted_while_read_is_retired_and_its_reader_keeps_its_bytes(tmp_path):
    storage, slots = _storage(tmp_path)
    buffer = slots.allocate(4096)
    buffer.fill_(7)
    data = str(tmp_path / "model.ckpt-1.data-00000-of-00001")
    storage.put(data, [buffer.numpy()])
    with storage.reading(data), open(data, "rb") as f:
        storage.delete(data)
        assert _stages(tmp_path) == [] and not os.path.exists(data)
        assert not slots.reusable(buffer) and slots.retired(buffer)
        assert f.read() == b"\x07" * 4096


def test_the_stager_never_copies_into_a_committed_slot(tmp_path):
    storage, slots = _storage(tmp_path)
    stager = Stager(slots)
    w = torch.zeros(1000)
    committed: list[str] = []
    seen = []
    for step in range(1, 6):
        w.fill_(step)
        snapshot = stager.stage({}, {"w": w}, step=step, wall_time=0.0)
        seen.append(snapshot.buffers[0].data_ptr())
        data = str(tmp_path / f"model.ckpt-{step}.data-00000-of-00001")
        storage.put(data, [snapshot.shard_view(0)])
        stager.release(snapshot)
        if committed:
            with open(committed[-1], "rb") as f:  # The older snapshot is intact (this
                older = f.read()  # step was staged elsewhere)...
            tail = torch.frombuffer(bytearray(older[-4000:]), dtype=torch.float32)
            assert tail.eq(step - 1).all()
            storage.delete(committed.pop())  # ... then retention deletes it.
        committed.append(data)
    assert len(set(seen)) == 2  # Two slots, staged into in turn.
    assert len(_stages(tmp_path)) == 1


def test_leftover_slots_of_a_killed_process_are_removed_and_close_frees_the_free_ones(tmp_path):
    (tmp_path / f"{STAGE_PREFIX}dead").write_bytes(b"x")
    (tmp_path / "model.ckpt-1.index").write_bytes(b"{}")
    assert SlotFiles.remove_leftovers(str(tmp_path)) == [str(tmp_path / f"{STAGE_PREFIX}dead")]
    assert os.listdir(tmp_path) == ["model.ckpt-1.index"]
    storage, slots = _storage(tmp_path)
    kept = slots.allocate(4096)
    free = slots.allocate(4096)
    data = str(tmp_path / "model.ckpt-2.data-00000-of-00001")
    storage.put(data, [kept.numpy()])
    slots.close()
    assert _stages(tmp_path) == [] and os.path.exists(data)  # A snapshot's file stays.
    assert slots.retired(free) and not slots.reusable(kept)


def test_a_slot_whose_file_is_gone_is_retired_not_staged_into_again(tmp_path):
    storage, slots = _storage(tmp_path)
    buffer = slots.allocate(4096)
    for name in _stages(tmp_path):
        os.unlink(tmp_path / name)  # Another process of the same rank's directory, say.
    with pytest.raises(FileNotFoundError):
        storage.put(str(tmp_path / "model.ckpt-1.data-00000-of-00001"), [buffer.numpy()])
    assert not slots.reusable(buffer) and slots.retired(buffer)


def test_a_slot_whose_file_another_process_cut_is_never_staged_into(tmp_path):
    """A copy into a mapping past the end of a file cut shorter would kill the process
    (SIGBUS): such a slot is retired, and the stager takes a new one."""
    _, slots = _storage(tmp_path)
    stager = Stager(slots)
    first = stager.stage({}, {"w": torch.ones(4096)}, step=1, wall_time=0.0)
    buffer = first.buffers[0]
    stager.release(first)
    (name,) = _stages(tmp_path)
    os.truncate(tmp_path / name, 100)
    second = stager.stage({}, {"w": torch.ones(4096)}, step=2, wall_time=0.0)
    assert second.buffers[0].data_ptr() != buffer.data_ptr()  # Not into the cut file.
    assert second.tensors()["w"].eq(1).all()
    assert not slots.reusable(buffer) and slots.retired(buffer)
