"""Read the sorted string table of a TF 1 checkpoint's index (``P.index``), checking its CRCs.

TensorFlow's tensor bundles (``tf.train.Saver``'s V2 format) keep their index in the table
format of LevelDB (TF's ``lib/io/table``): data blocks of key/value entries sorted by key, an
index block pointing at them, a metaindex block, and a 48-byte footer. Every block is
followed by one byte of compression type and the masked CRC-32C of the block and that byte.

* **Footer** (the last 48 bytes): the metaindex block's handle, the index block's handle (a
  handle is two varint64s: offset and size), zero padding to 40 bytes, then the magic number
  ``0xdb4775248b80fb57`` as a little-endian fixed64.
* **Block**: entries, then the restart offsets (fixed32 each) and their count (fixed32). An
  entry is three varint32s (bytes shared with the previous key, bytes not shared, the value's
  length), the key's unshared bytes, then the value.

Every block read is checked against its CRC before a byte of it is believed, every length
against what is left, and keys must come in increasing order; anything else raises
``CorruptCheckpointError`` naming the file. Compressed blocks (Snappy: TF 1.0-1.1 only; TF
writes none since 1.2) are refused with ``UnimplementedError``.

TF name: none (TF's ``table::Table``, C++ only).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from torchsupervisor.errors import CorruptCheckpointError, UnimplementedError
from torchsupervisor.summary.records import masked_crc32c

__all__ = ["TABLE_MAGIC", "is_table", "read_varint", "table_entries"]

TABLE_MAGIC = 0xDB4775248B80FB57
"""The last 8 bytes of a table (little-endian): ``kTableMagicNumber``."""
_FOOTER_BYTES = 48
_TRAILER_BYTES = 5  # The compression type (1 byte) and the masked CRC-32C (fixed32).
_NO_COMPRESSION, _SNAPPY = 0, 1


def is_table(data: bytes) -> bool:
    """True if ``data`` ends with a table's footer (its magic number)."""
    return len(data) >= _FOOTER_BYTES and struct.unpack_from("<Q", data, len(data) - 8)[0] == (
        TABLE_MAGIC
    )


def read_varint(
    data: bytes | memoryview, pos: int, limit: int, max_bits: int = 64
) -> tuple[int, int]:
    """Decode the varint at ``data[pos:limit]``; return it and the position after it.

    Raises:
        ValueError: It runs past ``limit`` or is longer than ``max_bits`` allows.
    """
    result = shift = 0
    while True:
        if pos >= limit or shift >= max_bits:
            raise ValueError("a truncated or overlong varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if result >> max_bits:
                raise ValueError("a varint out of range")
            return result, pos
        shift += 7


class _Table:
    def __init__(self, path: str, data: bytes) -> None:
        self.path = path
        self.data = data

    def damaged(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"TF checkpoint index {self.path} is corrupt: {what}", path=self.path, reason=what
        )

    def handle(self, data: bytes | memoryview, pos: int, limit: int) -> tuple[int, int, int]:
        """A block handle at ``pos``: its offset, its size, and the position after it."""
        try:
            offset, pos = read_varint(data, pos, limit)
            size, pos = read_varint(data, pos, limit)
        except ValueError as e:
            raise self.damaged(f"a block handle is unreadable ({e})") from None
        if offset + size + _TRAILER_BYTES > len(self.data) - _FOOTER_BYTES:
            raise self.damaged(f"a block ({size} bytes at {offset}) lies past the file's end")
        return offset, size, pos

    def block(self, offset: int, size: int) -> memoryview:
        """The contents of the block at ``offset``, after checking its CRC."""
        view = memoryview(self.data)
        kind = self.data[offset + size]
        (stored,) = struct.unpack_from("<I", self.data, offset + size + 1)
        if masked_crc32c(view[offset : offset + size + 1]) != stored:
            raise self.damaged(f"the block at byte {offset} fails its checksum")
        if kind == _SNAPPY:
            raise UnimplementedError(
                None,
                None,
                f"TF checkpoint index {self.path} has Snappy-compressed blocks (TF 1.0-1.1): "
                "not supported; load it in TensorFlow and save it again",
            )
        if kind != _NO_COMPRESSION:
            raise self.damaged(f"the block at byte {offset} has an unknown compression {kind}")
        return view[offset : offset + size]

    def entries(self, block: memoryview) -> Iterator[tuple[bytes, memoryview]]:
        """The key/value entries of ``block``, in order."""
        if len(block) < 4:
            raise self.damaged("a block is shorter than its restart count")
        (restarts,) = struct.unpack_from("<I", block, len(block) - 4)
        end = len(block) - 4 - 4 * restarts
        if restarts < 1 or end < 0:
            raise self.damaged(f"a block's restart count {restarts} does not fit it")
        pos, key = 0, b""
        while pos < end:
            try:
                shared, pos = read_varint(block, pos, end, 32)
                unshared, pos = read_varint(block, pos, end, 32)
                length, pos = read_varint(block, pos, end, 32)
            except ValueError as e:
                raise self.damaged(f"an entry is unreadable ({e})") from None
            if shared > len(key) or pos + unshared + length > end:
                raise self.damaged("an entry runs past its block")
            key = key[:shared] + bytes(block[pos : pos + unshared])
            pos += unshared
            yield key, block[pos : pos + length]
            pos += length


def table_entries(path: str, data: bytes) -> Iterator[tuple[bytes, memoryview]]:
    """Every key/value entry of the table ``data`` (the bytes of ``path``), in key order.

    Args:
        path: The file's name (for errors).
        data: Its whole contents.

    Raises:
        CorruptCheckpointError: It is not a table, or a block fails its CRC, or anything in
            it does not fit (naming ``path``).
        UnimplementedError: Its blocks are compressed.

    TF name: none (``table::Table::NewIterator`` in TF's C++).
    """
    table = _Table(path, data)
    if not is_table(data):
        raise table.damaged("it does not end with a table's footer (truncated, or not a table)")
    footer = len(data) - _FOOTER_BYTES
    meta_offset, meta_size, pos = table.handle(data, footer, len(data) - 8)
    index_offset, index_size, pos = table.handle(data, pos, len(data) - 8)
    if any(data[pos : len(data) - 8]):
        raise table.damaged("the footer's padding is not zeros")
    table.block(meta_offset, meta_size)  # Nothing in it is used; its bytes are checked too.
    previous: bytes | None = None
    for _, value in table.entries(table.block(index_offset, index_size)):
        offset, size, _ = table.handle(value, 0, len(value))
        for key, entry in table.entries(table.block(offset, size)):
            if previous is not None and key <= previous:
                raise table.damaged("its keys are out of order")
            previous = key
            yield key, entry
