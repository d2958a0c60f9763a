"""Writing a rank's shard from the host copies made at the step boundary, without a second copy.

An asynchronous sharded save copies each rank's local data into host staging buffers at the
step boundary (``staging.stage``); the shard's layout is DCP's to decide only later, when it
plans. ``staging.stage`` therefore lays the copies out as the shard will most likely be: the
sharded DTensors' local data first (each rank writes all of it), the replicated tensors after
(DCP has only one rank write each), with room in the header for the chunk names. When the
plan agrees, the shard is that staging buffer itself, under a new header: the bytes that the
rank writes from the start of the data, with no gap, are written where they lie; what comes
after (the replicated tensors this rank writes) is copied behind them. When it does not (a
replicated mesh dimension, a chunk that is not a whole local tensor), the writer copies every
chunk into a shard of its own, as before.

Either way the file is the same kind: a safetensors shard whose entries are contiguous from
the start of the data, each with its CRC-32C.

Where a chunk goes is planned once (``plan_in_place``) and written from (``InPlaceShard.write``:
the CRCs, the chunks copied behind, the header). A replayed save whose chunks are the very
same views of the very same buffer takes the last plan again (``ShardMemo``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchsupervisor.checkpoint.format import TensorEntry
from torchsupervisor.checkpoint.row_blocks import RowBlocks, shard_checksums
from torchsupervisor.checkpoint.shard_header import safetensors_header
from torchsupervisor.checkpoint.snapshot import Snapshot, _entry_view, plan_layout
from torchsupervisor.core.same_objects import Contents, contents, same_contents

__all__ = ["InPlaceShard", "ShardMemo", "in_place_shard", "plan_in_place"]

Written = tuple[list[tuple[str, TensorEntry]], bytes, list[memoryview]]
"""The entries in file order with their CRC-32C, the header, and the buffers to write."""

Entries = list[tuple[str, TensorEntry]]


@dataclass(frozen=True, eq=False)
class InPlaceShard:
    """Where each chunk of a rank's shard goes when part of it lies in the staging buffer.

    A function of the staging buffer's layout and of the chunks' dtypes, shapes and places
    in memory, not of their bytes: a later save whose chunks are the very same views of the
    very same buffer writes its shard with it again (``write``), without planning anew.

    Attributes:
        head: The chunks written where they lie, from the start of the data, in file order
            (entries of the staging buffer's layout; their CRCs are computed by ``write``).
        rest: The other chunks, copied behind the head: entries with offsets relative to
            the end of the head.
        end: Where the head ends, relative to the start of the data.
        header: The shard's header (the staging buffer's header room, rewritten).
    """

    head: Entries
    rest: Entries
    end: int
    header: bytes

    @functools.cached_property
    def entries(self) -> Entries:
        """Every chunk's entry in file order, offsets relative to the start of the data,
        without a CRC: the head, then the rest shifted behind it."""
        return self.head + _shifted(self.rest, self.end)

    def write(
        self,
        staged: Snapshot,
        tensors: dict[str, torch.Tensor],
        tensor_bytes: Mapping[str, int] | None = None,
    ) -> tuple[list[int], list[RowBlocks | None], list[memoryview]]:
        """The shard of ``tensors`` over ``staged``'s buffer: the rest copied behind the
        head, the header written into the buffer's header room.

        Args:
            staged: The snapshot this layout was planned over (``plan_in_place``), its
                buffer holding this save's bytes.
            tensors: The chunks by name, as when planned (the rest are read now).
            tensor_bytes: The bytes of the whole tensor of each chunk, by name (the size of
                its blocks of rows: ``row_blocks.block_rows``).

        Returns:
            ``(crcs, blocks, parts)``: the CRC-32C of every chunk and its blocks' (None: no
            blocks; ``row_blocks.chunk_checksums``), in the order of ``entries``, and the
            buffers to write in order (``header`` first).
        """
        base = staged.layout.shards[0].data_offset
        buffer = staged.buffers[0]
        crcs, blocks = shard_checksums(staged.shard_view(0)[base:], self.head, tensor_bytes)
        tail = torch.empty(self.rest[-1][1].end if self.rest else 0, dtype=torch.uint8)
        for name, e in self.rest:
            if e.end > e.begin:
                _entry_view(tail, 0, e).copy_(tensors[name])
        more_crcs, more_blocks = shard_checksums(
            memoryview(tail.numpy()).cast("B"), self.rest, tensor_bytes
        )
        crcs += more_crcs
        blocks += more_blocks
        buffer[:base].copy_(torch.frombuffer(bytearray(self.header), dtype=torch.uint8))
        parts = [memoryview(buffer[: base + self.end].numpy()).cast("B")]
        if len(tail):
            parts.append(memoryview(tail.numpy()).cast("B"))
        return crcs, blocks, parts


def _shifted(entries: Entries, by: int) -> Entries:
    """``entries`` with their offsets moved ``by`` bytes later."""
    return [(n, e.with_fields(begin=by + e.begin, end=by + e.end)) for n, e in entries]


def plan_in_place(staged: Snapshot, tensors: dict[str, torch.Tensor]) -> InPlaceShard | None:
    """Lay out the shard of ``tensors`` (chunk name to data) over the staging buffer.

    Args:
        staged: The host copies made at the step boundary (one staging buffer).
        tensors: What this rank's plan writes, by chunk name; each item a view of ``staged``
            or any other tensor.

    Returns:
        The layout, or None when no part of the shard lies in place, or the header or the
        alignment does not fit: then the caller copies every chunk.
    """
    if len(staged.layout.shards) != 1 or not tensors:
        return None
    layout = staged.layout.shards[0]
    buffer = staged.buffers[0]
    base = layout.data_offset
    start = buffer.data_ptr() + base
    at = {e.begin: e for _, e in layout.entries if e.end > e.begin}
    found: dict[int, str] = {}  # Begin of a staged entry -> the chunk written from it.
    for name, t in tensors.items():
        entry = at.get(t.data_ptr() - start) if t.is_cpu else None
        if (
            entry is not None
            and t.is_contiguous()
            and t.dtype == entry.dtype
            and t.shape == entry.shape
        ):
            found[entry.begin] = name
    head: list[tuple[str, TensorEntry]] = []
    end = 0
    for _, entry in layout.entries:  # The prefix of the data that this rank writes whole.
        if entry.end == entry.begin:
            continue
        name = found.get(entry.begin)
        if name is None or entry.begin != end:  # Not written here, or after the tail's gap.
            break
        head.append((name, entry))
        end = entry.end
    if not head:
        return None
    placed = {name for name, _ in head}
    # The rest, laid out by the staging's own rule (``plan_layout``), copied: aligned for
    # their dtypes if they start where the largest item size divides.
    others = {n: t for n, t in tensors.items() if n not in placed}
    rest = list(plan_layout(others).shards[0].entries)
    if rest and end % max(e.dtype.itemsize for _, e in rest):
        return None
    try:
        header = safetensors_header(head + _shifted(rest, end), size=base)  # Not of the CRCs.
    except ValueError:
        return None
    return InPlaceShard(head, rest, end, header)


def in_place_shard(staged: Snapshot, tensors: dict[str, torch.Tensor]) -> Written | None:
    """``plan_in_place`` and its ``write``: the shard of ``tensors`` over the staging buffer.

    Returns:
        ``(entries, header, parts)``: the entries in file order with their CRC-32C (offsets
        relative to the data), the header (the staging buffer's own header room, rewritten),
        and the buffers to write in order. None when no part of the shard lies in place, or
        the header or the alignment does not fit: then the caller copies every chunk.
    """
    planned = plan_in_place(staged, tensors)
    if planned is None:
        return None
    crcs, _, parts = planned.write(staged, tensors)
    entries = [(n, e.with_fields(crc32c=crc)) for (n, e), crc in zip(planned.entries, crcs)]
    return entries, planned.header, parts


@dataclass(frozen=True, eq=False)
class _Kept:
    """A shard written in place, and what its chunks and layout were derived from."""

    plan: Any  # This rank's ``SavePlan`` (compared by identity).
    table: Contents  # The staged table the chunks were resolved from.
    layout: Any  # The staging buffer's layout and the buffer (by identity).
    buffer: torch.Tensor
    tensors: dict[str, torch.Tensor]  # The chunks by name (views of the buffer, mostly).
    keys: dict[str, Any]  # Each chunk's ``(fqn, offsets)``.
    in_place: InPlaceShard
    rows: list[tuple[Any, ...]]  # The shard's ``PackedWrite.rows``.


class ShardMemo:
    """The chunks and in-place layout of this rank's last shard, for the next replayed save.

    A replayed save (``replay.PlanCache``) writes the same plan; when it also resolves its
    chunks from the very same staged table (the staging reused its DTensors over the very
    same buffer: ``staging.StageMemo``), every chunk is the same view of the same memory, so
    the chunks' names and the shard's layout and header are the last save's. Only the bytes
    differ: ``InPlaceShard.write`` checksums them (and copies the chunks written behind the
    head) again. Resolving 1,000 chunks, placing them and encoding the header cost the
    writer thread about 9 ms a save, holding the GIL beside training.

    Holds the last shard's chunks (views of a staging buffer) until the next save or
    ``forget``.

    Attributes:
        taken: How many saves took the last shard's layout (for tests and benchmarks).

    Thread safety: one save at a time (the writer thread).
    """

    def __init__(self) -> None:
        self._kept: _Kept | None = None
        self.taken = 0

    def forget(self) -> None:
        """Drop what is kept (a save planned anew, or one that failed)."""
        self._kept = None

    def take(
        self, plan: Any, table: Mapping[str, Any], staged: Snapshot | None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], InPlaceShard, list[Any]] | None:
        """The last shard's chunks, their keys, layout and rows, if ``plan`` is the last
        one's and ``table`` holds the very same staged objects over the same buffer; else
        None (and nothing is kept)."""
        kept, self._kept = self._kept, None
        if (
            kept is None
            or staged is None
            or kept.plan is not plan
            or staged.layout is not kept.layout
            or len(staged.buffers) != 1
            or staged.buffers[0] is not kept.buffer
            or not same_contents([table], kept.table)
        ):
            return None
        self._kept = kept
        self.taken += 1
        return kept.tensors, kept.keys, kept.in_place, kept.rows

    def keep(
        self,
        plan: Any,
        table: Mapping[str, Any],
        staged: Snapshot,
        tensors: dict[str, torch.Tensor],
        keys: dict[str, Any],
        in_place: InPlaceShard,
        rows: list[tuple[Any, ...]],
    ) -> None:
        """Keep a shard just laid out from ``plan``'s chunks, resolved from ``table``, and
        its rows (``packed.PackedWrite.rows``: a function of ``keys`` and ``in_place``)."""
        self._kept = _Kept(
            plan,
            contents([table]),
            staged.layout,
            staged.buffers[0],
            tensors,
            keys,
            in_place,
            rows,
        )
