"""Hostile or odd files are damage: the restart falls back, within seconds, naming the file.

Each case damages the newest of three checkpoints in a way a checksum alone does not catch
(the manifests here are rewritten with a correct checksum: an adversary, or a bug, not a bit
flip), then checks that a restart restores the previous one, that ``verify`` predicts that
same fallback, and that nothing outside the directory was followed or revealed.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
from supervisor_helpers import Trainer

import torchsupervisor as ts
from torchsupervisor import CheckpointReader, Saver, Session
from torchsupervisor.checkpoint.format import Manifest
from torchsupervisor.cli import main as cli_main
from torchsupervisor.core.state import MAX_STATE_DEPTH
from torchsupervisor.core.tree import MAX_TREE_DEPTH, check_tree_depth, encode_tree
from torchsupervisor.errors import CorruptCheckpointError, ManifestError

FALLBACK_SECS = 30.0  # "Quickly": a hang (a FIFO read, a huge header) would never end.


def _three_checkpoints(logdir):
    trainer = Trainer()
    sv = ts.Supervisor(
        logdir=str(logdir), state=trainer.state, save_model_secs=3600, save_summaries_secs=0
    )
    with sv.managed_session() as sess:
        for _ in range(3):
            sess.run(trainer.train_step)
            sv.checkpoint()
    return [str(logdir / f"model.ckpt-{s}") for s in (1, 2, 3)]


def _rewrite(prefix, **changes):
    """Rewrite ``prefix.index`` with ``changes`` applied and a correct checksum."""
    with open(prefix + ".index", "rb") as f:
        manifest = Manifest.from_bytes(f.read())
    data = dataclasses.replace(manifest, **changes).to_bytes()
    with open(prefix + ".index", "wb") as f:
        f.write(data)


def _restart_restores(logdir, expected, capsys):
    start = time.monotonic()
    code = cli_main(["verify", str(logdir)])
    out = capsys.readouterr().out
    assert code == 1 and f"fall back to {os.path.basename(expected)}" in out, out
    trainer = Trainer(seed=9)
    sv = ts.Supervisor(
        logdir=str(logdir), state=trainer.state, save_model_secs=3600, save_summaries_secs=0
    )
    with sv.managed_session() as sess:
        assert sess.restored_checkpoint == expected
    assert time.monotonic() - start < FALLBACK_SECS
    return out


def _shard(prefix):
    return prefix + ".data-00000-of-00001"


@pytest.mark.parametrize("name", ["../outside.data", "/etc/hostname", "a/b", "..", ""])
def test_shard_names_must_be_plain_names_in_the_directory(tmp_path, capsys, name):
    logdir = tmp_path / "run"
    logdir.mkdir()
    (tmp_path / "outside.data").write_bytes(b"x" * 12345)
    _, second, newest = _three_checkpoints(logdir)
    with open(newest + ".index", "rb") as f:
        manifest = Manifest.from_bytes(f.read())
    shards = tuple(dataclasses.replace(s, file=name) for s in manifest.shards)
    _rewrite(newest, shards=shards)
    with pytest.raises(CorruptCheckpointError, match="is not a plain file name"):
        CheckpointReader(newest)
    out = _restart_restores(logdir, second, capsys)
    assert "12345" not in out  # Nothing about another file's size leaks out.


def test_a_shard_linked_out_of_the_directory_is_damage(tmp_path, capsys):
    logdir = tmp_path / "run"
    logdir.mkdir()
    _, second, newest = _three_checkpoints(logdir)
    outside = tmp_path / "elsewhere.data"
    os.replace(_shard(newest), outside)
    os.symlink(outside, _shard(newest))  # The same bytes, but outside the directory.
    with pytest.raises(CorruptCheckpointError, match="link out of the checkpoint's directory"):
        CheckpointReader(newest).read_tensors()
    _restart_restores(logdir, second, capsys)


def test_a_shard_linked_inside_the_directory_is_fine(tmp_path):
    _, _, newest = _three_checkpoints(tmp_path)
    os.replace(_shard(newest), tmp_path / "moved.data")
    os.symlink("moved.data", _shard(newest))
    CheckpointReader(newest).verify()


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev_zero", "dev_null"])
@pytest.mark.parametrize("which", ["index", "shard"])
def test_non_regular_files_are_damage(tmp_path, capsys, kind, which):
    _, second, newest = _three_checkpoints(tmp_path)
    path = newest + ".index" if which == "index" else _shard(newest)
    os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    else:
        os.symlink("/dev/zero" if kind == "dev_zero" else "/dev/null", path)
    damage = "not a regular file|link out of the checkpoint's directory"
    with pytest.raises(CorruptCheckpointError, match=damage):
        CheckpointReader(newest).verify()
    out = _restart_restores(logdir=tmp_path, expected=second, capsys=capsys)
    assert os.path.basename(path) in out


def test_a_tensor_larger_than_its_file_is_damage_not_a_shape_mismatch(tmp_path, capsys):
    _, second, newest = _three_checkpoints(tmp_path)
    with open(newest + ".index", "rb") as f:
        manifest = Manifest.from_bytes(f.read())
    name = "model/weight"
    entry = manifest.tensors[name]
    huge = 1 << 40
    tensors = dict(manifest.tensors)
    tensors[name] = dataclasses.replace(
        entry, shape=(huge // 4,), end=entry.begin + huge
    )  # 2**40 bytes of float32.
    shard = manifest.shards[entry.shard]
    shards = list(manifest.shards)
    shards[entry.shard] = dataclasses.replace(shard, size_bytes=shard.data_offset + (1 << 41))
    _rewrite(newest, tensors=tensors, shards=tuple(shards))
    out = _restart_restores(tmp_path, second, capsys)
    assert "is truncated" in out and os.path.basename(_shard(newest)) in out


def test_a_tree_nested_too_deep_is_damage(tmp_path, capsys):
    _, second, newest = _three_checkpoints(tmp_path)
    nested = None
    for _ in range(600):
        nested = [nested]
    _rewrite(newest, tree={"dict": {"a": nested}})  # A correct checksum over a hostile tree.
    with pytest.raises(CorruptCheckpointError, match=f"deeper than {MAX_TREE_DEPTH} levels"):
        CheckpointReader(newest)
    _restart_restores(tmp_path, second, capsys)


def test_json_nested_beyond_the_parser_is_damage(tmp_path, capsys):
    _, second, newest = _three_checkpoints(tmp_path)
    with open(newest + ".index", "w") as f:
        f.write('{"format": "torchsupervisor-checkpoint", "tree": ' + "[" * 100_000)
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        CheckpointReader(newest)
    _restart_restores(tmp_path, second, capsys)


def test_the_deepest_state_allowed_round_trips(tmp_path):
    nested = value = {}
    for _ in range(MAX_STATE_DEPTH - 1):
        value["a"] = {}
        value = value["a"]
    value["a"] = 7
    prefix = Saver().save(Session({"deep": nested}), str(tmp_path / "m"), 1)
    assert CheckpointReader(prefix).read_tree()["deep"] == nested
    value["a"] = {"b": 7}
    with pytest.raises(ValueError, match="nests deeper than"):
        Saver().save(Session({"deep": nested}), str(tmp_path / "m"), 2)


@pytest.mark.parametrize(
    "container",
    [lambda x: [x], lambda x: (x,), lambda x: {"k": x}, lambda x: {1: x}],
    ids=["list", "tuple", "dict", "items"],
)
def test_a_skeleton_no_reader_would_take_is_never_encoded(container):
    """The writers' last guard: ``encode_tree`` refuses the nesting ``check_tree_depth``
    refuses, so no manifest that cannot be read back is committed (a sharded save once
    committed one; the state walks refuse such states first)."""
    deepest = 7
    for _ in range(MAX_TREE_DEPTH):
        deepest = container(deepest)
    check_tree_depth(encode_tree(deepest))  # The deepest that reads back.
    with pytest.raises(ValueError, match=f"deeper than {MAX_TREE_DEPTH} levels"):
        encode_tree(container(deepest))
    with pytest.raises(ManifestError, match=f"deeper than {MAX_TREE_DEPTH} levels"):
        check_tree_depth([encode_tree(deepest)])


def test_a_huge_index_is_not_read(tmp_path, monkeypatch):
    from torchsupervisor.checkpoint import index_file

    _, _, newest = _three_checkpoints(tmp_path)
    monkeypatch.setattr(index_file, "MAX_INDEX_BYTES", 64)
    with pytest.raises(CorruptCheckpointError, match="larger than 64 bytes"):
        CheckpointReader(newest)


def test_damage_the_newest_checkpoint_does_not_read_is_no_alarm(tmp_path, capsys):
    """An incremental checkpoint reads only some tensors of an older shard: damage to the
    others is not its damage (``verify`` used to check every byte of every shard listed)."""
    frozen = torch.nn.Linear(32, 32).requires_grad_(False)
    trained = torch.zeros(8)
    sess = Session({"frozen": frozen, "trained": trained})
    saver = Saver(max_to_keep=5)
    for step in (1, 2, 3):
        trained.add_(1)
        saver.save(sess, str(tmp_path / "model.ckpt"), step)
    newest = str(tmp_path / "model.ckpt-3")
    manifest = CheckpointReader(newest).manifest
    assert len(manifest.shards) == 2  # Its own shard and the full save's.
    (older,) = [s for s in manifest.shards if not s.file.startswith("model.ckpt-3.")]
    older_prefix = str(tmp_path / older.file.split(".data-")[0])
    unused = CheckpointReader(older_prefix).manifest.tensors["trained"]
    with open(tmp_path / older.file, "r+b") as f:  # Flip the bytes of a tensor it does not use.
        f.seek(older.data_offset + unused.begin)
        f.write(b"\xff" * unused.nbytes)
    assert cli_main(["verify", str(tmp_path)]) == 0
    assert "A restart restores model.ckpt-3" in capsys.readouterr().out
    restored = Session({"frozen": torch.nn.Linear(32, 32), "trained": torch.zeros(8)})
    saver.restore(restored, newest)
    assert torch.equal(restored.state["trained"], trained)
