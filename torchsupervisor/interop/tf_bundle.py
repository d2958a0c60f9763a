"""Read TF 1 checkpoints (V2 tensor bundles) without TensorFlow, checking every tensor.

A bundle written by ``tf.compat.v1.train.Saver`` (or ``tf.train.Checkpoint``) is ``P.index``,
a sorted table (``interop/tf_table``) of protobuf records, and ``P.data-0000k-of-0000N``, the
tensors' bytes:

* the entry under the empty key is a ``BundleHeaderProto``: the number of data files, the
  byte order of the machine that wrote them, the format's version;
* every other entry is a ``BundleEntryProto`` keyed by the tensor's name: its dtype, shape,
  data file, offset, size and the masked CRC-32C of its bytes. A partitioned variable's entry
  lists its slices instead, each stored as its own entry under a key that encodes the name
  and the slice (TF's ``EncodeTensorNameSlice``, ordered-code numbers and strings).

Numeric tensors are stored as their little-endian bytes; a string tensor as the varint64
length of each element, the masked CRC-32C of those lengths (as uint32s), then the elements'
bytes; its entry's CRC covers the lengths, that checksum and the bytes.

``TFBundleReader`` offers the reader API of ``CheckpointReader`` (``NewCheckpointReader``
returns one for a bundle): every tensor read is checked against its CRC (and a string
tensor's lengths against theirs), a partitioned variable is assembled from its slices, which
must tile it exactly, and tensors come back as torch tensors (strings as ``bytes``, nested in
lists by shape). Anything wrong raises ``CorruptCheckpointError`` naming the file; a bundle
written on a big-endian machine, or by a newer format version, is refused with
``UnimplementedError``. Nothing is executed or unpickled.

Dtypes: every float (``float16``, ``bfloat16``, ``float32``, ``float64``, float8 e5m2 and
e4m3fn), every signed and unsigned integer width, ``bool``, ``complex64``, ``complex128``;
TF's quantized types as their integer storage (``qint8`` as ``int8``, ...). Resource and
variant tensors (TF 2 iterators, hash tables) are listed but cannot be read.

TF name: ``tensorflow::BundleReader`` (``py_checkpoint_reader.CheckpointReader`` on V2 files).
"""

from __future__ import annotations

import os
import struct
from typing import Any

import crc32c
import torch
from google.protobuf.message import DecodeError

from torchsupervisor.checkpoint.shard_io import open_checked
from torchsupervisor.errors import CorruptCheckpointError, NotFoundError, UnimplementedError
from torchsupervisor.interop.tf_records import (
    TF_DTYPES,
    BundleEntryProto,
    BundleHeaderProto,
    slice_key,
)
from torchsupervisor.interop.tf_table import read_varint, table_entries
from torchsupervisor.storage import BY_PATH, Readable, Storage, read_exactly
from torchsupervisor.summary.records import unmask_crc32c

__all__ = ["BUNDLE_VERSION", "TFBundleReader"]

BUNDLE_VERSION = 1
"""The tensor bundle format version this reader understands (``kTensorBundleVersion``)."""
_STRING = 7
_INDEX_LIMIT_BYTES = 1 << 30  # An index larger than this is not a checkpoint's.
_BIG = 1


class TFBundleReader:
    """Read a TF 1 checkpoint's tensors (module docstring).

    Args:
        prefix: The checkpoint prefix (``logdir/model.ckpt-1234``: ``prefix.index`` exists).
        storage: Where it lives.
        index: The bytes of ``prefix.index`` if already read; None: read here.

    Raises:
        NotFoundError: ``prefix.index`` does not exist (TF's text).
        CorruptCheckpointError: The index is damaged (a CRC, a record, a length), naming it.
        UnimplementedError: The bundle was written on a big-endian machine, by a newer format
            version, or with compressed index blocks.

    Thread safety: read-only; each call opens its own files.

    TF name: ``tf.compat.v1.train.NewCheckpointReader`` on a V2 checkpoint.
    """

    def __init__(self, prefix: str, *, storage: Storage = BY_PATH, index: bytes | None = None):
        self._prefix = prefix
        self._storage = storage
        self._dir = os.path.dirname(prefix)
        self._index_path = prefix + ".index"
        if index is None:
            try:
                index = storage.read_bytes(self._index_path, max_bytes=_INDEX_LIMIT_BYTES)
            except FileNotFoundError:
                raise NotFoundError(
                    "Unsuccessful TensorSliceReader constructor: Failed to find any matching "
                    f"files for {prefix}"
                ) from None
            except OSError as e:
                raise self._damaged_index(f"it cannot be read ({e})") from e
        entries = iter(table_entries(self._index_path, index))
        first = next(entries, None)
        if first is None or first[0] != b"":
            raise self._damaged_index("its first entry is not the bundle's header")
        header = self._parse(BundleHeaderProto, first[0], first[1])
        self._check_header(header)
        self.num_shards = header.num_shards
        """The number of data files (``P.data-0000k-of-0000N``)."""
        self._entries: dict[str, Any] = {}
        self._slices: dict[bytes, Any] = {}
        for key, value in entries:
            entry = self._parse(BundleEntryProto, key, value)
            if key[:1] == b"\x00":  # A slice of a partitioned variable (ordered code).
                self._slices[key] = entry
            else:
                try:
                    self._entries[key.decode()] = entry
                except UnicodeDecodeError:
                    raise self._damaged_index(f"a tensor name is not UTF-8: {key!r}") from None
        for name, entry in self._entries.items():
            self._check_entry(name, entry)

    # ---------------------------------------------------------------------- the index

    def _damaged_index(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"TF checkpoint index {self._index_path} is corrupt: {what}",
            path=self._index_path,
            reason=what,
        )

    def _parse(self, cls: Any, key: bytes, value: memoryview) -> Any:
        record = cls()
        try:
            record.ParseFromString(bytes(value))
        except DecodeError:
            raise self._damaged_index(f"the entry for key {key!r} is not parseable") from None
        return record

    def _check_header(self, header: Any) -> None:
        if header.endianness == _BIG:
            raise UnimplementedError(
                None,
                None,
                f"TF checkpoint {self._prefix} was written on a big-endian machine "
                f"({self._index_path} says so): only little-endian bundles are read",
            )
        if header.endianness != 0:
            raise self._damaged_index(f"an unknown byte order {header.endianness}")
        version = header.version
        if version.min_consumer > BUNDLE_VERSION or BUNDLE_VERSION in version.bad_consumers:
            raise UnimplementedError(
                None,
                None,
                f"TF checkpoint {self._prefix} needs a reader of bundle version "
                f"{version.min_consumer} or newer (format producer {version.producer}); "
                f"this one reads version {BUNDLE_VERSION}",
            )
        if not 1 <= header.num_shards <= 99999:
            raise self._damaged_index(f"it names {header.num_shards} data files")

    def _check_entry(self, name: str, entry: Any) -> None:
        if entry.dtype not in TF_DTYPES:
            raise self._damaged_index(f"tensor {name!r} has an unknown dtype {entry.dtype}")
        if entry.shape.unknown_rank or any(d.size < 0 for d in entry.shape.dim):
            raise self._damaged_index(f"tensor {name!r} has no valid shape")
        if not entry.slices and not 0 <= entry.shard_id < self.num_shards:
            raise self._damaged_index(f"tensor {name!r} is in data file {entry.shard_id}")
        if entry.offset < 0 or entry.size < 0:
            raise self._damaged_index(f"tensor {name!r} has a negative offset or size")

    # ---------------------------------------------------------------------- queries

    @property
    def prefix(self) -> str:
        """The checkpoint prefix, as given.

        TF name: none.
        """
        return self._prefix

    @property
    def global_step(self) -> int | None:
        """The value of the ``global_step`` tensor (TF 1's step variable), or None.

        TF name: none (``get_tensor("global_step")`` in TF).
        """
        entry = self._entries.get("global_step")
        if entry is None or TF_DTYPES[entry.dtype][0] not in (torch.int64, torch.int32):
            return None
        if len(entry.shape.dim) != 0:
            return None
        return int(self.get_tensor("global_step"))

    @property
    def is_sharded(self) -> bool:
        """True if some tensors are stored in slices (partitioned variables).

        TF name: none.
        """
        return any(e.slices for e in self._entries.values())

    def get_variable_to_shape_map(self) -> dict[str, list[int]]:
        """Return ``{tensor name: shape as a list of ints}`` (a partitioned variable whole).

        TF name: ``tf.compat.v1.train.NewCheckpointReader(...).get_variable_to_shape_map``.
        """
        return {name: self._shape(e) for name, e in self._entries.items()}

    def get_variable_to_dtype_map(self) -> dict[str, torch.dtype | type[bytes] | None]:
        """Return ``{tensor name: torch dtype}``: ``bytes`` for a string tensor, None for a
        resource or variant one (``get_variable_to_tf_dtype_map`` gives TF's names).

        TF name: ``tf.compat.v1.train.NewCheckpointReader(...).get_variable_to_dtype_map``.
        """
        out: dict[str, torch.dtype | type[bytes] | None] = {}
        for name, entry in self._entries.items():
            dtype = TF_DTYPES[entry.dtype][0]
            out[name] = bytes if entry.dtype == _STRING else dtype
        return out

    def get_variable_to_tf_dtype_map(self) -> dict[str, str]:
        """Return ``{tensor name: TF's dtype name}`` (``"float32"``, ``"string"``, ...).

        TF name: none (TF's map gives ``tf.DType`` objects).
        """
        return {name: TF_DTYPES[e.dtype][1] for name, e in self._entries.items()}

    def data_files(self) -> list[str]:
        """The paths of the bundle's data files, in shard order.

        TF name: none (``tensorflow::DataFilename``).
        """
        return [self._data_path(k) for k in range(self.num_shards)]

    def describe(self) -> list[dict[str, Any]]:
        """One record per tensor, in name order, as the index says (nothing read): its
        ``name``, TF ``dtype`` name, ``shape``, stored ``bytes``, masked ``crc32c`` (as TF
        stores it; None for a partitioned variable), its data file's index ``shard`` (None
        for a partitioned variable) and the number of its ``slices`` (0 if whole).

        TF name: none.
        """
        out = []
        for name in sorted(self._entries):
            entry = self._entries[name]
            parts = [self._slices.get(slice_key(name, self._extents(name, p, self._shape(entry))))
                     for p in entry.slices]  # fmt: skip
            out.append({
                "name": name,
                "dtype": TF_DTYPES[entry.dtype][1],
                "shape": self._shape(entry),
                "bytes": sum(p.size for p in parts if p is not None) if parts else entry.size,
                "crc32c": None if parts else entry.crc32c,
                "shard": None if parts else entry.shard_id,
                "slices": len(parts),
            })  # fmt: skip
        return out

    @staticmethod
    def _shape(entry: Any) -> list[int]:
        return [d.size for d in entry.shape.dim]

    def has_tensor(self, name: str) -> bool:
        """Return True if the bundle holds a tensor called ``name``.

        TF name: ``tf.compat.v1.train.NewCheckpointReader(...).has_tensor``.
        """
        return name in self._entries

    # ---------------------------------------------------------------------- reading

    def get_tensor(self, name: str) -> Any:
        """Read one tensor after checking its CRC (each slice's, for a partitioned one).

        Returns:
            A new CPU tensor of the bundle's shape and dtype (the torch dtype of the same
            bytes: ``TF_DTYPES``); for a string tensor, ``bytes`` (0-d) or lists of them
            nested by shape.

        Raises:
            NotFoundError: ``"Key <name> not found in checkpoint"``.
            CorruptCheckpointError: A data file is missing, unreadable, a link out of the
                checkpoint's directory or too short, a CRC does not match, or the slices of
                a partitioned variable do not tile it (naming the file).
            UnimplementedError: A resource or variant tensor.

        TF name: ``tf.compat.v1.train.NewCheckpointReader(...).get_tensor``.
        """
        entry = self._entries.get(name)
        if entry is None:
            raise NotFoundError(f"Key {name} not found in checkpoint")
        return self._read(name, entry)

    def read_tensors(self) -> dict[str, Any]:
        """Read every tensor, each checked (``get_tensor``), in name order.

        TF name: none.
        """
        return {name: self.get_tensor(name) for name in sorted(self._entries)}

    def verify(self) -> None:
        """Read every tensor and check every CRC; raise on the first damage.

        Raises:
            CorruptCheckpointError: As ``get_tensor``.

        TF name: none.
        """
        for name, entry in self._entries.items():
            if TF_DTYPES[entry.dtype][0] is not None or entry.dtype == _STRING:
                self._read(name, entry)

    def _read(self, name: str, entry: Any) -> Any:
        dtype, tf_name = TF_DTYPES[entry.dtype]
        if dtype is None and entry.dtype != _STRING:
            raise UnimplementedError(
                None, None, f"Tensor {name!r} of {self._prefix} is a {tf_name}: not readable"
            )
        shape = [d.size for d in entry.shape.dim]
        if not entry.slices:
            return self._read_whole(name, entry, shape)
        if entry.dtype == _STRING:
            raise UnimplementedError(
                None, None, f"Tensor {name!r} of {self._prefix} is a partitioned string tensor"
            )
        assert dtype is not None
        # The slices must hold as many elements as the tensor before it is allocated (a
        # crafted shape would otherwise claim terabytes); that they tile it is checked below.
        numel = _numel(shape)
        parts = 0
        for proto in entry.slices:
            extents = self._extents(name, proto, shape)
            parts += _numel([n if n >= 0 else size for (_, n), size in zip(extents, shape)])
        if parts != numel:
            raise self._damaged_index(
                f"the slices of tensor {name!r} hold {parts} elements, not its {numel}"
            )
        itemsize = torch.empty((), dtype=dtype).element_size()
        for proto in entry.slices:  # And their bytes must be in their data files.
            extents = self._extents(name, proto, shape)
            part = self._slices.get(slice_key(name, extents))
            sizes = [n if n >= 0 else size for (_, n), size in zip(extents, shape)]
            if part is not None and part.size != _numel(sizes) * itemsize:
                raise self._damaged_index(f"a slice of tensor {name!r} has the wrong size")
            if part is not None and 0 <= part.shard_id < self.num_shards:
                data = self._data_path(part.shard_id)
                try:
                    end = self._storage.size(data)
                except OSError:
                    end = -1
                if part.offset + part.size > end:
                    raise CorruptCheckpointError(
                        f"TF checkpoint data file {data} is missing or truncated: a slice of "
                        f"tensor {name!r} does not fit in it",
                        path=data,
                        reason="truncated",
                    )
        out = torch.empty(shape, dtype=dtype)
        covered = torch.zeros(shape, dtype=torch.int8)
        for proto in entry.slices:
            extents = self._extents(name, proto, shape)
            part_entry = self._slices.get(slice_key(name, extents))
            where = ", ".join(f"{s}:{s + n}" if n >= 0 else ":" for s, n in extents)
            if part_entry is None or part_entry.dtype != entry.dtype:
                raise self._damaged_index(f"the slice [{where}] of tensor {name!r} is missing")
            index = tuple(slice(s, s + n) if n >= 0 else slice(None) for s, n in extents)
            part_shape = list(out[index].shape)
            if [d.size for d in part_entry.shape.dim] != part_shape:
                raise self._damaged_index(f"the slice [{where}] of tensor {name!r} has a shape "
                                          "that does not fit it")  # fmt: skip
            out[index] = self._read_whole(f"{name}[{where}]", part_entry, part_shape)
            covered[index] += 1
        if covered.numel() and not bool((covered == 1).all()):
            raise self._damaged_index(f"the slices of tensor {name!r} do not tile it exactly")
        return out

    def _extents(self, name: str, proto: Any, shape: list[int]) -> list[tuple[int, int]]:
        if len(proto.extent) != len(shape):
            raise self._damaged_index(f"a slice of tensor {name!r} has the wrong rank")
        extents = []
        for extent, size in zip(proto.extent, shape):
            length = extent.length if extent.HasField("length") else -1
            if extent.start < 0 or length < -1 or extent.start + max(length, 0) > size:
                raise self._damaged_index(f"a slice of tensor {name!r} lies out of its shape")
            extents.append((extent.start, length))
        return extents

    def _data_path(self, shard: int) -> str:
        return f"{self._prefix}.data-{shard:05d}-of-{self.num_shards:05d}"

    def _open(self, path: str) -> Readable:
        return open_checked(path, self._storage, self._dir or None, "TF checkpoint data file")

    def _read_whole(self, name: str, entry: Any, shape: list[int]) -> Any:
        dtype = TF_DTYPES[entry.dtype][0]
        numel = _numel(shape)
        path = self._data_path(entry.shard_id)
        if not 0 <= entry.shard_id < self.num_shards:
            raise self._damaged_index(f"tensor {name!r} is in data file {entry.shard_id}")
        if entry.dtype != _STRING:
            assert dtype is not None
            itemsize = torch.empty((), dtype=dtype).element_size()
            if entry.size != numel * itemsize:
                raise self._damaged_index(
                    f"tensor {name!r} has {entry.size} bytes for {numel} x {itemsize}"
                )
        with self._open(path) as f:
            if entry.offset + entry.size > f.size:
                raise CorruptCheckpointError(
                    f"TF checkpoint data file {path} is truncated: tensor {name!r} ends at byte "
                    f"{entry.offset + entry.size}, the file at {f.size}",
                    path=path,
                    reason="truncated",
                )
            raw = torch.empty(entry.size, dtype=torch.uint8)
            view = memoryview(raw.numpy())
            try:
                read_exactly(f, view, entry.offset)
            except EOFError:
                raise CorruptCheckpointError(
                    f"TF checkpoint data file {path} is truncated", path=path, reason="truncated"
                ) from None
        if entry.dtype == _STRING:
            return self._strings(name, path, bytes(view), numel, shape, entry.crc32c)
        if crc32c.crc32c(view) != unmask_crc32c(entry.crc32c):
            raise CorruptCheckpointError(
                f"Tensor {name!r} in {path} is corrupt: checksum mismatch",
                path=path,
                reason="checksum mismatch",
            )
        assert dtype is not None
        return raw.view(dtype).reshape(shape)

    def _strings(
        self, name: str, path: str, data: bytes, numel: int, shape: list[int], stored: int
    ) -> Any:
        def damaged(what: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(
                f"Tensor {name!r} in {path} is corrupt: {what}", path=path, reason=what
            )

        if numel == 0:
            return _nest([], shape)
        lengths, pos, crc = [], 0, 0
        try:
            for _ in range(numel):
                length, pos = read_varint(data, pos, len(data))
                lengths.append(length)
                crc = crc32c.crc32c(
                    struct.pack("<I" if length <= 0xFFFFFFFF else "<Q", length), crc
                )
        except ValueError:
            raise damaged("its string lengths are unreadable") from None
        if pos + 4 > len(data):
            raise damaged("its string lengths run past its bytes")
        (length_check,) = struct.unpack_from("<I", data, pos)
        if unmask_crc32c(length_check) != crc:
            raise damaged("the checksum of its string lengths does not match")
        crc = crc32c.crc32c(data[pos : pos + 4], crc)
        pos += 4
        if pos + sum(lengths) != len(data):
            raise damaged("its strings do not fill its bytes exactly")
        crc = crc32c.crc32c(data[pos:], crc)
        if crc != unmask_crc32c(stored):
            raise damaged("checksum mismatch")
        values = []
        for length in lengths:
            values.append(data[pos : pos + length])
            pos += length
        return _nest(values, shape)


def _numel(shape: list[int]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


def _nest(values: list[bytes], shape: list[int]) -> Any:
    """``values`` (row-major) as nested lists of ``shape``; a 0-d one as its single value."""
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    step = len(values) // shape[0] if shape[0] else 0
    return [_nest(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]
