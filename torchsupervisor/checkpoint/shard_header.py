"""A shard file's safetensors header, and the shard's checksum (``format`` describes both).

``safetensors_header`` writes the bytes before a shard's data (the 8-byte length and the JSON
header, padded so the data starts aligned), ``parse_safetensors_header`` reads a header back,
and ``shard_checksum`` combines the header's CRC-32C with each tensor's into the shard's
checksum that the manifest records.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import crc32c

from torchsupervisor.checkpoint.format import (
    DATA_ALIGNMENT_BYTES,
    TensorEntry,
    dtype_to_code,
    non_negative_int,
)
from torchsupervisor.core.tree import as_dict, as_list
from torchsupervisor.errors import ManifestError

__all__ = ["parse_safetensors_header", "safetensors_header", "shard_checksum"]


def shard_checksum(header: bytes | memoryview, tensor_crcs: list[int]) -> int:
    """Return a shard's checksum from its header bytes and its tensors' CRCs in data order."""
    crc = crc32c.crc32c(header)
    return crc32c.crc32c(struct.pack(f"<{len(tensor_crcs)}I", *tensor_crcs), crc)


def parse_safetensors_header(data: bytes) -> list[tuple[str, int, int]]:
    """Parse the JSON header of a safetensors file (without its 8-byte length prefix).

    Returns:
        ``(name, begin, end)`` of every tensor, sorted by ``begin`` (offsets relative to the
        data section).

    Raises:
        ManifestError: If the header is not valid safetensors JSON.
    """
    entries = parse_safetensors_entries(data)
    return sorted(((n, b, e) for n, (_, _, b, e) in entries.items()), key=lambda x: x[1])


def parse_safetensors_entries(data: bytes) -> dict[str, tuple[str, list[int], int, int]]:
    """Parse the JSON header of a safetensors file (without its 8-byte length prefix).

    Returns:
        ``{name: (dtype code, shape, begin, end)}`` (offsets relative to the data section).

    Raises:
        ManifestError: If the header is not valid safetensors JSON.
    """
    try:
        header = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ManifestError(f"shard header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ManifestError("shard header is not a JSON object")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        info = as_dict(info)
        offsets = as_list(info.get("data_offsets"))
        if len(offsets) != 2:
            raise ManifestError(f"bad data_offsets for {name!r} in the shard header")
        begin, end = (non_negative_int(x) for x in offsets)
        shape = [non_negative_int(x) for x in as_list(info.get("shape"))]
        dtype = info.get("dtype")
        if end < begin or not isinstance(dtype, str):
            raise ManifestError(f"bad entry for {name!r} in the shard header")
        out[name] = (dtype, shape, begin, end)
    return out


def safetensors_header(
    entries: list[tuple[str, TensorEntry]],
    *,
    spare: int = 0,
    alignment: int = DATA_ALIGNMENT_BYTES,
    size: int | None = None,
) -> bytes:
    """Return the 8-byte length plus the padded JSON header of a safetensors shard.

    Args:
        entries: ``(name, entry)`` in file order; the offsets must be contiguous from 0.
        spare: Bytes of padding to keep at least, for a longer header written in its place
            later (a sharded save's chunk names).
        alignment: The header's length is a multiple of this many bytes.
        size: The exact length wanted (``alignment`` and ``spare`` are then ignored).

    Returns:
        The bytes that precede the tensor data: 8 + the JSON text padded with spaces.

    Raises:
        ValueError: The header is longer than ``size``.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for name, e in entries:
        header[name] = {
            "dtype": dtype_to_code(e.dtype),
            "shape": list(e.shape),
            "data_offsets": [e.begin, e.end],
        }
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    if size is None:
        padded = -(-(8 + len(text) + spare) // alignment) * alignment - 8
    elif 8 + len(text) > size:
        raise ValueError(f"the shard header needs {8 + len(text)} bytes, more than {size}")
    else:
        padded = size - 8
    text += b" " * (padded - len(text))
    return struct.pack("<Q", len(text)) + text
