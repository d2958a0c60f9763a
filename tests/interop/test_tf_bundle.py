"""TF 1 checkpoints read without TensorFlow: the committed fixtures (made by TensorFlow, see
``tests/fixtures/tf1/make_fixtures.py``) bitwise as TensorFlow read them, every damage refused,
hostile indexes refused, and a TF 1 model ported to torch through a name map."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil

import pytest
import torch
from repo_paths import repo

import torchsupervisor as ts
from torchsupervisor.errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    NotFoundError,
    UnimplementedError,
)
from torchsupervisor.interop import (
    TFBundleReader,
    conv2d_kernel,
    dense_kernel,
    restore_tf_checkpoint,
)
from torchsupervisor.interop.tf_records import BundleEntryProto, BundleHeaderProto, slice_key

FIXTURES = repo("tests", "fixtures", "tf1")
with open(os.path.join(FIXTURES, "expected.json")) as _f:
    EXPECTED = json.load(_f)
_spec = importlib.util.spec_from_file_location(
    "table_writer", os.path.join(FIXTURES, "table_writer.py")
)
table_writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table_writer)


def _flat(value):
    if isinstance(value, bytes):
        return [value]
    return [x for item in value for x in _flat(item)]


def _same(value, expected) -> bool:
    if expected["dtype"] == "string":
        return _flat(value) == [base64.b64decode(e) for e in expected["data"]]
    raw = base64.b64decode(expected["data"])
    return (
        list(value.shape) == expected["shape"]
        and value.reshape(-1).view(torch.uint8).numpy().tobytes() == raw
    )


@pytest.mark.parametrize("bundle", sorted(EXPECTED))
def test_every_tensor_is_bitwise_what_tensorflow_read(bundle):
    expected = EXPECTED[bundle]
    reader = ts.NewCheckpointReader(os.path.join(FIXTURES, bundle))
    assert isinstance(reader, TFBundleReader)
    shapes = reader.get_variable_to_shape_map()
    assert shapes == {name: t["shape"] for name, t in expected.items()}
    assert reader.get_variable_to_tf_dtype_map() == {n: t["dtype"] for n, t in expected.items()}
    mismatched = [name for name, t in expected.items() if not _same(reader.get_tensor(name), t)]
    assert mismatched == []
    every = reader.read_tensors()
    assert sorted(every) == sorted(expected)
    reader.verify()


def test_dtypes_strings_slices_and_the_reader_api():
    prefix = os.path.join(FIXTURES, "dtypes", "bundle")
    reader = ts.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    assert dtypes["bfloat16"] == torch.bfloat16 and dtypes["uint64"] == torch.uint64
    assert dtypes["complex128"] == torch.complex128 and dtypes["strings"] is bytes
    assert reader.get_tensor("string_scalar") == b"hello, bundle"
    assert reader.get_tensor("strings") == [b"", b"\xff\x00\xfe not utf-8", b"x" * 200]
    assert reader.get_tensor("uint64").tolist() == [0, 2**64 - 1]
    assert reader.get_tensor("empty").shape == (0, 3)
    assert torch.equal(reader.get_tensor("sliced"), torch.arange(20.0).reshape(5, 4))
    assert reader.global_step == 7 and reader.has_tensor("scope/with/slashes")
    assert ts.load_variable(prefix, "scalar:0").item() == 3.25
    with pytest.raises(NotFoundError, match="Key nothing not found in checkpoint"):
        reader.get_tensor("nothing")
    convnet = os.path.join(FIXTURES, "convnet")
    assert ts.latest_checkpoint(convnet) == os.path.join(convnet, "model.ckpt-3")
    assert ("conv1/kernel", [3, 3, 1, 4]) in ts.list_variables(convnet)
    sharded = ts.NewCheckpointReader(os.path.join(FIXTURES, "sharded", "model.ckpt"))
    assert sharded.num_shards == 2 and len({t["shard"] for t in sharded.describe()}) == 2
    parts = ts.NewCheckpointReader(os.path.join(FIXTURES, "partitioned", "model.ckpt"))
    assert parts.is_sharded and {t["name"]: t["slices"] for t in parts.describe()} == {
        "embedding": 3, "tall": 3, "whole": 0, "wide": 4,
    }  # fmt: skip
    # Our own reader points at the right door.
    with pytest.raises(CorruptCheckpointError, match="TF 1 checkpoint"):
        ts.CheckpointReader(prefix)


def test_slice_keys_are_tensorflows():
    # The partitioned fixture's parts are found by these keys (parts at rows 100 and 200:
    # two-byte numbers); here the layout: 0, the name (0x00 and 0xff escaped, then 00 01),
    # the rank, then each dimension's start and length (-1: the whole dimension).
    assert slice_key("a", [(0, 2), (0, -1)]) == b"\x00a\x00\x01\x01\x02\x80\x82\x80\x7f"
    assert slice_key("t", [(100, 100)])[-4:] == bytes([0xC0, 0x64, 0xC0, 0x64])
    assert slice_key("x\x00", [])[:6] == b"\x00x\x00\xff\x00\x01"


def _copy(tmp_path, bundle: str) -> str:
    directory = os.path.dirname(os.path.join(FIXTURES, bundle))
    target = tmp_path / os.path.basename(directory)
    shutil.copytree(directory, target)
    return str(target / os.path.basename(bundle))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_every_byte_of_the_data_is_checked(tmp_path):
    prefix = _copy(tmp_path, "dtypes/bundle")
    data = prefix + ".data-00000-of-00001"
    size = os.path.getsize(data)
    missed = []
    for offset in range(size):
        _flip(data, offset)
        try:
            TFBundleReader(prefix).verify()
        except CorruptCheckpointError as e:
            assert data in str(e)
        else:
            missed.append(offset)
        _flip(data, offset)
    assert missed == []


@pytest.mark.parametrize("bundle", ["dtypes/bundle", "partitioned/model.ckpt"])
def test_every_byte_of_the_index_is_checked(tmp_path, bundle):
    prefix = _copy(tmp_path, bundle)
    index = prefix + ".index"
    missed = []
    for offset in range(os.path.getsize(index)):
        _flip(index, offset)
        try:
            ts.NewCheckpointReader(prefix).verify()
        except (CorruptCheckpointError, UnimplementedError) as e:
            assert index in str(e)
        else:
            missed.append(offset)
        _flip(index, offset)
    assert missed == []


def test_truncated_missing_and_big_endian_files_are_refused(tmp_path):
    prefix = _copy(tmp_path, "sharded/model.ckpt")
    second = prefix + ".data-00001-of-00002"
    with open(second, "r+b") as f:
        f.truncate(os.path.getsize(second) - 1)
    reader = TFBundleReader(prefix)
    assert reader.get_tensor("a").shape == (3, 5)  # In the first data file: intact.
    with pytest.raises(CorruptCheckpointError, match=r"truncated") as e:
        reader.verify()
    assert second in str(e.value)
    os.remove(second)
    with pytest.raises(CorruptCheckpointError, match=r"is missing"):
        reader.verify()
    index = prefix + ".index"
    with open(index, "r+b") as f:
        f.truncate(os.path.getsize(index) - 3)
    with pytest.raises(CorruptCheckpointError, match=index):
        ts.NewCheckpointReader(prefix)
    with pytest.raises(UnimplementedError, match="big-endian") as e:
        ts.NewCheckpointReader(os.path.join(FIXTURES, "big_endian", "bundle"))
    assert "big_endian/bundle" in str(e.value)


def _entry(dtype: int, shape: list[int], offset: int = 0, size: int = 0, crc: int = 0, slices=()):
    entry = BundleEntryProto(dtype=dtype, shard_id=0, offset=offset, size=size, crc32c=crc)
    entry.shape.dim.add().size = 0
    del entry.shape.dim[:]
    for d in shape:
        entry.shape.dim.add().size = d
    for extents in slices:
        proto = entry.slices.add()
        for start, length in extents:
            extent = proto.extent.add(start=start)
            if length >= 0:
                extent.length = length
    return entry.SerializeToString()


def _bundle(tmp_path, entries: dict[bytes, bytes], data: bytes, header=None) -> str:
    prefix = str(tmp_path / "crafted")
    head = header or BundleHeaderProto(num_shards=1)
    if header is None:
        head.version.producer = 1
    rows = [(b"", head.SerializeToString()), *sorted(entries.items())]
    table_writer.write_table(prefix + ".index", rows)
    with open(prefix + ".data-00000-of-00001", "wb") as f:
        f.write(data)
    return prefix


def _masked(data: bytes) -> int:
    return table_writer.masked_crc(data)


def test_hostile_indexes_are_refused_before_anything_is_allocated(tmp_path):
    payload = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    good = _entry(1, [4], size=16, crc=_masked(payload))
    assert TFBundleReader(_bundle(tmp_path, {b"w": good}, payload)).get_tensor("w").tolist() == [
        0.0, 1.0, 2.0, 3.0,
    ]  # fmt: skip
    cases = {
        "a size that does not match the shape": _entry(1, [2**40], size=16, crc=_masked(payload)),
        "an unknown dtype": _entry(99, [4], size=16),
        "a negative dimension": _entry(1, [-4], size=16),
        "data past the file's end": _entry(1, [8], size=32, crc=_masked(payload)),
        "a data file that does not exist": BundleEntryProto(
            dtype=1, shard_id=3
        ).SerializeToString(),
        "a missing slice": _entry(1, [4], slices=[[(0, 2)]]),
        "a slice out of the shape": _entry(1, [4], slices=[[(3, 2)]]),
    }
    for why, entry in cases.items():
        prefix = _bundle(tmp_path, {b"w": entry}, payload)
        with pytest.raises(CorruptCheckpointError, match="crafted"):
            TFBundleReader(prefix).verify()
        assert why  # The case's name says what it is.
    # Overlapping slices as many elements as the tensor: refused (they must tile it exactly).
    half = payload[:8]
    slices = {
        b"w": _entry(1, [4], slices=[[(0, 2)], [(1, 2)]]),
        slice_key("w", [(0, 2)]): _entry(1, [2], 0, 8, _masked(half)),
        slice_key("w", [(1, 2)]): _entry(1, [2], 0, 8, _masked(half)),
    }
    with pytest.raises(CorruptCheckpointError, match="do not tile it"):
        TFBundleReader(_bundle(tmp_path, slices, half)).get_tensor("w")
    header = BundleHeaderProto(num_shards=1)
    header.version.min_consumer = 2
    with pytest.raises(UnimplementedError, match="bundle version 2"):
        TFBundleReader(_bundle(tmp_path, {b"w": good}, payload, header))
    # A string tensor whose lengths claim more than its bytes.
    strings = b"\x05\x05" + (0).to_bytes(4, "little") + b"ab"
    prefix = _bundle(tmp_path, {b"s": _entry(7, [2], size=len(strings))}, strings)
    with pytest.raises(CorruptCheckpointError, match="string lengths"):
        TFBundleReader(prefix).get_tensor("s")


class Ported(torch.nn.Module):
    """The fixture's TF 1 model in torch: conv 3x3 SAME, relu, flatten in TF's NHWC order,
    dense."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.fc = torch.nn.Linear(256, 3)

    def forward(self, x_nhwc: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x_nhwc.permute(0, 3, 1, 2)))
        return self.fc(h.permute(0, 2, 3, 1).flatten(1))


NAME_MAP = {
    "conv1/kernel": ("model/conv1.weight", conv2d_kernel),
    "conv1/bias": "model/conv1.bias",
    "dense/kernel": ("model/fc.weight", dense_kernel),
    "dense/bias": "model/fc.bias",
}


def test_a_tf1_model_restored_into_torch_computes_what_tensorflow_computed():
    with open(os.path.join(FIXTURES, "convnet.json")) as f:
        io = json.load(f)
    x = torch.frombuffer(bytearray(base64.b64decode(io["input"])), dtype=torch.float32)
    logits = torch.frombuffer(bytearray(base64.b64decode(io["logits"])), dtype=torch.float32)
    model, step = Ported(), ts.GlobalStep()
    report = restore_tf_checkpoint(
        {"model": model}, os.path.join(FIXTURES, "convnet"), NAME_MAP, global_step=step
    )
    assert step.value == 3 and report.global_step == 3
    assert [tf for tf, _ in report.restored] == sorted(NAME_MAP)
    assert "conv1/kernel/Adam" in report.unused and "beta1_power" in report.unused
    assert "global_step" not in report.unused and report.unmapped == []
    with torch.no_grad():
        out = model(x.reshape(io["input_shape"]))
    torch.testing.assert_close(out, logits.reshape(io["logits_shape"]), rtol=1e-5, atol=1e-5)


def test_a_name_map_that_does_not_fit_changes_nothing():
    model = Ported()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    convnet = os.path.join(FIXTURES, "convnet")
    wrong = dict(NAME_MAP, **{"conv1/kernel": "model/conv1.weight"})  # No transform: HWIO.
    with pytest.raises(InvalidArgumentError, match=r"\(3, 3, 1, 4\).*\(4, 1, 3, 3\)"):
        restore_tf_checkpoint({"model": model}, convnet, wrong)
    with pytest.raises(NotFoundError, match="model/nothing"):
        restore_tf_checkpoint({"model": model}, convnet, {"conv1/bias": "model/nothing"})
    with pytest.raises(NotFoundError, match="does not hold"):
        restore_tf_checkpoint({"model": model}, convnet, {"conv9/bias": "model/conv1.bias"})
    with pytest.raises(NotFoundError, match="receive nothing"):
        restore_tf_checkpoint({"model": model}, convnet, {"dense/bias": "model/fc.bias"},
                              strict=True)  # fmt: skip
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    # A callable map: everything under conv1/ and dense/ by rule, the rest unused.
    def rule(name: str):
        return NAME_MAP.get(name)

    report = restore_tf_checkpoint({"model": model}, convnet, rule)
    assert len(report.restored) == 4 and "global_step" in report.unused


def test_inspect_and_ls_understand_tf_bundles(tmp_path, capsys):
    from torchsupervisor.cli import main

    convnet = os.path.join(FIXTURES, "convnet")
    assert main(["inspect", convnet]) == 0
    out = capsys.readouterr().out
    assert "TF 1 checkpoint" in out and "conv1/kernel" in out and "[3, 3, 1, 4]" in out
    assert main(["inspect", os.path.join(FIXTURES, "dtypes", "bundle"), "--tensor", "strings"]) == 0
    assert "not utf-8" in capsys.readouterr().out
    assert main(["inspect", convnet, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["global_step"] == 3 and listing["tensors"]["dense/bias"]["dtype"] == "float32"
    assert main(["ls", convnet]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "TF 1 checkpoint" in out and "never by a restart" in out
    damaged = _copy(tmp_path, "convnet/model.ckpt-3")
    _flip(damaged + ".data-00000-of-00001", 100)
    main(["ls", os.path.dirname(damaged)])
    assert "CORRUPT" in capsys.readouterr().out


def test_a_partitioned_tensor_claiming_terabytes_is_refused_before_allocating(tmp_path):
    payload = torch.zeros(2).numpy().tobytes()
    entries = {
        b"w": _entry(1, [2**40], slices=[[(0, 2)]]),
        slice_key("w", [(0, 2)]): _entry(1, [2], 0, 8, _masked(payload)),
    }
    with pytest.raises(CorruptCheckpointError, match="hold 2 elements"):
        TFBundleReader(_bundle(tmp_path, entries, payload)).get_tensor("w")


def test_a_tf1_checkpoint_in_a_bucket_reads_the_same(s3_url):
    from torchsupervisor.storage import storage_for

    bucket = storage_for(s3_url)
    directory = os.path.join(FIXTURES, "partitioned")
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            bucket.put(f"{s3_url}/tf/{name}", [f.read()])
    reader = ts.NewCheckpointReader(f"{s3_url}/tf/model.ckpt")
    expected = EXPECTED["partitioned/model.ckpt"]
    assert [n for n, t in expected.items() if not _same(reader.get_tensor(n), t)] == []
