"""Reading checkpoints: TF's reader API, and every kind of damage detected and named."""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import threading

import pytest
import torch

import torchsupervisor.checkpoint.reader as reader_module
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
from torchsupervisor.checkpoint.shard_io import open_shard
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


def _two_checkpoints(directory):
    """Checkpoints at steps 1 and 2 of ``{"w": ..., "global_step": ...}``."""
    gs = GlobalStep()
    state = {"w": torch.arange(300, dtype=torch.float32), "global_step": gs}
    saver = Saver()
    out = []
    for step in (1, 2):
        gs.assign(step)
        state["w"].add_(1)
        out.append(saver.save(Session(state), os.path.join(directory, "m"), global_step=gs))
    return out


def _recover(directory):
    from torchsupervisor import SessionManager

    state = {"w": torch.zeros(300), "global_step": GlobalStep()}
    sess, restored = SessionManager(state=state).recover_session(
        saver=Saver(), checkpoint_dir=directory
    )
    assert restored
    return sess.restored_checkpoint, state


def _without_header_crcs(prefix):
    """Rewrite the manifest as written before it recorded the headers' own CRCs."""
    import crc32c

    from torchsupervisor.checkpoint.manifest_json import canonical as _canonical

    index = pathlib.Path(prefix + ".index")
    body = json.loads(index.read_text())
    body.pop("manifest_crc32c")
    for shard in body["shards"]:
        shard.pop("header_crc32c", None)
    body["manifest_crc32c"] = crc32c.crc32c(_canonical(body))
    index.write_text(json.dumps(body))


@pytest.mark.parametrize("where", ["length field", "json", "padding"])
@pytest.mark.parametrize("header_crc", [True, False], ids=["header_crc", "old_manifest"])
def test_a_damaged_shard_header_fails_the_restore_which_falls_back(
    tmp_path, caplog, where, header_crc
):
    """Every tensor's bytes are intact, but the shard is not: the restore says so and uses
    the previous checkpoint (an old manifest without the header's own CRC: the shard
    checksum, computed from the header and the tensors' CRCs, catches it)."""
    first, second = _two_checkpoints(str(tmp_path))
    if not header_crc:
        _without_header_crcs(second)
    reader = CheckpointReader(second)
    offset = {"length field": 2, "json": 20, "padding": reader.manifest.shards[0].data_offset - 1}
    _flip(_shard(second), offset[where])
    with pytest.raises(CorruptCheckpointError, match="header damaged"):
        reader.verify()
    with pytest.raises(CorruptCheckpointError, match="header damaged") as info:
        reader.read_tree()
    assert info.value.path == _shard(second) and info.value.reason == "header damaged"
    assert torch.equal(reader.get_tensor("w"), torch.arange(300.0) + 2)  # The bytes are fine.
    with caplog.at_level("WARNING", "torchsupervisor"):
        restored, state = _recover(str(tmp_path))
    assert restored == first and state["global_step"].value == 1
    assert torch.equal(state["w"], torch.arange(300.0) + 1)
    assert f"Checkpoint shard {_shard(second)} is corrupt: header damaged" in caplog.text


def test_a_shard_header_that_misdescribes_the_data_is_damaged(checkpoint):
    """A well-formed header rewritten under a manifest without the header's own CRC (as
    written before it was recorded): tensors that do not tile the data area, that are not
    where the manifest reads them, or just other bytes than were written."""
    import struct

    prefix, _ = checkpoint
    reader = CheckpointReader(prefix)
    shard = reader.manifest.shards[0]
    data = pathlib.Path(_shard(prefix)).read_bytes()
    header = json.loads(data[8 : shard.data_offset])

    def rewrite(edit):
        changed = json.loads(json.dumps(header))
        edit(changed)
        text = json.dumps(changed, separators=(",", ":")).encode()
        text += b" " * (shard.data_offset - 8 - len(text))
        pathlib.Path(_shard(prefix)).write_bytes(
            struct.pack("<Q", len(text)) + text + data[shard.data_offset :]
        )
        _without_header_crcs(prefix)

    def shrink_last(h):
        name = max((n for n in h if n != "__metadata__"), key=lambda n: h[n]["data_offsets"][1])
        h[name]["data_offsets"][1] -= 1
        h[name]["shape"] = [0]

    rewrite(shrink_last)
    with pytest.raises(CorruptCheckpointError, match=r"header damaged \(its tensors end at"):
        CheckpointReader(prefix).read_tensors()

    def rename(h):
        h["x"] = h.pop("a")

    rewrite(rename)  # Well-formed, same ranges: only the shard checksum tells.
    with pytest.raises(CorruptCheckpointError, match=r"header damaged \(shard checksum mismatch"):
        CheckpointReader(prefix).read_tensors()

    def split(h):
        begin, end = h["b"]["data_offsets"]
        h["b"] = {"dtype": "I64", "shape": [9], "data_offsets": [begin, end - 8]}
        h["b2"] = {"dtype": "I64", "shape": [1], "data_offsets": [end - 8, end]}

    rewrite(split)
    with pytest.raises(CorruptCheckpointError, match="it does not list the tensor read at"):
        CheckpointReader(prefix).read_tensors()


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

    from torchsupervisor.checkpoint.manifest_json import canonical as _canonical

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


@pytest.fixture(params=["one reader thread", "several reads at once"])
def pipelined(request, monkeypatch):
    """Make every read go by small chunks: in order on the reader thread, or in parallel."""
    from torchsupervisor.checkpoint import shard_io as reader_module
    from torchsupervisor.storage import local

    if request.param == "one reader thread":
        monkeypatch.setattr(local._LocalReadable, "concurrent_reads", 1)
        monkeypatch.setattr(reader_module, "_PIPELINE_MIN_BYTES", 0)
        monkeypatch.setattr(reader_module, "_CHUNK_BYTES", 24)
    else:
        monkeypatch.setattr(reader_module, "_PARALLEL_CHUNK_BYTES", 24)


def test_pipelined_reads_match(checkpoint, pipelined):
    prefix, state = checkpoint
    tensors = CheckpointReader(prefix).read_tensors()
    assert all(torch.equal(tensors[name], value) for name, value in state.items())


def test_pipelined_reads_report_damage_and_truncation(checkpoint, pipelined, monkeypatch):
    prefix, _ = checkpoint
    reader = CheckpointReader(prefix)
    entry = reader.manifest.tensors["a"]
    _flip(_shard(prefix), reader.manifest.shards[0].data_offset + entry.begin + 100)
    with pytest.raises(CorruptCheckpointError, match=r"damaged tensors: a\)"):
        reader.read_tensors()
    size = os.path.getsize(_shard(prefix))
    with open(_shard(prefix), "r+b") as f:  # Shrink after the size check: a read comes short.
        monkeypatch.setattr(reader_module, "open_shard", _shrinking(f, size - 30))
        with pytest.raises(CorruptCheckpointError, match="is truncated"):
            reader.read_tensors()


def _shrinking(handle, new_size):
    def opened(*args, **kwargs):
        f = open_shard(*args, **kwargs)
        handle.truncate(new_size)
        return f

    return opened


def test_an_error_while_checksumming_stops_every_read_before_the_shard_is_closed(
    checkpoint, monkeypatch
):
    import crc32c

    from torchsupervisor.checkpoint import shard_io

    monkeypatch.setattr(shard_io, "_PARALLEL_CHUNK_BYTES", 24)  # Several reads at once.
    prefix, _ = checkpoint
    reader = CheckpointReader(prefix)
    readers_at_close: list[list[str]] = []

    def opened(*args, **kwargs):
        f = open_shard(*args, **kwargs)
        close = f.close

        def closing():
            threads = [t.name for t in threading.enumerate() if "checkpoint-reader" in t.name]
            readers_at_close.append(threads)
            close()

        f.close = closing
        return f

    class Interrupted(Exception):
        pass

    calls = iter(range(1_000))
    checksum = crc32c.crc32c

    def failing(data, value=0):
        if next(calls) == 2:
            raise Interrupted
        return checksum(data, value)

    monkeypatch.setattr(reader_module, "open_shard", opened)
    monkeypatch.setattr(crc32c, "crc32c", failing)
    with pytest.raises(Interrupted):
        reader.read_tensors()
    assert readers_at_close == [[]]


def _resign(prefix, edit):
    """Edit the manifest and recompute its own checksum (an attacker's edit)."""
    import crc32c

    from torchsupervisor.checkpoint.manifest_json import canonical as _canonical

    index = pathlib.Path(prefix + ".index")
    body = json.loads(index.read_text())
    body.pop("manifest_crc32c")
    edit(body)
    body["manifest_crc32c"] = crc32c.crc32c(_canonical(body))
    index.write_text(json.dumps(body))


@pytest.mark.parametrize(
    "field, value, said",
    [
        ("dtype", "I32", "I32 [300]"),  # The same 4 bytes a float, read as integers.
        ("shape", [30, 10], "F32 [30, 10]"),  # The same 300 elements, another shape.
    ],
)
@pytest.mark.parametrize("header_crc", [True, False], ids=["header_crc", "old_manifest"])
def test_a_manifest_that_disagrees_with_the_shards_header_is_damage(
    tmp_path, caplog, field, value, said, header_crc
):
    # The manifest said I32 where the shard's own (checksummed) header says F32: `verify`
    # said ok and the restore reinterpreted the bytes.
    first, second = _two_checkpoints(str(tmp_path))
    if not header_crc:
        _without_header_crcs(second)
    _resign(second, lambda body: body["tensors"]["w"].__setitem__(field, value))
    reader = CheckpointReader(second)
    expected = (
        rf"Checkpoint shard .* is corrupt: the manifest disagrees with the shard's own header "
        rf"\('w' is F32 \[300\] .* there, {re.escape(said)}"
    )
    with pytest.raises(CorruptCheckpointError, match=expected) as info:
        reader.verify()
    assert info.value.reason == "manifest disagrees with the shard"
    with caplog.at_level("WARNING", "torchsupervisor"):
        restored, state = _recover(str(tmp_path))
    assert restored == first and torch.equal(state["w"], torch.arange(300.0) + 1)
