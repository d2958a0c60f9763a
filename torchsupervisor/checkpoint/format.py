"""The on-disk checkpoint format: safetensors shards plus a JSON manifest (``P.index``).

A checkpoint with prefix ``P`` is:

* ``P.data-00000-of-0000N`` ... : N shards, each a safetensors file (8-byte little-endian header
  length, a JSON header, then the tensor bytes with no gaps). Our writer pads the header with
  spaces so that the data starts on a 64-byte boundary and puts first the tensors whose size is
  a multiple of 64 bytes, then the others by decreasing item size (by name within each), so
  every tensor is aligned for its dtype and the large ones on 64-byte lines. Any safetensors
  reader can open a shard.
* ``P.index``: the manifest, JSON, written last. It holds the format version, the global step,
  the wall time, library and torch versions, the encoded state tree (non-tensor leaves live
  here), for every tensor its shard, dtype, shape, byte range and CRC-32C (and for the larger
  ones the CRC-32C of each block of rows: ``row_blocks.py``), and for every shard its file
  name, size and checksum. The manifest carries a CRC-32C of its own canonical body.

The checksum of a shard covers every byte of the file in one CRC pass over the data: it is the
CRC-32C of the header bytes (the 8-byte length and the padded JSON) followed by the CRC-32C of
each tensor's bytes, as 4 little-endian bytes, in the order of their data offsets
(``shard_header.shard_checksum``; the header itself: ``shard_header.safetensors_header``).
A plain CRC of the whole file would cost the writer a second pass over the data, since the
per-tensor CRCs are needed anyway (a restore verifies each tensor it reads, and an
incremental checkpoint reuses single tensors of older shards). The manifest also records
the CRC-32C of the header alone (``header_crc32c``): a restore checks it for every shard it
reads from, including older shards of which an incremental checkpoint reads only some tensors.

Tree encoding (JSON): ``None``, bools, ints, finite floats, strings and lists are themselves;
everything else is an object with exactly one tag key: ``{"tensor": name}``,
``{"ndarray": name}``, ``{"dict": {...}}`` (all keys strings), ``{"items": [[key, value], ...]}``
(other keys, order kept), ``{"tuple": [...]}``, ``{"float": "nan" | "inf" | "-inf"}``,
``{"bytes": base64}``, ``{"dtype": "float32"}``, ``{"device": "cpu"}``.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import crc32c

from torchsupervisor.checkpoint.entries import (
    ShardEntry,
    TensorEntry,
    data_filename,
    dtype_from_code,
    dtype_to_code,
)
from torchsupervisor.checkpoint.manifest_json import (
    EncodedItem,
    canonical,
    json_int,
    json_string,
    pretty_json,
)
from torchsupervisor.checkpoint.row_blocks import (
    ROW_BLOCKS_KEY,
    RowBlocks,
    parse_row_blocks,
    row_blocks_field,
)
from torchsupervisor.checkpoint.tensor_table import PackedTensors, tensors_field
from torchsupervisor.core.tree import (
    as_dict,
    as_list,
    as_str,
    check_tree_depth,
)
from torchsupervisor.errors import ManifestError

__all__ = [
    "DATA_ALIGNMENT_BYTES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Manifest",
    "ManifestError",
    "PackedTensors",
    "ShardEntry",
    "TensorEntry",
    "data_filename",
    "dtype_from_code",
    "dtype_to_code",
    "non_negative_int",
    "pretty_json",
    "shard_files",
    "signed_json",
]

FORMAT_NAME = "torchsupervisor-checkpoint"
FORMAT_VERSION = 1
DATA_ALIGNMENT_BYTES = 64
CHECKSUM_ALGORITHM = "crc32c"
MAX_INDEX_BYTES = 1 << 30
"""The largest ``P.index`` read (1 GiB: some 5 million tensors); a larger one is damage."""


@dataclass(frozen=True)
class Manifest:
    """The parsed content of ``P.index``."""

    global_step: int | None
    wall_time: float
    tree: object
    tensors: dict[str, TensorEntry]
    shards: tuple[ShardEntry, ...]
    library_version: str
    torch_version: str
    world_size: int = 1
    format_version: int = FORMAT_VERSION
    metrics: dict[str, float] | None = None
    """What the run measured at this checkpoint (``Saver.save(metrics=)``), for keep-best
    retention; written only when given (older manifests have none)."""
    origin: dict[str, str | int] | None = None
    """Who wrote it (``Saver(origin=...)``: the memory tier's run id and rank), so that a
    snapshot found in another's place is refused; written only when given."""
    row_blocks: dict[str, RowBlocks] = field(default_factory=dict)
    """``{entry name: (rows, crcs)}``: the CRC-32C of each block of ``rows`` rows of a
    ``tensors`` entry (``row_blocks.py``), so that a restore needing some rows reads only
    their blocks; an entry not listed is read whole. Written only when not empty."""

    def to_bytes(self, tree_text: EncodedItem | None = None) -> bytes:
        """Serialize to the JSON text of ``P.index`` (UTF-8), with its own CRC-32C.

        ``tree_text``: the texts of ``tree`` where the caller has them
        (``tree_memo.TreeMemo``), written as they are.
        """
        body = self.body()
        if tree_text is not None:
            body["tree"] = tree_text
        return signed_json(body)

    def body(self) -> dict[str, Any]:
        """The fields of ``P.index`` in file order, without the checksum: JSON values, except
        the items of ``shards`` and ``tensors``, which are already encoded (``EncodedItem``:
        a manifest of 1,000 tensors has 2,000 items, and encoding each with ``json`` twice,
        readable and canonical, cost the writer 10 ms a save)."""
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "global_step": self.global_step,
            "wall_time": self.wall_time,
            "library_version": self.library_version,
            "torch_version": self.torch_version,
            "world_size": self.world_size,
            "checksum": CHECKSUM_ALGORITHM,
            "shards": [shard_item(s) for s in self.shards],
            "tensors": tensors_field(self.tensors),
            "tree": self.tree,
            **({} if self.metrics is None else {"metrics": dict(self.metrics)}),
            **({} if self.origin is None else {"origin": dict(self.origin)}),
            **({ROW_BLOCKS_KEY: row_blocks_field(self.row_blocks)} if self.row_blocks else {}),
        }

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse and validate the bytes of ``P.index``.

        Raises:
            ManifestError: If the text is not a valid manifest or its checksum does not match.
        """
        body = _checked_body(data)
        version = body["format_version"]
        try:
            shards = tuple(
                ShardEntry(
                    file=_shard_file(s["file"]),
                    size_bytes=non_negative_int(s["size_bytes"]),
                    data_offset=non_negative_int(s["data_offset"]),
                    crc32c=non_negative_int(s["crc32c"]),
                    header_crc32c=(
                        None
                        if as_dict(s).get("header_crc32c") is None
                        else non_negative_int(s["header_crc32c"])
                    ),
                )
                for s in as_list(body["shards"])
            )
            tensors = {}
            for name, e in as_dict(body["tensors"]).items():
                begin, end = (non_negative_int(x) for x in as_list(e["offsets"]))
                entry = TensorEntry(
                    shard=non_negative_int(e["shard"]),
                    dtype=dtype_from_code(e["dtype"]),
                    shape=tuple(non_negative_int(d) for d in as_list(e["shape"])),
                    begin=begin,
                    end=end,
                    crc32c=non_negative_int(e["crc32c"]),
                )
                _check_entry(name, entry, shards)
                tensors[name] = entry
            check_tree_depth(body["tree"])
            step = body["global_step"]
            return cls(
                global_step=None if step is None else non_negative_int(step),
                wall_time=float(body["wall_time"]),
                tree=body["tree"],
                tensors=tensors,
                shards=shards,
                library_version=as_str(body["library_version"]),
                torch_version=as_str(body["torch_version"]),
                world_size=non_negative_int(body.get("world_size", 1)),
                format_version=version,
                metrics=parse_metrics(body.get("metrics")),
                origin=parse_origin(body.get("origin")),
                row_blocks=parse_row_blocks(body.get(ROW_BLOCKS_KEY, {}), tensors),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ManifestError):
                raise
            raise ManifestError(f"malformed manifest field ({type(e).__name__}: {e})") from None


def shard_item(s: ShardEntry) -> EncodedItem:
    file, crc = json_string(s.file), json_int(s.crc32c)
    if s.header_crc32c is None:
        return EncodedItem(
            f'{{"file": {file}, "size_bytes": {s.size_bytes:d}, '
            f'"data_offset": {s.data_offset:d}, "crc32c": {crc}}}',
            f'{{"crc32c":{crc},"data_offset":{s.data_offset:d},"file":{file},'
            f'"size_bytes":{s.size_bytes:d}}}',
        )
    header = json_int(s.header_crc32c)
    return EncodedItem(
        f'{{"file": {file}, "size_bytes": {s.size_bytes:d}, "data_offset": {s.data_offset:d}, '
        f'"crc32c": {crc}, "header_crc32c": {header}}}',
        f'{{"crc32c":{crc},"data_offset":{s.data_offset:d},"file":{file},'
        f'"header_crc32c":{header},"size_bytes":{s.size_bytes:d}}}',
    )


def signed_json(body: dict[str, Any], expanded: tuple[str, ...] = ("shards", "tensors")) -> bytes:
    """The text of ``P.index`` for ``body``: ``body`` + ``manifest_crc32c`` (the CRC-32C of
    its canonical JSON), in ``pretty_json``'s layout, UTF-8. The items of the ``expanded``
    fields may be ``EncodedItem``s, a whole field an ``EncodedMapping``."""
    body["manifest_crc32c"] = crc32c.crc32c(canonical(body))
    data = pretty_json(body, expanded).encode("utf-8")
    RECENT_SHARD_FILES.put(data, _body_shard_files(body))
    return data


def shard_files(data: bytes) -> tuple[str, ...]:
    """Return the data files that the manifest ``data`` (the bytes of ``P.index``) names.

    For retention, which reads the manifest of every other checkpoint at each save to learn
    which data files they still use: the JSON, the format and the manifest's checksum are
    checked, the tensor table is not (``Manifest.from_bytes`` checks every entry, a cost that
    grows with the number of tensors). The answers for the last few manifests written or read
    by this process are kept, for their exact bytes (``RecentShardFiles``).

    Returns:
        The shard file names (plain names in the index's directory), in shard order.

    Raises:
        ManifestError: If the text is not a manifest, its checksum does not match, or a shard
            file is not a plain file name.
    """
    files = RECENT_SHARD_FILES.get(data)
    if files is not None:
        return files
    body = _checked_body(data)
    try:
        files = tuple(_shard_file(as_dict(s)["file"]) for s in as_list(body["shards"]))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ManifestError):
            raise
        raise ManifestError(f"malformed manifest field ({type(e).__name__}: {e})") from None
    RECENT_SHARD_FILES.put(data, files)
    return files


def _body_shard_files(body: Mapping[str, Any]) -> tuple[str, ...] | None:
    """What ``shard_files`` returns for the text of ``body`` (a body ``signed_json`` has just
    signed); None where it would raise instead."""
    if body.get("format") != FORMAT_NAME or body.get("format_version") != FORMAT_VERSION:
        return None
    try:
        shards = [
            json.loads(s.text) if isinstance(s, EncodedItem) else s for s in as_list(body["shards"])
        ]
        return tuple(_shard_file(as_dict(s)["file"]) for s in shards)
    except (KeyError, TypeError, ValueError):
        return None


class RecentShardFiles:
    """The shard lists of the manifests this process wrote or read last, for their exact
    bytes (any other bytes, a single flipped bit included, miss and are parsed and checked).

    Retention reads the manifest of every other checkpoint at each save, and the one it reads
    is most often the manifest the save has just written: for 1,000 tensors, parsing it and
    checking its checksum takes about 9 ms of the writer's time, holding the GIL (training
    waits). ``signed_json`` records what it signs, ``shard_files`` what it parsed.

    Found by length and CRC-32C, then compared byte for byte: the ``hash`` of a manifest just
    written or read (a new ``bytes``) costs 0.3 ms for 0.5 MB, its CRC-32C 0.03 ms. Two
    manifests of one length and CRC are one entry (the newer).
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self._max_entries, self._max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[tuple[int, int], tuple[bytes, tuple[str, ...]]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, data: bytes) -> tuple[str, ...] | None:
        key = (len(data), crc32c.crc32c(data))
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] != data:
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, data: bytes, files: tuple[str, ...] | None) -> None:
        if files is None or len(data) > self._max_bytes:
            return
        data = bytes(data)
        key = (len(data), crc32c.crc32c(data))
        with self._lock:
            if self._entries.pop(key, None) is not None:
                self._bytes -= key[0]
            self._entries[key] = (data, files)
            self._bytes += key[0]
            while len(self._entries) > self._max_entries or self._bytes > self._max_bytes:
                (size, _), _ = self._entries.popitem(last=False)
                self._bytes -= size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


# A few manifests, 64 MiB at most (a manifest of 1,000 tensors is about 0.5 MB).
RECENT_SHARD_FILES = RecentShardFiles(max_entries=8, max_bytes=64 << 20)


def _checked_body(data: bytes) -> dict[str, Any]:
    """The JSON body of a manifest of our format and version whose checksum matches (the
    checksum field removed)."""
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ManifestError(f"not valid JSON ({e})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        raise ManifestError(f"not a {FORMAT_NAME} manifest")
    stored = body.pop("manifest_crc32c", None)
    if stored != crc32c.crc32c(canonical(body)):
        raise ManifestError("manifest checksum mismatch")
    version = body.get("format_version")
    if version != FORMAT_VERSION:
        raise ManifestError(f"format_version {version!r} is not supported (expected 1)")
    return body


def parse_metrics(x: object) -> dict[str, float] | None:
    """A manifest's ``metrics``: None, or names mapped to finite numbers; else ``ManifestError``."""
    if x is None:
        return None
    metrics = {}
    for name, value in as_dict(x).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ManifestError(f"metric {name!r} is not a number: {value!r}")
        if not math.isfinite(value):
            raise ManifestError(f"metric {name!r} is not finite: {value!r}")
        metrics[as_str(name)] = float(value)
    return metrics


def parse_origin(x: object) -> dict[str, str | int] | None:
    """A manifest's ``origin``: names to strings or integers (None if absent)."""
    if x is None:
        return None
    origin = as_dict(x)
    for key, value in origin.items():
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ValueError(f"origin {key!r} is not a string or an integer")
    return dict(origin)


def non_negative_int(x: object) -> int:
    """``x`` if it is a non-negative ``int`` (not a bool); else ``ManifestError``."""
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise ManifestError(f"expected a non-negative integer, got {x!r}")
    return x


def _shard_file(x: object) -> str:
    """A shard's file name: a plain name inside the index's directory, nothing else."""
    name = as_str(x)
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise ManifestError(f"shard file {name!r} is not a plain file name in the directory")
    return name


def _check_entry(name: str, entry: TensorEntry, shards: tuple[ShardEntry, ...]) -> None:
    if entry.shard >= len(shards):
        raise ManifestError(f"tensor {name!r} names shard {entry.shard} of {len(shards)}")
    numel = math.prod(entry.shape)
    if entry.end < entry.begin or entry.nbytes != numel * entry.dtype.itemsize:
        raise ManifestError(f"tensor {name!r} has a byte range that does not fit its shape")
    shard = shards[entry.shard]
    if shard.data_offset + entry.end > shard.size_bytes:
        raise ManifestError(f"tensor {name!r} lies beyond the end of {shard.file}")
