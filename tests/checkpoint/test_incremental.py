"""Incremental checkpoints: unchanged tensors are referenced, never copied or written again."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

from torchsupervisor import Saver, Session, SessionManager
from torchsupervisor.checkpoint.incremental import StaleReferenceError
from torchsupervisor.checkpoint.policy import default_full_save_interval
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.checkpoint.recovery import restore_candidates
from torchsupervisor.errors import CheckpointSaveError, CorruptCheckpointError


class Frozen(nn.Module):
    """A large frozen backbone and a small trainable head."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
        self.head = nn.Linear(256, 4)
        self.backbone.requires_grad_(False)

    def forward(self, x):
        return self.head(self.backbone(x))


def _frozen_state(seed=0):
    torch.manual_seed(seed)
    model = Frozen()
    opt = torch.optim.Adam(model.head.parameters(), lr=0.01)
    return {"model": model, "optimizer": opt}


def _train(state, steps=2):
    for _ in range(steps):
        state["optimizer"].zero_grad()
        state["model"](torch.randn(8, 256)).pow(2).mean().backward()
        state["optimizer"].step()


def _data_files(directory):
    return sorted(f for f in os.listdir(directory) if ".data-" in f)


def _flip(path, offset):
    """Flip one bit of the byte at ``offset`` (negative: from the end)."""
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_SET if offset >= 0 else os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


def _files_of(prefix):
    """The data files checkpoint ``prefix`` reads (its own and those it references)."""
    return {shard.file for shard in CheckpointReader(prefix).manifest.shards}


def _kept(directory):
    return sorted(
        os.path.join(directory, f[: -len(".index")])
        for f in os.listdir(directory)
        if f.endswith(".index")
    )


def test_frozen_backbone_is_written_once_per_chain(tmp_path):
    state = _frozen_state()
    _train(state, 1)
    saver = Saver(max_to_keep=10)
    sess = Session(state)
    first = saver.save(sess, str(tmp_path / "m"), global_step=1)
    full_bytes = saver.last_save.bytes_written
    _train(state)
    # The second save of a fresh directory is full: with only the first one to reference,
    # one damaged file would break both.
    second = saver.save(sess, str(tmp_path / "m"), global_step=3)
    assert saver.last_save.bytes_written == full_bytes and saver.last_save.bytes_reused == 0
    assert _files_of(second) == {"m-3.data-00000-of-00001"}
    _train(state)
    third = saver.save(sess, str(tmp_path / "m"), global_step=5)
    assert saver.last_save.bytes_written < 0.1 * full_bytes
    manifest = CheckpointReader(third).manifest
    backbone = manifest.tensors["model/backbone.0.weight"]
    assert manifest.shards[backbone.shard].file == "m-3.data-00000-of-00001"
    head = manifest.tensors["model/head.weight"]
    assert manifest.shards[head.shard].file == "m-5.data-00000-of-00001"
    CheckpointReader(third).verify()
    fresh = _frozen_state(seed=1)
    Saver().restore(Session(fresh), third)
    for a, b in zip(fresh["model"].state_dict().values(), state["model"].state_dict().values()):
        assert torch.equal(a, b)
    assert CheckpointReader(first).global_step == 1


def test_retention_keeps_data_a_kept_checkpoint_references(tmp_path):
    state = _frozen_state()
    saver = Saver(max_to_keep=3)  # A full save at least every 2 saves.
    sess = Session(state)
    listings = []
    reads = {}
    for step in range(1, 7):
        _train(state)
        prefix = saver.save(sess, str(tmp_path / "m"), global_step=step)
        reads[step] = _files_of(prefix)
        listings.append((_data_files(tmp_path), [os.path.basename(p) for p in _kept(tmp_path)]))
    data = "m-{}.data-00000-of-00001".format
    assert reads[3] == {data(2), data(3)}  # m-3 references m-2
    assert reads[5] == {data(4), data(5)}  # m-5 references m-4
    assert reads[2] == {data(2)} and reads[4] == {data(4)} and reads[6] == {data(6)}
    assert listings[3] == (  # After m-4 (full): m-1 goes, index and data.
        [data(2), data(3), data(4)],
        ["m-2", "m-3", "m-4"],
    )
    assert listings[4] == (  # After m-5: m-2's index goes, its data stays (m-3 reads it).
        [data(2), data(3), data(4), data(5)],
        ["m-3", "m-4", "m-5"],
    )
    assert listings[5] == (  # After m-6: m-3 goes, and with it the last reader of m-2's data.
        [data(4), data(5), data(6)],
        ["m-4", "m-5", "m-6"],
    )
    for prefix in _kept(tmp_path):
        CheckpointReader(prefix).verify()
    Saver().restore(Session(_frozen_state(seed=3)), str(tmp_path / "m-5"))


@pytest.mark.parametrize("max_to_keep", [1, 2, 3, 5, None])
def test_no_single_damaged_file_breaks_every_kept_checkpoint(tmp_path, max_to_keep):
    """Whatever retention kept, each data file can be lost and a kept checkpoint survives."""
    state = _frozen_state()
    saver = Saver(max_to_keep=max_to_keep)
    sess = Session(state)
    full_saves = 0
    for step in range(1, 16):
        _train(state)
        if step == 9:  # A tensor that changes now and then: copied once, then referenced.
            with torch.no_grad():
                state["model"].backbone[0].bias.add_(1)
        saver.save(sess, str(tmp_path / "m"), global_step=step)
        full_saves += saver.last_save.bytes_reused == 0
        kept = _kept(tmp_path)
        reads = {prefix: _files_of(prefix) for prefix in kept}
        on_disk = set(_data_files(tmp_path))
        # Retention: exactly the data files some kept checkpoint reads stay on disk.
        assert on_disk == set().union(*reads.values()), step
        if max_to_keep == 1:
            assert len(kept) == 1 and reads[kept[0]] == {f"m-{step}.data-00000-of-00001"}
            continue
        if step == 1:
            continue
        for damaged in on_disk:
            survivors = [p for p in kept if damaged not in reads[p]]
            assert survivors, f"step {step}: {damaged} breaks every kept checkpoint {kept}"
    # Full saves: every one with 1 or 2 kept; else the first two, then one every N - 1 saves.
    assert full_saves == {1: 15, 2: 15, 3: 8, 5: 5, None: 5}[max_to_keep]


def test_full_save_every_n_saves(tmp_path):
    state = _frozen_state()
    saver = Saver(max_to_keep=10, full_save_every_n_saves=2)
    sess = Session(state)
    full = []
    for step in range(1, 8):
        _train(state)
        saver.save(sess, str(tmp_path / "m"), global_step=step)
        full.append(saver.last_save.bytes_reused == 0)
    # F F (first chain has no predecessor) then a full save every 2 saves.
    assert full == [True, True, False, True, False, True, False]
    assert [default_full_save_interval(n) for n in (None, 0, 1, 2, 3, 5, 10)] == [
        4,
        4,
        1,
        1,
        2,
        4,
        9,
    ]
    with pytest.raises(ValueError, match="full_save_every_n_saves must be at least 1, got 0"):
        Saver(full_save_every_n_saves=0)


def test_a_restart_falls_back_past_a_damaged_chain(tmp_path, caplog):
    """The audit's case: one flipped byte in a data file that several checkpoints read."""
    state = _frozen_state()
    saver = Saver()  # max_to_keep=5: full saves at steps 0, 10, then 50.
    sess = Session(state)
    for step in range(0, 50, 10):
        _train(state)
        saver.save(sess, str(tmp_path / "model.ckpt"), global_step=step)
    newest = str(tmp_path / "model.ckpt-40")
    reader = CheckpointReader(newest)
    entry = reader.manifest.tensors["model/backbone.0.weight"]
    shard = reader.manifest.shards[entry.shard]
    assert shard.file == "model.ckpt-10.data-00000-of-00001"  # Read by 10, 20, 30 and 40.
    _flip(tmp_path / shard.file, shard.data_offset + entry.begin + 17)
    fresh = _frozen_state(seed=4)
    manager = SessionManager(state=fresh)
    with caplog.at_level("WARNING", "torchsupervisor"):
        sess2, restored = manager.recover_session(saver=Saver(), checkpoint_dir=str(tmp_path))
    assert restored and sess2.restored_checkpoint == str(tmp_path / "model.ckpt-0")
    assert "model.ckpt-10.data-00000-of-00001 is corrupt" in caplog.text
    expected = CheckpointReader(str(tmp_path / "model.ckpt-0")).read_tensors()
    for name, value in fresh["model"].state_dict().items():
        assert torch.equal(value, expected[f"model/{name}"]), name


def test_a_damaged_first_full_save_costs_only_itself(tmp_path):
    state = _frozen_state()
    saver = Saver()
    sess = Session(state)
    for step in range(0, 50, 10):
        _train(state)
        saver.save(sess, str(tmp_path / "model.ckpt"), global_step=step)
    _flip(tmp_path / "model.ckpt-0.data-00000-of-00001", -3)
    for step in (10, 20, 30, 40):
        CheckpointReader(str(tmp_path / f"model.ckpt-{step}")).verify()
    _, restored = SessionManager(state=_frozen_state(seed=2)).recover_session(
        saver=Saver(), checkpoint_dir=str(tmp_path)
    )
    assert restored


def test_remove_checkpoint_keeps_referenced_data(tmp_path):
    from torchsupervisor import remove_checkpoint

    state = _frozen_state()
    saver = Saver(max_to_keep=None)
    sess = Session(state)
    saver.save(sess, str(tmp_path / "m"), global_step=0)
    first = saver.save(sess, str(tmp_path / "m"), global_step=1)
    _train(state)
    second = saver.save(sess, str(tmp_path / "m"), global_step=2)
    remove_checkpoint(first)
    assert not os.path.exists(first + ".index")
    assert os.path.exists(first + ".data-00000-of-00001")
    CheckpointReader(second).verify()
    remove_checkpoint(second)
    assert _data_files(tmp_path) == ["m-0.data-00000-of-00001", "m-1.data-00000-of-00001"]


def test_writes_behind_pytorchs_back_are_caught_and_never_committed(tmp_path):
    weight = torch.zeros(1000)
    saver = Saver()
    sess = Session({"w": weight})
    saver.save(sess, str(tmp_path / "m"), global_step=0)
    saver.save(sess, str(tmp_path / "m"), global_step=1)  # Full: the second of a directory.
    weight.numpy()[:] = 7.0  # No version-counter bump.
    with pytest.raises(StaleReferenceError, match=r"tensors w changed without their version"):
        saver.save(sess, str(tmp_path / "m"), global_step=2)
    assert not os.path.exists(tmp_path / "m-2.index")
    third = saver.save(sess, str(tmp_path / "m"), global_step=3)  # Copied from now on.
    assert torch.equal(CheckpointReader(third).get_tensor("w"), torch.full((1000,), 7.0))
    weight.numpy()[:] = 8.0
    fourth = saver.save(sess, str(tmp_path / "m"), global_step=4)
    assert torch.equal(CheckpointReader(fourth).get_tensor("w"), torch.full((1000,), 8.0))


def test_numpy_arrays_are_always_copied(tmp_path):
    array = np.zeros(100)
    saver = Saver()
    sess = Session({"a": array})
    saver.save(sess, str(tmp_path / "m"), global_step=1)
    array[:] = 3.0
    second = saver.save(sess, str(tmp_path / "m"), global_step=2)
    assert torch.equal(CheckpointReader(second).get_tensor("a"), torch.full((100,), 3.0).double())


def test_a_missing_referenced_file_fails_the_save_then_a_full_save_follows(tmp_path):
    weight = torch.ones(100)
    saver = Saver(max_to_keep=None)
    sess = Session({"w": weight})
    saver.save(sess, str(tmp_path / "m"), global_step=0)
    first = saver.save(sess, str(tmp_path / "m"), global_step=1)
    os.remove(first + ".data-00000-of-00001")
    with pytest.raises(CheckpointSaveError, match="is missing or was modified"):
        saver.save(sess, str(tmp_path / "m"), global_step=2)
    third = saver.save(sess, str(tmp_path / "m"), global_step=3)
    manifest = CheckpointReader(third).manifest
    assert [s.file for s in manifest.shards] == ["m-3.data-00000-of-00001"]


def test_overwriting_data_that_newer_checkpoints_use_is_refused(tmp_path):
    state = _frozen_state()
    saver = Saver(max_to_keep=None)
    sess = Session(state)
    saver.save(sess, str(tmp_path / "m"), global_step=0)
    first = saver.save(sess, str(tmp_path / "m"), global_step=1)
    _train(state)
    second = saver.save(sess, str(tmp_path / "m"), global_step=2)
    with pytest.raises(CheckpointSaveError, match="still hold tensors of newer incremental"):
        Saver().save(sess, str(tmp_path / "m"), global_step=1)
    CheckpointReader(second).verify()
    CheckpointReader(first).verify()


def test_a_corrupt_referenced_shard_makes_the_restart_fall_back(tmp_path):
    state = _frozen_state()
    saver = Saver(max_to_keep=None)
    sess = Session(state)
    zeroth = saver.save(sess, str(tmp_path / "m"), global_step=0)
    first = saver.save(sess, str(tmp_path / "m"), global_step=1)
    _train(state)
    second = saver.save(sess, str(tmp_path / "m"), global_step=2)
    reader = CheckpointReader(first)
    entry = reader.manifest.tensors["model/backbone.2.weight"]  # Referenced by m-2.
    with open(first + ".data-00000-of-00001", "r+b") as f:
        f.seek(reader.manifest.shards[0].data_offset + entry.begin + 100)
        f.write(b"\xff" * 4)
    for prefix in (second, first):
        with pytest.raises(CorruptCheckpointError, match=r"m-1\.data-00000-of-00001"):
            CheckpointReader(prefix).read_tensors()
    assert restore_candidates(str(tmp_path)) == [second, first, zeroth]
    CheckpointReader(zeroth).verify()  # Independent of the damaged file.


def test_incremental_can_be_turned_off(tmp_path):
    saver = Saver(incremental=False)
    sess = Session({"w": torch.ones(100)})
    saver.save(sess, str(tmp_path / "m"), global_step=1)
    full = saver.last_save.bytes_written
    saver.save(sess, str(tmp_path / "m"), global_step=2)
    assert saver.last_save.bytes_written == full
