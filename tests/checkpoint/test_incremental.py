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
    with pytest.raises(ValueError, match="full_save_every_n_saves must be >= 1, got 0"):
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
    with pytest.raises(
        StaleReferenceError,
        match=r"tensors w \(committed in m-1\.data-00000-of-00001\) changed without their version",
    ):
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


def _three_saves(state, directory):
    """m-0 and m-1 full (two independent chains), then m-2 referencing m-1's backbone."""
    saver = Saver(max_to_keep=None)
    sess = Session(state)
    zeroth = saver.save(sess, str(directory / "m"), global_step=0)
    first = saver.save(sess, str(directory / "m"), global_step=1)
    _train(state)
    second = saver.save(sess, str(directory / "m"), global_step=2)
    return zeroth, first, second


def test_a_corrupt_referenced_shard_makes_the_restart_fall_back(tmp_path):
    state = _frozen_state()
    zeroth, first, second = _three_saves(state, tmp_path)
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


# -------------------------------------------------------------- writes without version bumps


class FrozenBN(nn.Module):
    """A frozen backbone with batch norm (its running statistics still update in training
    mode) and a trainable head."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(256, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 256)
        )
        self.head = nn.Linear(256, 4)
        self.backbone.requires_grad_(False)

    def forward(self, x):
        return self.head(self.backbone(x))


def _expected(state):
    """A deep copy of every tensor the checkpoint of ``state`` holds, by name."""
    from torchsupervisor.core.state import flatten_state

    _, tensors = flatten_state(state)
    return {name: t.clone() for name, t in tensors.items()}


def _assert_restores_exactly(prefix, expected, make_state):
    fresh = make_state()
    Saver().restore(Session(fresh), prefix)
    got = _expected(fresh)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), (prefix, name)


def test_fused_adam_and_batch_norm_updates_are_never_referenced(tmp_path):
    """Fused Adam writes parameters and moments, batch norm its running statistics, without
    bumping their version counters: they are copied at every save, the frozen weights are
    still written once per chain, and every checkpoint restores bit-exactly."""
    probe = nn.Linear(2, 2)
    fused = torch.optim.Adam(probe.parameters(), fused=True)
    probe(torch.ones(1, 2)).sum().backward()
    version = probe.weight._version
    fused.step()
    if probe.weight._version != version:  # pragma: no cover - a torch that bumps them
        pytest.skip("this torch's fused Adam bumps version counters")

    def make_state(seed=0):
        torch.manual_seed(seed)
        model = FrozenBN()
        # Over every parameter, as usual: the frozen ones have no gradient and are skipped.
        opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
        return {"model": model, "optimizer": opt}

    state = make_state()
    saver = Saver(max_to_keep=None)  # Saves: full, full, then 3 incremental, then full.
    sess = Session(state)
    expected, written = {}, []
    for step in range(1, 7):
        _train(state)
        prefix = saver.save(sess, str(tmp_path / "m"), global_step=step)  # Never raises.
        expected[prefix] = _expected(state)
        written.append(saver.last_save.bytes_reused == 0)
        own = f"m-{step}.data-00000-of-00001"
        manifest = CheckpointReader(prefix).manifest
        for name, entry in manifest.tensors.items():
            frozen_weight = name.startswith("model/backbone.") and "running" not in name
            if not frozen_weight or name.endswith("num_batches_tracked"):
                assert manifest.shards[entry.shard].file == own, (step, name)
    assert written == [True, True, False, False, False, True]
    for step in (3, 4, 5):  # The frozen weights come from the chain's full save.
        manifest = CheckpointReader(str(tmp_path / f"m-{step}")).manifest
        for name in ("model/backbone.0.weight", "model/backbone.3.weight"):
            entry = manifest.tensors[name]
            assert manifest.shards[entry.shard].file == "m-2.data-00000-of-00001"
    for prefix, values in expected.items():
        _assert_restores_exactly(prefix, values, lambda: make_state(seed=9))
    # The values did change between saves (the test would be vacuous otherwise).
    first, last = expected[str(tmp_path / "m-1")], expected[str(tmp_path / "m-6")]
    for name in ("model/head.weight", "optimizer/state/6/exp_avg", "model/backbone.1.running_mean"):
        assert not torch.equal(first[name], last[name]), name
    assert torch.equal(first["model/backbone.0.weight"], last["model/backbone.0.weight"])


def test_a_parameter_trained_before_it_was_frozen_is_copied_once_more(tmp_path):
    """Referenced only if it was frozen when copied: fused updates before the freeze left
    its version counter where the last copy saw it."""

    def make_state(seed=0):
        torch.manual_seed(seed)
        return {"model": FrozenBN().eval()}  # The optimizer is not part of the state.

    state = make_state()
    model = state["model"]
    model.head.requires_grad_(True)
    opt = torch.optim.Adam(model.head.parameters(), lr=0.01, fused=True)
    saver = Saver(max_to_keep=None)
    sess = Session(state)

    def train():
        opt.zero_grad()
        model(torch.randn(8, 256)).pow(2).mean().backward()
        opt.step()

    saver.save(sess, str(tmp_path / "m"), global_step=1)
    saver.save(sess, str(tmp_path / "m"), global_step=2)
    train()
    saver.save(sess, str(tmp_path / "m"), global_step=3)  # Head trainable: copied.
    train()
    model.head.requires_grad_(False)
    fourth = saver.save(sess, str(tmp_path / "m"), global_step=4)  # Copied again.
    expected = _expected(state)
    fifth = saver.save(sess, str(tmp_path / "m"), global_step=5)  # Now referenced.
    manifests = [CheckpointReader(p).manifest for p in (fourth, fifth)]
    files = [m.shards[m.tensors["model/head.weight"].shard].file for m in manifests]
    assert files == ["m-4.data-00000-of-00001", "m-4.data-00000-of-00001"]
    for prefix in (fourth, fifth):
        _assert_restores_exactly(prefix, expected, lambda: make_state(seed=5))


def test_a_frozen_parameter_with_a_stale_gradient_is_copied(tmp_path):
    """The optimizer still updates a frozen parameter that kept its gradient (fused SGD
    without momentum: no optimizer state, no version bump)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    model(torch.randn(4, 64)).sum().backward()
    model.requires_grad_(False)  # The gradients stay.
    state = {"model": model, "optimizer": opt}
    saver = Saver(max_to_keep=None)
    sess = Session(state)
    for step in range(1, 5):
        opt.step()
        prefix = saver.save(sess, str(tmp_path / "m"), global_step=step)
        assert saver.last_save.bytes_reused == 0 and not opt.state
        assert torch.equal(CheckpointReader(prefix).get_tensor("model/weight"), model.weight)


def test_a_write_through_data_into_a_frozen_tensor_fails_one_save_naming_it(tmp_path):
    """``p.data.add_()`` bypasses the version counter: on the CPU the writer's checksum
    catches it; the save is not committed (the value at its step is gone), the error names
    the tensor and why, and from then on the tensor is copied at every save."""
    state = _frozen_state()
    saver = Saver(max_to_keep=None)
    sess = Session(state)
    backbone = state["model"].backbone[0]
    first = saver.save(sess, str(tmp_path / "m"), global_step=1)
    expected_first = _expected(state)
    saver.save(sess, str(tmp_path / "m"), global_step=2)
    version = backbone.weight._version
    backbone.weight.data.add_(1.0)  # An EMA-style update through .data: no bump.
    assert backbone.weight._version == version
    with pytest.raises(StaleReferenceError) as info:
        saver.save(sess, str(tmp_path / "m"), global_step=3)
    message = str(info.value)
    assert "model/backbone.0.weight (committed in m-2.data-00000-of-00001)" in message
    assert "changed without their version counter changing" in message and ".data" in message
    assert info.value.names == frozenset({"model/backbone.0.weight"})
    assert not os.path.exists(tmp_path / "m-3.index")
    assert [p for p in os.listdir(tmp_path) if ".tmp" in p or p.startswith("m-3")] == []
    _assert_restores_exactly(first, expected_first, lambda: _frozen_state(seed=1))
    for step in (4, 5, 6):
        backbone.weight.data.add_(1.0)
        prefix = saver.save(sess, str(tmp_path / "m"), global_step=step)
        manifest = CheckpointReader(prefix).manifest
        entry = manifest.tensors["model/backbone.0.weight"]
        assert manifest.shards[entry.shard].file == f"m-{step}.data-00000-of-00001"
        _assert_restores_exactly(prefix, _expected(state), lambda: _frozen_state(seed=1))


def test_a_damaged_header_of_a_shard_read_in_part_makes_the_restart_fall_back(tmp_path, caplog):
    """m-2 reads only the frozen tensors of m-1's shard: the header's own CRC still covers
    the header, so the damage is found although every tensor read is intact."""
    state = _frozen_state()
    zeroth, first, second = _three_saves(state, tmp_path)
    shard = first + ".data-00000-of-00001"
    manifest = CheckpointReader(second).manifest
    referenced = [
        n
        for n, e in manifest.tensors.items()
        if manifest.shards[e.shard].file != "m-2.data-00000-of-00001"
    ]
    assert 0 < len(referenced) < len(CheckpointReader(first).manifest.tensors)
    _flip(shard, 30)
    for prefix in (second, first):
        with pytest.raises(CorruptCheckpointError, match="header damaged") as info:
            CheckpointReader(prefix).read_tensors()
        assert info.value.path == shard
    with caplog.at_level("WARNING", "torchsupervisor"):
        sess2, restored = SessionManager(state=_frozen_state(seed=4)).recover_session(
            saver=Saver(), checkpoint_dir=str(tmp_path)
        )
    assert restored and sess2.restored_checkpoint == zeroth
    assert f"Checkpoint shard {shard} is corrupt: header damaged (checksum mismatch)" in caplog.text
