"""The manifest and tree encodings, dtype codes and the safetensors header."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch

from torchsupervisor.checkpoint.format import (
    DATA_ALIGNMENT_BYTES,
    RECENT_SHARD_FILES,
    Manifest,
    ManifestError,
    RecentShardFiles,
    ShardEntry,
    TensorEntry,
    dtype_from_code,
    dtype_to_code,
    shard_files,
    signed_json,
)
from torchsupervisor.checkpoint.manifest_json import json_string
from torchsupervisor.checkpoint.shard_header import safetensors_header
from torchsupervisor.core.state import TensorRef
from torchsupervisor.core.tree import decode_tree, encode_tree


def _manifest(**overrides) -> Manifest:
    fields = dict(
        global_step=12,
        wall_time=1234.5,
        tree={"dict": {"w": {"tensor": "w"}}},
        tensors={"w": TensorEntry(0, torch.float32, (2, 3), 0, 24, 77)},
        shards=(ShardEntry("m.ckpt-12.data-00000-of-00001", 88, 64, 99),),
        library_version="0.1.0",
        torch_version="2.13.0",
    )
    fields.update(overrides)
    return Manifest(**fields)


@pytest.mark.parametrize(
    "dtype,code",
    [
        (torch.float64, "F64"),
        (torch.float32, "F32"),
        (torch.float16, "F16"),
        (torch.bfloat16, "BF16"),
        (torch.int64, "I64"),
        (torch.int32, "I32"),
        (torch.int16, "I16"),
        (torch.int8, "I8"),
        (torch.uint8, "U8"),
        (torch.bool, "BOOL"),
        (torch.complex64, "C64"),
        (torch.float8_e4m3fn, "F8_E4M3"),
        (torch.float8_e5m2, "F8_E5M2"),
    ],
)
def test_dtype_codes_round_trip(dtype, code):
    assert dtype_to_code(dtype) == code
    assert dtype_from_code(code) is dtype


def test_unsupported_dtype_is_named():
    with pytest.raises(ValueError, match="complex128"):
        dtype_to_code(torch.complex128)
    with pytest.raises(ManifestError, match="Q7"):
        dtype_from_code("Q7")


def test_tree_round_trip_keeps_types_and_order():
    tree = {
        "model": {"fc.weight": TensorRef("model/fc.weight"), "fc.bias": TensorRef("model/fc.bias")},
        "optimizer": {
            "state": {0: {"step": TensorRef("optimizer/state/0/step")}, 1: {}},
            "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.999), "x": None}],
        },
        "specials": [math.nan, math.inf, -math.inf, 1.0, 2, True, "s", b"\x00\xff"],
        "np": TensorRef("np", ndarray=True),
        "types": (torch.float16, torch.device("cpu")),
        "float_keys": {1.5: "a", None: "b", True: "c"},
    }
    encoded = encode_tree(tree)
    text = json.dumps(encoded, allow_nan=False)  # Pure JSON, no NaN literals.
    seen = []

    def leaf(name, ndarray):
        seen.append((name, ndarray))
        return f"<{name}>"

    decoded = decode_tree(json.loads(text), leaf)
    assert decoded["model"] == {"fc.weight": "<model/fc.weight>", "fc.bias": "<model/fc.bias>"}
    assert list(decoded["model"]) == ["fc.weight", "fc.bias"]
    assert decoded["optimizer"]["state"] == {0: {"step": "<optimizer/state/0/step>"}, 1: {}}
    assert decoded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    specials = decoded["specials"]
    assert math.isnan(specials[0]) and specials[1:4] == [math.inf, -math.inf, 1.0]
    assert specials[4:] == [2, True, "s", b"\x00\xff"]
    assert isinstance(specials[4], int) and specials[5] is True
    assert decoded["types"] == (torch.float16, torch.device("cpu"))
    assert decoded["float_keys"] == {1.5: "a", None: "b", True: "c"}
    assert ("np", True) in seen


@pytest.mark.parametrize(
    "node",
    [
        {"tensor": 3},
        {"dict": [1]},
        {"items": [[1]]},
        {"items": [[[1], 2]]},
        {"float": "big"},
        {"bytes": "!!"},
        {"dtype": "not_a_dtype"},
        {"device": "nowhere:9"},
        {"what": 1},
        {"a": 1, "b": 2},
    ],
)
def test_bad_tree_nodes_raise_manifest_error(node):
    with pytest.raises(ManifestError):
        decode_tree(node, lambda name, nd: None)


def test_encode_rejects_unknown_leaves():
    with pytest.raises(TypeError, match="set"):
        encode_tree({"a": {1, 2}})


def test_manifest_round_trip():
    manifest = _manifest()
    again = Manifest.from_bytes(manifest.to_bytes())
    assert again == manifest


def test_manifest_text_is_line_oriented_json():
    text = _manifest().to_bytes().decode()
    assert json.loads(text)["global_step"] == 12
    assert '  "w": {"shard": 0, "dtype": "F32"' in text


def test_every_byte_of_the_manifest_is_checked():
    data = bytearray(_manifest().to_bytes())
    for i in range(len(data)):
        corrupted = bytearray(data)
        corrupted[i] ^= 0x04
        try:
            parsed = Manifest.from_bytes(bytes(corrupted))
        except ManifestError:
            continue
        # A flip in insignificant whitespace may still parse: it must then be identical.
        assert parsed == _manifest(), f"flip at byte {i} went unnoticed"


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda b: b"not json", "not valid JSON"),
        (lambda b: b"[1, 2]", "not a torchsupervisor"),
        (lambda b: b"\xff\xfe", "not valid JSON"),
        (lambda b: b.replace(b'"format_version": 1', b'"format_version": 2'), "checksum"),
    ],
)
def test_manifest_errors(mutate, match):
    with pytest.raises(ManifestError, match=match):
        Manifest.from_bytes(mutate(_manifest().to_bytes()))


def _resigned(body: dict) -> bytes:
    import crc32c

    from torchsupervisor.checkpoint.manifest_json import canonical as _canonical

    body = dict(body)
    body.pop("manifest_crc32c", None)
    body["manifest_crc32c"] = crc32c.crc32c(_canonical(body))
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda b: b.update(format_version=2), "format_version"),
        (lambda b: b["tensors"]["w"].update(offsets=[0, 20]), "does not fit"),
        (lambda b: b["tensors"]["w"].update(shard=3), "shard 3"),
        (lambda b: b["tensors"]["w"].update(offsets=[64, 88]), "beyond the end"),
        (lambda b: b["tensors"]["w"].update(dtype="X"), "dtype"),
        (lambda b: b["tensors"]["w"].update(shape="2x3"), "list"),
        (lambda b: b["shards"][0].update(size_bytes=-1), "non-negative"),
        (lambda b: b.pop("tree"), "malformed"),
        (lambda b: b.update(global_step=True), "integer"),
    ],
)
def test_semantically_bad_manifests_are_rejected(edit, match):
    body = json.loads(_manifest().to_bytes())
    edit(body)
    with pytest.raises(ManifestError, match=match):
        Manifest.from_bytes(_resigned(body))


def test_shard_files_reads_the_shards_of_a_valid_manifest():
    shards = (
        ShardEntry("m.ckpt-12.data-00000-of-00002", 88, 64, 99),
        ShardEntry("m.ckpt-10.data-00001-of-00002", 88, 64, 98),
    )
    data = _manifest(shards=shards).to_bytes()
    expected = ("m.ckpt-12.data-00000-of-00002", "m.ckpt-10.data-00001-of-00002")
    assert RECENT_SHARD_FILES.get(data) == expected  # As signed by to_bytes.
    assert shard_files(data) == expected
    RECENT_SHARD_FILES.clear()
    assert shard_files(bytes(bytearray(data))) == expected  # Parsed and checked.
    assert shard_files(data) == expected  # As parsed.


def test_shard_files_of_a_sharded_manifest_as_signed_and_as_parsed():
    from torchsupervisor.checkpoint.sharded.metadata import (
        ChunkEntry,
        ShardedManifest,
        ShardedTensorEntry,
    )

    entry = TensorEntry(shard=1, dtype=torch.float32, shape=(2,), begin=0, end=8, crc32c=1)
    manifest = ShardedManifest(
        global_step=3,
        wall_time=1.5,
        tree={"dict": {"w": {"tensor": "w"}}},
        tensors={"w/0": entry.with_fields(shard=0), "w/2": entry},
        shards=(
            ShardEntry("m.ckpt-3.data-00000-of-00002", 72, 64, 9),
            ShardEntry("m.ckpt-3.data-00001-of-00002", 72, 64, 8),
        ),
        library_version="x",
        torch_version="y",
        world_size=2,
        sharded_tensors={
            "w": ShardedTensorEntry(
                torch.float32, (4,), (ChunkEntry((0,), (2,), "w/0"), ChunkEntry((2,), (2,), "w/2"))
            )
        },
    )
    data = manifest.to_bytes()
    signed = RECENT_SHARD_FILES.get(data)
    RECENT_SHARD_FILES.clear()
    assert shard_files(data) == signed == tuple(s.file for s in manifest.shards)


def test_shard_files_of_damaged_bytes_are_never_remembered_ones():
    data = _manifest().to_bytes()
    assert shard_files(data) == ("m.ckpt-12.data-00000-of-00001",)
    damaged = data.replace(b"m.ckpt-12.data", b"m.ckpt-13.data")
    with pytest.raises(ManifestError, match="checksum"):
        shard_files(damaged)
    bad = _manifest(shards=(ShardEntry("../elsewhere", 88, 64, 99),)).to_bytes()
    with pytest.raises(ManifestError, match="plain file name"):  # Signed, not remembered.
        shard_files(bad)


def test_remembered_shard_files_are_bounded_in_count_and_bytes():
    recent = RecentShardFiles(max_entries=3, max_bytes=100)
    for i in range(5):
        recent.put(b"%d" % i * 10, (str(i),))
    assert len(recent) == 3
    assert recent.get(b"0" * 10) is None and recent.get(b"4" * 10) == ("4",)
    recent.put(b"x" * 90, ("x",))  # 120 bytes with the others: the oldest go, to 100.
    assert len(recent) == 2 and recent.get(b"3" * 10) is None
    assert recent.get(b"4" * 10) == ("4",) and recent.get(b"x" * 90) == ("x",)
    recent.put(b"y" * 101, ("y",))  # Larger than the bound: not kept.
    assert recent.get(b"y" * 101) is None
    recent.put(b"z", None)  # Nothing to remember.
    assert recent.get(b"z") is None


def test_remembered_shard_files_are_only_for_the_very_bytes(monkeypatch):
    from torchsupervisor.checkpoint import format as fmt

    recent = RecentShardFiles(max_entries=3, max_bytes=100)
    recent.put(b"abcd", ("a",))
    assert recent.get(bytearray(b"abcd")) == ("a",) and recent.get(memoryview(b"abcd")) == ("a",)
    assert recent.get(b"abce") is None and recent.get(b"abc") is None
    # Two texts of one length and CRC (a collision, forced here): never taken for each other;
    # the newer one is kept.
    monkeypatch.setattr(fmt.crc32c, "crc32c", lambda data: 7)
    recent.put(b"wxyz", ("w",))
    assert recent.get(b"abcd") is None and recent.get(b"wxyz") == ("w",) and len(recent) == 2
    assert recent.get(b"efgh") is None


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda b: b"not json", "not valid JSON"),
        (lambda b: b"[1, 2]", "not a torchsupervisor"),
        (lambda b: b.replace(b"m.ckpt-12.data", b"m.ckpt-13.data"), "checksum"),
    ],
)
def test_shard_files_checks_the_checksum_and_format(mutate, match):
    with pytest.raises(ManifestError, match=match):
        shard_files(mutate(_manifest().to_bytes()))


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda b: b.update(format_version=2), "format_version"),
        (lambda b: b["shards"][0].update(file="../elsewhere"), "plain file name"),
        (lambda b: b["shards"][0].pop("file"), "malformed"),
        (lambda b: b.update(shards={"file": "x"}), "list"),
        (lambda b: b.pop("shards"), "malformed"),
    ],
)
def test_shard_files_rejects_bad_shard_lists(edit, match):
    body = json.loads(_manifest().to_bytes())
    edit(body)
    with pytest.raises(ManifestError, match=match):
        shard_files(_resigned(body))


def test_shard_files_does_not_check_the_tensor_table():
    # Retention counts the references of such a manifest (it keeps more, never less).
    body = json.loads(_manifest().to_bytes())
    body["tensors"]["w"].update(shard=3)
    assert shard_files(_resigned(body)) == ("m.ckpt-12.data-00000-of-00001",)


def test_safetensors_header_is_padded_and_valid_json():
    entries = [
        ("a", TensorEntry(0, torch.float64, (2,), 0, 16)),
        ("b", TensorEntry(0, torch.uint8, (3,), 16, 19)),
    ]
    header = safetensors_header(entries)
    assert len(header) % DATA_ALIGNMENT_BYTES == 0
    (length,) = struct.unpack("<Q", header[:8])
    assert length == len(header) - 8
    parsed = json.loads(header[8:])
    assert parsed["a"] == {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}
    assert parsed["__metadata__"] == {"format": "pt"}


def test_tensor_entry_with_fields_changes_only_the_given_fields():
    entry = TensorEntry(shard=1, dtype=torch.float32, shape=(2, 3), begin=8, end=32, crc32c=7)
    assert entry.with_fields(crc32c=9) == TensorEntry(1, torch.float32, (2, 3), 8, 32, 9)
    assert entry.with_fields(shard=0, begin=0, end=24) == TensorEntry(
        0, torch.float32, (2, 3), 0, 24, 7
    )
    assert entry.with_fields() == entry


_ODD_NAMES = ["w", 'q"uote\\back', "line\nfeed\x00nul", "é😀\u2028", "a" * 300]


@pytest.mark.parametrize("name", _ODD_NAMES)
@pytest.mark.parametrize("shape,crc", [((2, 3), 7), ((), None), ((0,), 2**32 - 1), ((1,) * 9, 0)])
def test_encoded_items_are_what_json_writes(name, shape, crc):
    from torchsupervisor.checkpoint.format import shard_item, tensors_field
    from torchsupervisor.checkpoint.manifest_json import CANONICAL_ENCODER as _CANONICAL_ENCODER
    from torchsupervisor.checkpoint.manifest_json import ITEM_ENCODER as _ITEM_ENCODER

    entry = TensorEntry(
        shard=3, dtype=torch.bfloat16, shape=shape, begin=2**40, end=2**40 + 6, crc32c=crc
    )
    expected = {
        "shard": 3,
        "dtype": "BF16",
        "shape": list(shape),
        "offsets": [2**40, 2**40 + 6],
        "crc32c": crc,
    }
    for header in (None, 5):
        shard = ShardEntry(name, 2**50, 64, 2**31, header)
        want = {"file": name, "size_bytes": 2**50, "data_offset": 64, "crc32c": 2**31}
        if header is not None:
            want["header_crc32c"] = header
        item = shard_item(shard)
        assert item.text == _ITEM_ENCODER.encode(want)
        assert item.canonical == _CANONICAL_ENCODER.encode(want)
    for _ in range(2):  # Made, then taken from the recent tables' texts.
        field = tensors_field({name: entry})
        assert field.text == f"  {json_string(name)}: {_ITEM_ENCODER.encode(expected)}"
        assert field.canonical == f"{{{json_string(name)}:{_CANONICAL_ENCODER.encode(expected)}}}"
    # A whole manifest: the text parses to the same values and its checksum holds.
    size = math.prod(shape) * 2
    stored = TensorEntry(
        shard=0, dtype=torch.bfloat16, shape=shape, begin=0, end=size, crc32c=crc or 0
    )
    shards = (ShardEntry("m.ckpt-12.data-00000-of-00001", 64 + size, 64, 99),)
    data = _manifest(tensors={name: stored}, shards=shards).to_bytes()
    stored_value = {**expected, "shard": 0, "offsets": [0, size], "crc32c": crc or 0}
    assert json.loads(data)["tensors"] == {name: stored_value}
    assert Manifest.from_bytes(data).tensors == {name: stored}


def test_encoded_sharded_items_are_what_json_writes():
    from torchsupervisor.checkpoint.manifest_json import CANONICAL_ENCODER as _CANONICAL_ENCODER
    from torchsupervisor.checkpoint.manifest_json import ITEM_ENCODER as _ITEM_ENCODER
    from torchsupervisor.checkpoint.sharded.metadata import (
        ChunkEntry,
        ShardedTensorEntry,
        sharded_item,
    )

    for name in _ODD_NAMES:
        entry = ShardedTensorEntry(
            torch.float16,
            (7, 16),
            (ChunkEntry((0, 0), (4, 16), name), ChunkEntry((4, 0), (3, 16), name + "x")),
        )
        value = {
            "dtype": "F16",
            "shape": [7, 16],
            "chunks": [
                {"offsets": [0, 0], "sizes": [4, 16], "entry": name},
                {"offsets": [4, 0], "sizes": [3, 16], "entry": name + "x"},
            ],
        }
        item = sharded_item(entry)
        assert item.text == _ITEM_ENCODER.encode(value)
        assert item.canonical == _CANONICAL_ENCODER.encode(value)


def test_encoded_items_refuse_what_json_would_write_otherwise():
    from torchsupervisor.checkpoint.manifest_json import EncodedItem

    entry = TensorEntry(shard=0, dtype=torch.float32, shape=(2.5,), begin=0, end=8, crc32c=1)
    with pytest.raises(ValueError):  # A float where an integer belongs is not written.
        _manifest(tensors={"w": entry}).to_bytes()
    with pytest.raises(TypeError, match="not JSON serializable"):  # Only in expanded fields.
        signed_json({"format": "x", "other": [EncodedItem("1", "1")]}, expanded=())


def test_remembered_tensor_entry_texts_are_bounded_and_keyed_by_every_other_field(monkeypatch):
    from torchsupervisor.checkpoint import tensor_table as fmt
    from torchsupervisor.checkpoint.manifest_json import ITEM_ENCODER

    monkeypatch.setattr(fmt, "MAX_TENSOR_ITEM_PARTS", 2)
    monkeypatch.setattr(fmt, "TENSOR_ITEM_PARTS", {})
    entries = [TensorEntry(0, torch.float32, (2,), 8 * i, 8 * i + 8, i) for i in range(3)]
    entries.append(entries[0].with_fields(crc32c=77))  # Same layout, another CRC.
    for e in entries:
        value = {"shard": 0, "dtype": "F32", "shape": [2], "offsets": [e.begin, e.end]}
        head, _ = fmt.item_parts(fmt.entry_layout(e))
        assert f"{head}{e.crc32c}}}" == ITEM_ENCODER.encode({**value, "crc32c": e.crc32c})
        assert len(fmt.TENSOR_ITEM_PARTS) <= 2


def _plain_signed(manifest: Manifest) -> bytes:
    """What ``json`` itself writes for ``manifest``: its tensor table as plain JSON values."""
    body = manifest.body()
    body["tensors"] = {
        name: {
            "shard": e.shard,
            "dtype": dtype_to_code(e.dtype),
            "shape": list(e.shape),
            "offsets": [e.begin, e.end],
            "crc32c": e.crc32c,
        }
        for name, e in manifest.tensors.items()
    }
    return signed_json(body)


def test_a_tensor_table_text_is_reused_only_for_the_same_names_and_entries():
    # Names out of order (a save's table is in shard order, the checksum's in name order).
    names = ["b", "a/2", "a/10", "c#1", "é"]
    shards = (ShardEntry("m.ckpt-1.data-00000-of-00001", 64 + 5 * 40, 64, 1),)

    def table(crcs, shape=(10,)):
        return {
            n: TensorEntry(0, torch.float32, shape, 40 * i, 40 * i + 40, crc)
            for i, (n, crc) in enumerate(zip(names, crcs))
        }

    tables = [
        table([1, 2, 3, 4, 5]),
        table([9, 8, 7, 6, 2**32 - 1]),  # The same layout, other checksums.
        table([1, 2, 3, 4, 5], shape=(2, 5)),  # Another shape: another text.
        {n: e for n, e in reversed(table([1, 2, 3, 4, 5]).items())},  # Another order.
        dict(list(table([1, 2, 3, 4, 5]).items())[:4]),  # One tensor fewer.
    ]
    for tensors in tables + tables:
        manifest = _manifest(tensors=tensors, shards=shards)
        data = manifest.to_bytes()
        assert data == _plain_signed(manifest)
        assert Manifest.from_bytes(data).tensors == tensors


def test_a_sharded_layout_text_is_reused_only_for_the_very_same_layout():
    from torchsupervisor.checkpoint.sharded.metadata import (
        ChunkEntry,
        ShardedManifest,
        ShardedTensorEntry,
    )

    def manifest(split):
        chunks = (ChunkEntry((0,), (split,), "w/0"), ChunkEntry((split,), (4 - split,), "w/2"))
        sizes = (split, 4 - split)
        return ShardedManifest(
            global_step=3,
            wall_time=1.5,
            tree={"dict": {"w": {"tensor": "w"}}},
            tensors={
                "w/0": TensorEntry(0, torch.float32, (sizes[0],), 0, 4 * sizes[0], 1),
                "w/2": TensorEntry(1, torch.float32, (sizes[1],), 0, 4 * sizes[1], 1),
            },
            shards=(
                ShardEntry("m.ckpt-3.data-00000-of-00002", 64 + 4 * sizes[0], 64, 9),
                ShardEntry("m.ckpt-3.data-00001-of-00002", 64 + 4 * sizes[1], 64, 8),
            ),
            library_version="x",
            torch_version="y",
            world_size=2,
            sharded_tensors={"w": ShardedTensorEntry(torch.float32, (4,), chunks)},
        )

    for split in (2, 1, 1, 3, 2):  # Each layout its own mapping; the same one twice in a row.
        written = manifest(split)
        read = ShardedManifest.from_bytes(written.to_bytes())
        assert read.sharded_tensors == written.sharded_tensors
        assert read.to_bytes() == written.to_bytes()


def test_kept_tensor_table_texts_are_bounded_in_count_and_entries(monkeypatch):
    from torchsupervisor.checkpoint import tensor_table as fmt

    monkeypatch.setattr(fmt, "RECENT_TENSORS_TEXTS", [])
    monkeypatch.setattr(fmt, "MAX_TENSORS_TEXT_ENTRIES", 5)

    def table(n, tag):
        return {
            f"{tag}{i}": TensorEntry(0, torch.float32, (1,), 4 * i, 4 * i + 4, i) for i in range(n)
        }

    for tag in "abcdef":
        fmt.tensors_field(table(2, tag))
    assert [t.names[0] for t in fmt.RECENT_TENSORS_TEXTS] == ["f0", "e0"]  # 4 entries.
    fmt.tensors_field(table(7, "g"))  # Larger than the bound alone: kept, alone.
    assert [t.names[0] for t in fmt.RECENT_TENSORS_TEXTS] == ["g0"]
    monkeypatch.setattr(fmt, "MAX_TENSORS_TEXT_ENTRIES", 1 << 17)
    for tag in "hijkl":
        fmt.tensors_field(table(2, tag))
    assert len(fmt.RECENT_TENSORS_TEXTS) == fmt.MAX_TENSORS_TEXTS
