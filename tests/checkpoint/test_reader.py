"""Reading checkpoints: TF's reader API, and every kind of damage detected and named."""

from __future__ import annotations

import json
import os
import pathlib
import random

import pytest
import torch

from torchsupervisor import (
    CheckpointReader,
    GlobalStep,
    NewCheckpointReader,
    Saver,
    Session,
    list_variables,
    load_checkpoint,
    load_variable,
)
from torchsupervisor.errors import CorruptCheckpointError, DataLossError, NotFoundError


@pytest.fixture
def checkpoint(tmp_path):
    state = {
        "a": torch.arange(64, dtype=torch.float32).reshape(8, 8),
        "b": torch.arange(10, dtype=torch.int64),
        "c": torch.tensor([True, False]),
        "d": torch.randn(3, dtype=torch.bfloat16),
        "e": torch.tensor(2.5, dtype=torch.float64),
    }
    prefix = Saver().save(Session(state), str(tmp_path / "model.ckpt"), global_step=9)
    return prefix, state


def _shard(prefix):
    return prefix + ".data-00000-of-00001"


def test_reader_api(checkpoint):
    prefix, state = checkpoint
    reader = NewCheckpointReader(prefix)
    assert reader.global_step == 9
    assert reader.get_variable_to_shape_map() == {
        "a": [8, 8],
        "b": [10],
        "c": [2],
        "d": [3],
        "e": [],
        "global_step": [],  # TF's variable name for the checkpoint's step.
    }
    assert reader.get_variable_to_dtype_map()["d"] is torch.bfloat16
    assert reader.get_variable_to_dtype_map()["global_step"] is torch.int64
    assert reader.has_tensor("global_step")
    step = reader.get_tensor("global_step")
    assert step.dtype is torch.int64 and step.shape == () and step.item() == 9
    assert reader.has_tensor("a") and not reader.has_tensor("zz")
    for name, value in state.items():
        assert torch.equal(reader.get_tensor(name), value), name
    with pytest.raises(NotFoundError, match="Key zz not found in checkpoint"):
        reader.get_tensor("zz")
    reader.verify()


def test_directory_helpers(checkpoint, tmp_path):
    prefix, state = checkpoint
    names = [name for name, _ in list_variables(str(tmp_path))]
    assert names == ["a", "b", "c", "d", "e", "global_step"]
    assert load_variable(str(tmp_path), "global_step:0").item() == 9
    assert dict(list_variables(prefix))["a"] == [8, 8]
    assert torch.equal(load_variable(str(tmp_path), "b:0"), state["b"])
    assert load_checkpoint(str(tmp_path)).prefix == prefix
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="Couldn't find 'checkpoint' file"):
        load_checkpoint(str(empty))


def test_global_step_of_a_state_and_a_tensor_called_global_step(tmp_path):
    # A GlobalStep in the state: its value is the manifest's step, read as TF's variable.
    step = GlobalStep(4)
    prefix = Saver().save(
        Session({"w": torch.ones(2), "global_step": step}), str(tmp_path / "m"), global_step=step
    )
    assert load_variable(prefix, "global_step").item() == 4
    # A real tensor called "global_step" wins; without a step there is no alias.
    own = torch.tensor([7, 7])
    prefix = Saver().save(Session({"global_step": own}), str(tmp_path / "n"), global_step=3)
    assert torch.equal(load_variable(prefix, "global_step"), own)
    prefix = Saver().save(Session({"w": torch.ones(2)}), str(tmp_path / "o"))
    reader = CheckpointReader(prefix)
    assert not reader.has_tensor("global_step")
    assert "global_step" not in reader.get_variable_to_shape_map()
    with pytest.raises(NotFoundError):
        reader.get_tensor("global_step")


def test_missing_checkpoint_uses_tf_text(tmp_path):
    with pytest.raises(
        NotFoundError,
        match="Unsuccessful TensorSliceReader constructor: Failed to find any matching files",
    ):
        CheckpointReader(str(tmp_path / "nothing"))


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_bit_flip_in_tensor_data_names_the_shard_and_tensor(checkpoint):
    prefix, _ = checkpoint
    reader = CheckpointReader(prefix)
    entry = reader.manifest.tensors["b"]
    _flip(_shard(prefix), reader.manifest.shards[0].data_offset + entry.begin + 3)
    with pytest.raises(CorruptCheckpointError) as info:
        reader.read_tensors()
    err = info.value
    assert err.path == _shard(prefix) and err.reason == "checksum mismatch"
    assert "damaged tensors: b" in str(err) and isinstance(err, DataLossError)
    with pytest.raises(CorruptCheckpointError, match="Tensor 'b'"):
        reader.get_tensor("b")
    assert torch.equal(reader.get_tensor("a"), torch.arange(64.0).reshape(8, 8))
    with pytest.raises(CorruptCheckpointError, match="damaged tensors: b"):
        reader.verify()


def test_bit_flip_in_shard_header(checkpoint):
    prefix, state = checkpoint
    _flip(_shard(prefix), 20)
    reader = CheckpointReader(prefix)
    with pytest.raises(CorruptCheckpointError, match="header damaged"):
        reader.verify()
    # A restore reads only the tensor bytes, each verified: the values are intact.
    tree = reader.read_tree()
    assert all(torch.equal(tree[name], value) for name, value in state.items())


def test_truncated_and_missing_shards(checkpoint):
    prefix, _ = checkpoint
    size = os.path.getsize(_shard(prefix))
    os.truncate(_shard(prefix), size - 5)
    with pytest.raises(CorruptCheckpointError, match=r"is truncated: \d+ bytes, expected") as info:
        CheckpointReader(prefix).read_tensors()
    assert info.value.reason == "truncated"
    os.remove(_shard(prefix))
    with pytest.raises(CorruptCheckpointError, match="is missing") as info:
        CheckpointReader(prefix).read_tensors()
    assert info.value.path == _shard(prefix)


def test_damaged_manifest_names_the_index(checkpoint):
    prefix, _ = checkpoint
    index = prefix + ".index"
    path = pathlib.Path(index)
    text = path.read_text()
    path.write_text(text.replace('"global_step": 9', '"global_step": 8'))
    with pytest.raises(CorruptCheckpointError, match="manifest checksum mismatch") as info:
        CheckpointReader(prefix)
    assert info.value.path == index
    path.write_text(text[: len(text) // 2])
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        CheckpointReader(prefix)


def test_random_damage_is_always_reported_never_loaded(checkpoint):
    """Fuzz: random byte edits to the index and the shard never crash or load silently."""
    prefix, state = checkpoint
    files = [prefix + ".index", _shard(prefix)]
    originals = {f: pathlib.Path(f).read_bytes() for f in files}
    rng = random.Random(1234)
    for trial in range(300):
        target = rng.choice(files)
        data = bytearray(originals[target])
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            pos = rng.randrange(len(data))
            if op < 0.6:
                data[pos] ^= 1 << rng.randrange(8)
            elif op < 0.8:
                del data[pos : pos + rng.randint(1, 16)]
            else:
                data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        with open(target, "wb") as f:
            f.write(data)
        try:
            tree = CheckpointReader(prefix).read_tree()
        except CorruptCheckpointError:
            pass
        else:
            # Only a semantically neutral edit (e.g. JSON whitespace) may load; values intact.
            for name, value in state.items():
                assert torch.equal(tree[name], value), (trial, name)
        with open(target, "wb") as f:
            f.write(originals[target])


def test_manifest_pointing_at_the_wrong_bytes_is_rejected(checkpoint):
    import crc32c

    from torchsupervisor.checkpoint.format import _canonical

    prefix, _ = checkpoint
    index = prefix + ".index"
    body = json.loads(pathlib.Path(index).read_text())
    body.pop("manifest_crc32c")
    begin, end = body["tensors"]["a"]["offsets"]
    body["tensors"]["a"]["offsets"] = [begin, end - 4]
    body["tensors"]["a"]["shape"] = [63]
    body["manifest_crc32c"] = crc32c.crc32c(_canonical(body))
    pathlib.Path(index).write_text(json.dumps(body))
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch \(damaged tensors: a\)"):
        CheckpointReader(prefix).read_tensors()


@pytest.fixture
def pipelined(monkeypatch):
    """Make every read go through the reader thread, in small chunks."""
    from torchsupervisor.checkpoint import reader as reader_module

    monkeypatch.setattr(reader_module, "_PIPELINE_MIN_BYTES", 0)
    monkeypatch.setattr(reader_module, "_CHUNK_BYTES", 24)


def test_pipelined_reads_match(checkpoint, pipelined):
    prefix, state = checkpoint
    tensors = CheckpointReader(prefix).read_tensors()
    assert all(torch.equal(tensors[name], value) for name, value in state.items())


def test_pipelined_reads_report_damage_and_truncation(checkpoint, pipelined):
    prefix, _ = checkpoint
    reader = CheckpointReader(prefix)
    entry = reader.manifest.tensors["a"]
    _flip(_shard(prefix), reader.manifest.shards[0].data_offset + entry.begin + 100)
    with pytest.raises(CorruptCheckpointError, match=r"damaged tensors: a\)"):
        reader.read_tensors()
    size = os.path.getsize(_shard(prefix))
    with open(_shard(prefix), "r+b") as f:  # Shrink after the size check: a read comes short.
        reader._open_shard = _shrinking(reader._open_shard, f, size - 30)
        with pytest.raises(CorruptCheckpointError, match="is truncated"):
            reader.read_tensors()


def _shrinking(open_shard, handle, new_size):
    def opened(index):
        f = open_shard(index)
        handle.truncate(new_size)
        return f

    return opened
