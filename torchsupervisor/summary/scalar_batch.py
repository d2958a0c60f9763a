"""Encode many scalar events at once: numpy builds the records, the C CRC-32C checks them.

``add_scalar`` is called on every training step, so the writer thread sees long runs of scalar
items ``(wall_time, step, tag, value)``. Serializing them one by one in Python (even by hand,
``scalar_event.py``) costs more than a microsecond each, under the GIL that the training
thread needs too. ``ScalarBatchEncoder`` instead lays a run out as a byte matrix, one row per
record, with a column block per field::

    | length (8) | masked CRC of length (4) | 0x09 wall_time (8) | 0x10 step varint (<= 10)
    | summary/value head of the tag | float32 value (4) | masked CRC of payload (4) |

Absent fields (a zero wall time or step, which protobuf omits) and the unused tails of the
varint and head blocks are masked out, and ``matrix[mask]`` concatenates the rows into the
exact bytes of the framed records. The payload checksums are computed by the ``crc32c``
package (C, one call per record) and scattered into their slots. The output is byte-identical
to ``records.encode_record(Event(...).SerializeToString())`` for every record (tested), down
to float32 overflow, NaN payloads and negative steps (10-byte varints).

Pure: items in, bytes out; no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import crc32c
import numpy as np

from torchsupervisor.summary.records import MASK_DELTA
from torchsupervisor.summary.scalar_event import _scalar_head

__all__ = ["MAX_CACHED_TAGS", "ScalarBatchEncoder"]

MAX_CACHED_TAGS = 65536
"""Tags whose encoded head is kept; the cache restarts when a writer has seen more."""

_crc = crc32c.crc32c
_pack_u64 = struct.Struct("<Q").pack
_U32 = 0xFFFFFFFF

# Column layout of the record matrix (the head block starts at _HEAD and is as wide as the
# longest head in the batch; the value and its record CRC follow it).
_LENGTH = slice(0, 8)
_LENGTH_CRC = slice(8, 12)
_WALL_KEY = 12
_WALL = slice(13, 21)
_STEP_KEY = 21
_VARINT = 22
_MAX_VARINT = 10
_HEAD = _VARINT + _MAX_VARINT
_FIXED_COLUMNS = _HEAD + 8  # + head width


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + MASK_DELTA) & _U32


class ScalarBatchEncoder:
    """Turn runs of scalar items into framed TFRecords of serialized ``Event`` protos.

    An item is ``(wall_time, step, tag, value)``: ``wall_time`` a float (seconds since the
    epoch), ``step`` an int in the int64 range (0 means no step, as in the proto), ``tag`` a
    str and ``value`` a float (stored as float32, out-of-range values becoming +-inf).

    Thread safety: used by one writer thread only (it caches the heads of the tags it saw).
    """

    def __init__(self) -> None:
        self._tag_ids: dict[str, int] = {}
        self._heads: list[bytes] = []
        self._table = np.zeros((0, 0), dtype=np.uint8)  # heads, left-aligned, zero-padded
        self._head_lengths = np.zeros(0, dtype=np.intp)
        self._length_headers: dict[int, int] = {}  # payload length -> masked CRC of it

    @property
    def cached_tags(self) -> int:
        """How many tags' heads are cached now (at most ``MAX_CACHED_TAGS``)."""
        return len(self._heads)

    def _add_tags(self, tags: set[str]) -> None:
        if len(self._heads) + len(tags) > MAX_CACHED_TAGS:
            self._tag_ids.clear()
            self._heads.clear()
        for tag in sorted(tags):
            self._tag_ids[tag] = len(self._heads)
            self._heads.append(_scalar_head(tag))
        width = max(len(h) for h in self._heads)
        table = np.zeros((len(self._heads), width), dtype=np.uint8)
        for row, head in enumerate(self._heads):
            table[row, : len(head)] = np.frombuffer(head, dtype=np.uint8)
        self._table = table
        self._head_lengths = np.array([len(h) for h in self._heads], dtype=np.intp)

    def _length_crcs(self, payload_lengths: np.ndarray) -> np.ndarray:
        unique, inverse = np.unique(payload_lengths, return_inverse=True)
        cache = self._length_headers
        crcs = []
        for length in unique.tolist():
            crc = cache.get(length)
            if crc is None:
                if len(cache) >= 4096:
                    cache.clear()
                crc = cache[length] = _masked(_crc(_pack_u64(length)))
            crcs.append(crc)
        return np.array(crcs, dtype="<u4")[inverse.reshape(-1)]

    def encode(
        self,
        wall_times: Sequence[float],
        steps: Sequence[int],
        tags: Sequence[str],
        values: Sequence[float],
    ) -> np.ndarray:
        """Return the framed records of the run, concatenated, as a uint8 array.

        Args:
            wall_times: The events' wall times, in seconds.
            steps: The events' steps (0: none), each in ``[-2**63, 2**63)``.
            tags: The values' tags.
            values: The scalar values.

        Returns:
            The bytes of one record per item, in order.

        Raises:
            OverflowError: A step is outside the int64 range.
        """
        n = len(tags)
        walls = np.array(wall_times, dtype=np.float64)
        step_bits = np.array(steps, dtype=np.int64).view(np.uint64)
        with np.errstate(over="ignore", invalid="ignore"):
            floats = np.array(values, dtype=np.float64).astype("<f4")
        new = set(tags).difference(self._tag_ids)
        if new:
            self._add_tags(new)
        tag_ids = np.fromiter(map(self._tag_ids.__getitem__, tags), dtype=np.intp, count=n)
        head_lengths = self._head_lengths[tag_ids]
        head_width = int(head_lengths.max())
        has_wall = walls.view(np.uint64) != 0
        has_step = step_bits != 0

        # Step varints: 7 bits a byte, low bits first, high bit set on all but the last byte.
        varint_width = 1
        top = int(step_bits.max())
        while top >= 1 << (7 * varint_width) and varint_width < _MAX_VARINT:
            varint_width += 1
        varint_lengths = np.ones(n, dtype=np.intp)
        varint = np.empty((n, varint_width), dtype=np.uint8)
        rest = step_bits
        seven = np.uint64(7)
        for k in range(varint_width):
            following = rest >> seven
            varint[:, k] = (rest & np.uint64(0x7F)).astype(np.uint8) | (
                (following != 0).astype(np.uint8) << 7
            )
            if k:
                varint_lengths += rest != 0
            rest = following
        varint_lengths *= has_step

        payload_lengths = 9 * has_wall + (1 + varint_lengths) * has_step + head_lengths + 4
        width = _FIXED_COLUMNS + head_width
        head_end = _HEAD + head_width
        matrix = np.empty((n, width), dtype=np.uint8)
        matrix[:, _LENGTH] = payload_lengths.astype("<u8").view(np.uint8).reshape(n, 8)
        matrix[:, _LENGTH_CRC] = self._length_crcs(payload_lengths).view(np.uint8).reshape(n, 4)
        matrix[:, _WALL_KEY] = 0x09
        matrix[:, _WALL] = walls.astype("<f8").view(np.uint8).reshape(n, 8)
        matrix[:, _STEP_KEY] = 0x10
        matrix[:, _VARINT : _VARINT + varint_width] = varint
        matrix[:, _HEAD:head_end] = self._table[tag_ids, :head_width]
        matrix[:, head_end : head_end + 4] = floats.view(np.uint8).reshape(n, 4)

        keep = np.ones((n, width), dtype=bool)
        keep[:, _WALL_KEY : _WALL.stop] = has_wall[:, None]
        keep[:, _STEP_KEY] = has_step
        keep[:, _VARINT:_HEAD] = np.arange(_MAX_VARINT) < varint_lengths[:, None]
        keep[:, _HEAD:head_end] = np.arange(head_width) < head_lengths[:, None]
        out = matrix[keep]  # row after row: the records, with placeholders for payload CRCs

        ends = np.cumsum(payload_lengths + 16) - 4
        view = memoryview(out)
        crc = _crc
        crcs = np.fromiter(
            (
                crc(view[end - length : end])
                for end, length in zip(ends.tolist(), payload_lengths.tolist())
            ),
            dtype=np.uint32,
            count=n,
        )
        masked = ((crcs >> np.uint32(15)) | (crcs << np.uint32(17))) + np.uint32(MASK_DELTA)
        out[ends[:, None] + np.arange(4)] = masked.astype("<u4").view(np.uint8).reshape(n, 4)
        return out
