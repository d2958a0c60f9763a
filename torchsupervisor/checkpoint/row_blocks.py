"""Checksums of blocks of rows: what lets a resharded restore read only the rows it needs.

A checkpoint stores each tensor (or, sharded, each saved chunk: a rank's shard of a tensor)
contiguously, rows along dim 0 one after another; FSDP2 shards along dim 0, so a restore into
an FSDP2 state, or at another world size, needs a range of rows of each entry it overlaps.
With one CRC-32C per entry it must read the whole entry to check it (N x the bytes it ends up
holding for a whole tensor on N ranks; up to 3x measured for chunks, 2 -> 3 ranks). So the
writers (``Saver`` and the sharded writer) also record, for each entry of more than one block,
the CRC-32C of every block of ``rows`` rows (the last one shorter), in the manifest's
``row_blocks`` field (covered by the manifest's checksum)::

    "row_blocks": {"model/fc1.weight[0:512,0:1024]": {"rows": 16, "crc32c": [...]}}

A reader then reads the blocks that cover the rows it needs, checks each, and copies its rows
out of them. An entry not listed (a small one, or a checkpoint written before the field
existed, or a memory-tier snapshot, restored only by the rank that took it) is read whole.

The block size follows the whole tensor (not the chunk, whose size depends on the world size
that saved): ``TARGET_BLOCKS`` blocks a tensor, each between ``MIN_BLOCK_BYTES`` and
``MAX_BLOCK_BYTES`` (whole rows, at least one). A rank's range of rows of a tensor costs at
most two partial blocks more than its bytes (at its two ends; inside it, chunks start on a
block), so at most ``2 x world size / TARGET_BLOCKS`` of what it holds (6% on 4 ranks), and a
tensor adds at most ``TARGET_BLOCKS`` CRCs to the manifest however many ranks saved it (more
only past ``MAX_BLOCK_BYTES`` a block: 256 for 1 GiB). Entries of a single block have none
(they are read whole). The entry's own CRC is computed in the same pass (each block checked
twice while in the cache).

TF name: none (TF's bundles checksum whole tensors, or slices as saved).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import crc32c

from torchsupervisor.checkpoint.entries import TensorEntry
from torchsupervisor.errors import ManifestError

__all__ = [
    "MAX_BLOCK_BYTES",
    "MIN_BLOCK_BYTES",
    "ROW_BLOCKS_KEY",
    "TARGET_BLOCKS",
    "BlockCheck",
    "RowBlocks",
    "block_rows",
    "chunk_checksums",
    "covering",
    "parse_row_blocks",
    "row_blocks_field",
    "shard_checksums",
]

TARGET_BLOCKS = 128
"""Blocks a chunk is cut into, where the bounds below allow."""
MIN_BLOCK_BYTES = 4 << 10
MAX_BLOCK_BYTES = 4 << 20

ROW_BLOCKS_KEY = "row_blocks"
"""The manifest's field of blocks (``row_blocks_field``, ``parse_row_blocks``)."""

RowBlocks = tuple[int, tuple[int, ...]]
"""``(rows, crcs)``: the rows of a block (the last may be shorter), and each block's CRC-32C."""


def block_rows(shape: Sequence[int], itemsize: int, tensor_bytes: int | None = None) -> int | None:
    """Rows per block for a chunk of ``shape`` and element size ``itemsize`` (bytes) of a
    tensor of ``tensor_bytes`` (None: the chunk is the whole tensor); None when the chunk is
    not cut (a scalar, no bytes, or a single block)."""
    if not shape or not shape[0]:
        return None
    row_bytes = itemsize
    for d in shape[1:]:
        row_bytes *= d
    if not row_bytes:
        return None
    total = row_bytes * shape[0] if tensor_bytes is None else tensor_bytes
    block = min(MAX_BLOCK_BYTES, max(MIN_BLOCK_BYTES, total // TARGET_BLOCKS))
    rows = max(1, block // row_bytes)
    return rows if rows < shape[0] else None


def chunk_checksums(
    data: memoryview, entry: TensorEntry, tensor_bytes: int | None = None
) -> tuple[int, RowBlocks | None]:
    """The CRC-32C of one chunk's bytes ``data`` (laid out as ``entry`` says, of a tensor of
    ``tensor_bytes``: ``block_rows``), and its blocks', in one pass."""
    rows = block_rows(entry.shape, entry.dtype.itemsize, tensor_bytes)
    if rows is None:
        return crc32c.crc32c(data), None
    step = rows * (len(data) // entry.shape[0])
    whole = 0
    crcs = []
    for start in range(0, len(data), step):
        piece = data[start : start + step]
        crcs.append(crc32c.crc32c(piece))
        whole = crc32c.crc32c(piece, whole)
    return whole, (rows, tuple(crcs))


def shard_checksums(
    data: memoryview,
    entries: Sequence[tuple[str, TensorEntry]],
    tensor_bytes: Mapping[str, int] | None = None,
) -> tuple[list[int], list[RowBlocks | None]]:
    """``chunk_checksums`` of each entry of a shard whose data (after its header) is
    ``data``, in the order of ``entries``: the CRCs, and the blocks (None: read whole).
    ``tensor_bytes``: the bytes of the whole tensor each entry is a chunk of, by entry name
    (missing: the chunk is taken as the whole tensor)."""
    totals = tensor_bytes or {}
    crcs: list[int] = []
    blocks: list[RowBlocks | None] = []
    for name, e in entries:
        crc, block = chunk_checksums(data[e.begin : e.end], e, totals.get(name))
        crcs.append(crc)
        blocks.append(block)
    return crcs, blocks


def row_blocks_field(blocks: Mapping[str, RowBlocks]) -> dict[str, dict[str, object]]:
    """The manifest's ``row_blocks`` field (JSON values) for ``{entry name: (rows, crcs)}``."""
    return {
        name: {"rows": rows, "crc32c": list(crcs)} for name, (rows, crcs) in sorted(blocks.items())
    }


def parse_row_blocks(raw: object, tensors: Mapping[str, TensorEntry]) -> dict[str, RowBlocks]:
    """Parse the manifest's ``row_blocks`` field against its table ``tensors``: each names an
    entry with rows, a block of at least one row, and one CRC-32C (a 32-bit integer) for each
    block of the entry's rows.

    Raises:
        ManifestError: Naming the field and the entry, for anything else.
    """
    if not isinstance(raw, dict):
        raise ManifestError(f"{ROW_BLOCKS_KEY} is not an object")
    out: dict[str, RowBlocks] = {}
    for name, spec in raw.items():
        entry = tensors.get(name)
        if entry is None or not entry.shape:
            raise ManifestError(f"{ROW_BLOCKS_KEY} names {name!r}, not a tensor with rows")
        if not isinstance(spec, dict):
            raise ManifestError(f"{ROW_BLOCKS_KEY} of {name!r} is not an object")
        rows, crcs = spec.get("rows"), spec.get("crc32c")
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
            raise ManifestError(f"{ROW_BLOCKS_KEY} of {name!r}: rows must be at least 1")
        if (
            not isinstance(crcs, list)
            or len(crcs) != -(-entry.shape[0] // rows)
            or not all(isinstance(c, int) and not isinstance(c, bool) for c in crcs)
            or not all(0 <= c < 1 << 32 for c in crcs)
        ):
            raise ManifestError(
                f"{ROW_BLOCKS_KEY} of {name!r}: expected one 32-bit CRC for each block of "
                f"{rows} of its {entry.shape[0]} rows"
            )
        out[name] = (rows, tuple(crcs))
    return out


def covering(blocks: RowBlocks, first_row: int, end_row: int, num_rows: int) -> tuple[int, int]:
    """The blocks ``[b0, b1)`` that hold the rows ``[first_row, end_row)`` of a chunk of
    ``num_rows`` rows."""
    rows = blocks[0]
    return first_row // rows, min(len(blocks[1]), -(-end_row // rows)) if end_row else 0


class BlockCheck:
    """Checks the blocks of rows of a shard's entries as their bytes go by, in order
    (``CheckpointReader.verify``: a checkpoint it passes restores at any world size).

    Args:
        entries: The entries read, ``(name, entry)``.
        blocks: The manifest's ``row_blocks``; entries without blocks are not followed.
    """

    def __init__(
        self, entries: Sequence[tuple[str, TensorEntry]], blocks: Mapping[str, RowBlocks]
    ) -> None:
        self._follow: dict[str, list[int]] = {}  # name: [block bytes, at, crc, block index]
        self._crcs: dict[str, tuple[int, ...]] = {}
        self._sizes: dict[str, int] = {}
        for name, e in entries:
            found = blocks.get(name)
            if found is not None and e.shape and e.shape[0]:
                self._follow[name] = [found[0] * (e.nbytes // e.shape[0]), 0, 0, 0]
                self._crcs[name], self._sizes[name] = found[1], e.nbytes
        self.damaged: list[str] = []
        """The entries one of whose blocks did not match, each once."""

    def feed(self, name: str, view: memoryview) -> None:
        """The next bytes of entry ``name`` (its pieces in order)."""
        state = self._follow.get(name)
        if state is None:
            return
        step, at, crc, index = state
        while view:
            take = min(len(view), step - at % step)
            crc = crc32c.crc32c(view[:take], crc)
            at, view = at + take, view[take:]
            if at % step == 0 or at == self._sizes[name]:
                if crc != self._crcs[name][index] and name not in self.damaged:
                    self.damaged.append(name)
                crc, index = 0, index + 1
        state[:] = [step, at, crc, index]
