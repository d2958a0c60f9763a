"""TFRecord framing with masked CRC-32C: the container format of TensorBoard event files.

A file is a plain concatenation of records; each record is::

    uint64 length            little-endian, 8 bytes
    uint32 masked_crc32c(the 8 length bytes)   little-endian
    bytes  data[length]
    uint32 masked_crc32c(data)                 little-endian

CRC-32C is the Castagnoli polynomial (computed by the ``crc32c`` package, which releases the
GIL); the stored checksum is "masked" (rotated right by 15 bits plus a constant) so that a CRC
of data that itself contains CRCs does not degenerate.

Everything here is pure (bytes in, bytes out) except the readers, which only read.

TF names: ``tensorflow/core/lib/io/record_writer.cc``, ``record_reader.cc``, ``crc32c.h``
(``tf.io.TFRecordWriter`` / ``tf.compat.v1.io.tf_record_iterator`` framing).
"""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import crc32c as _crc32c

from torchsupervisor import errors
from torchsupervisor.storage import storage_for

__all__ = [
    "HEADER_BYTES",
    "MASK_DELTA",
    "MAX_RECORD_BYTES",
    "encode_record",
    "encode_records",
    "iter_records",
    "iter_records_with_offsets",
    "masked_crc32c",
    "read_records",
    "unmask_crc32c",
]

MASK_DELTA = 0xA282EAD8
"""The constant added to the rotated CRC when masking (``kMaskDelta`` in TF)."""

HEADER_BYTES = 12
"""Bytes before the payload of a record: the length (8) and its masked CRC (4)."""

_FOOTER_BYTES = 4
_U32 = 0xFFFFFFFF
_pack_u64 = struct.Struct("<Q").pack
_pack_u32 = struct.Struct("<I").pack
_unpack_header = struct.Struct("<QI").unpack
_unpack_u32 = struct.Struct("<I").unpack
_crc = _crc32c.crc32c

MAX_RECORD_BYTES = 256 << 20
"""The largest payload a reader accepts (256 MiB): a record that claims more is damage.

An events record is one ``Event``: a scalar takes tens of bytes, an image or a histogram
kilobytes to a few megabytes. A crafted length with a valid length checksum would otherwise
make a reader allocate what it claims (a 1 GiB file claiming 900 MiB: 2-3 GB of memory)."""

# Largest read issued at once while reading a payload of a stream whose size is unknown: the
# buffer grows only as bytes actually arrive.
_READ_CHUNK_BYTES = 1 << 20


def masked_crc32c(data: bytes | bytearray | memoryview) -> int:
    """Return the masked CRC-32C of ``data``, as stored in TFRecord files.

    Args:
        data: object bytes-like object.

    Returns:
        An unsigned 32-bit integer: ``rotr15(crc32c(data)) + 0xA282EAD8`` modulo 2**32.

    TF name: ``crc32c::Mask(crc32c::Value(data))``.
    """
    crc = _crc(data)
    return (((crc >> 15) | (crc << 17)) + MASK_DELTA) & _U32


def unmask_crc32c(masked: int) -> int:
    """Return the plain CRC-32C that ``masked_crc32c`` masked into ``masked``.

    Args:
        masked: An unsigned 32-bit masked checksum.

    Returns:
        The unsigned 32-bit CRC-32C.

    TF name: ``crc32c::Unmask``.
    """
    rot = (masked - MASK_DELTA) & _U32
    return ((rot >> 17) | (rot << 15)) & _U32


def encode_record(data: bytes | bytearray | memoryview) -> bytes:
    """Frame one payload as a TFRecord.

    Args:
        data: The payload (usually a serialized ``Event``).

    Returns:
        ``len(data) + 16`` bytes: header, payload, footer.

    TF name: ``RecordWriter::WriteRecord``.
    """
    header = _pack_u64(len(data))
    return b"".join(
        (header, _pack_u32(masked_crc32c(header)), data, _pack_u32(masked_crc32c(data)))
    )


def encode_records(payloads: Iterable[bytes]) -> bytes:
    """Frame several payloads and concatenate them (one buffer for one write call).

    Args:
        payloads: The payloads, in file order.

    Returns:
        The concatenated records.
    """
    return b"".join([encode_record(p) for p in payloads])


def _read_exact(f: BinaryIO, n: int, known: bool) -> bytearray:
    """Read up to ``n`` bytes into one buffer; fewer only at end of file.

    ``known``: ``n`` bytes are known to be there (checked against the file's size), so the
    buffer is allocated at once; otherwise it grows by bounded chunks as bytes arrive.
    """
    if known:
        buffer = bytearray(n)
        view = memoryview(buffer)
        got = 0
        while got < n:
            k = f.readinto(view[got:])  # type: ignore[attr-defined]
            if not k:
                break
            got += k
        del view
        if got < n:
            del buffer[got:]
        return buffer
    buffer = bytearray()
    while len(buffer) < n:
        chunk = f.read(min(n - len(buffer), _READ_CHUNK_BYTES))
        if not chunk:
            break
        buffer += chunk
    return buffer


def iter_records_with_offsets(
    f: BinaryIO, name: str, size: int | None = None
) -> Iterator[tuple[int, bytes]]:
    """``iter_records`` with each record's byte offset: ``(offset, payload)`` pairs.

    Args:
        f: The file, positioned at the start of a record.
        name: The file's name, for messages.
        size: The bytes from where ``f`` starts to the end of the file, if known (a record
            within them is read into a buffer allocated at once).

    Memory: a record is read into one buffer of its size, at most ``MAX_RECORD_BYTES``, then
    copied once into the payload returned; a length beyond the rest of the file (a crafted
    one, or a record still being written) is read by bounded chunks, so only the bytes really
    there are held.
    """
    offset = 0
    while True:
        header = f.read(HEADER_BYTES)
        if not header:
            return
        if len(header) < HEADER_BYTES:
            raise errors.DataLossError(
                f"truncated record at byte offset {offset} in {name}: expected a "
                f"{HEADER_BYTES}-byte header, got {len(header)} bytes"
            )
        length, length_crc = _unpack_header(header)
        if masked_crc32c(header[:8]) != length_crc:
            raise errors.DataLossError(
                f"corrupted record at byte offset {offset} in {name}: "
                "checksum mismatch of the length field"
            )
        if length > MAX_RECORD_BYTES:
            raise errors.DataLossError(
                f"corrupted record at byte offset {offset} in {name}: it claims {length} "
                f"bytes, more than the {MAX_RECORD_BYTES} bytes a record may hold"
            )
        # A claim beyond the end of the file (as it was when opened: a live file may have
        # grown since) allocates nothing for itself: what is there is read by chunks.
        remaining = None if size is None else size - offset - HEADER_BYTES - _FOOTER_BYTES
        known = remaining is not None and length <= remaining
        body = _read_exact(f, length + _FOOTER_BYTES, known=known)
        if len(body) < length + _FOOTER_BYTES:
            raise errors.DataLossError(
                f"truncated record at byte offset {offset} in {name}: it claims {length} "
                f"bytes of payload, the file has {max(len(body) - _FOOTER_BYTES, 0)} left"
            )
        view = memoryview(body)
        (data_crc,) = _unpack_u32(view[length:])
        if masked_crc32c(view[:length]) != data_crc:
            raise errors.DataLossError(
                f"corrupted record at byte offset {offset} in {name}: "
                "checksum mismatch of the payload"
            )
        data = bytes(view[:length])
        del view, body  # One copy at a time: the buffer goes before the payload is used.
        yield offset, data
        offset += HEADER_BYTES + length + _FOOTER_BYTES


def iter_records(f: BinaryIO, name: str | None = None) -> Iterator[bytes]:
    """Yield the payloads of the records read from a binary file object.

    A clean end of file between two records ends the iteration.

    Args:
        f: A file object opened for binary reading, positioned at the start of a record.
        name: The file name used in error messages; ``None`` takes ``f.name`` when present.

    Yields:
        Each payload (bytes), in file order.

    Raises:
        DataLossError: A record's length or payload checksum does not match, or the file ends
            inside a record. The message names the file and the byte offset of the record
            (relative to where reading started).

    TF name: ``tf.compat.v1.io.tf_record_iterator`` (uncompressed records).
    """
    label = name if name is not None else str(getattr(f, "name", "<stream>"))
    for _offset, data in iter_records_with_offsets(f, label):
        yield data


def read_records(path: str | os.PathLike[str]) -> Iterator[bytes]:
    """Yield the payloads of every record of the file at ``path``.

    Args:
        path: The file to read.

    Yields:
        Each payload (bytes), in file order.

    Raises:
        DataLossError: On a checksum mismatch or a truncated record (see ``iter_records``).
        OSError: If the file cannot be opened, or is not a regular file (a FIFO, a device:
            ``storage.NotRegularFileError``, raised before anything is read).
    """
    name = os.fspath(path)
    readable = storage_for(name).open_read(name)  # Never a FIFO.
    with io.BufferedReader(readable.stream()) as f:
        for _offset, data in iter_records_with_offsets(f, name, readable.size):
            yield data
