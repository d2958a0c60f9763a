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
"""

from __future__ import annotations

import crc32c
import torch

from torchsupervisor.checkpoint.format import TensorEntry, safetensors_header
from torchsupervisor.checkpoint.snapshot import Snapshot, _entry_view, plan_layout

__all__ = ["in_place_shard"]


def in_place_shard(
    staged: Snapshot, tensors: dict[str, torch.Tensor]
) -> tuple[list[tuple[str, TensorEntry]], bytes, list[memoryview]] | None:
    """Lay out the shard of ``tensors`` (chunk name to data) over the staging buffer.

    Args:
        staged: The host copies made at the step boundary (one staging buffer).
        tensors: What this rank's plan writes, by chunk name; each item a view of ``staged``
            or any other tensor.

    Returns:
        ``(entries, header, parts)``: the entries in file order with their CRC-32C (offsets
        relative to the data), the header (the staging buffer's own header room, rewritten),
        and the buffers to write in order. None when no part of the shard lies in place, or
        the header or the alignment does not fit: then the caller copies every chunk.
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
    # The rest, laid out by the staging's own rule (decreasing item size, then name), copied.
    rest = plan_layout({n: t for n, t in tensors.items() if n not in placed}).shards[0].entries
    if rest and end % rest[0][1].dtype.itemsize:
        return None
    entries = staged.checksummed(0, head)
    tail = torch.empty(rest[-1][1].end if rest else 0, dtype=torch.uint8)
    for name, e in rest:
        if e.end > e.begin:
            _entry_view(tail, 0, e).copy_(tensors[name])
        checksum = crc32c.crc32c(memoryview(tail[e.begin : e.end].numpy()).cast("B"))
        entries.append((name, e.with_fields(begin=end + e.begin, end=end + e.end, crc32c=checksum)))
    try:
        header = safetensors_header(entries, size=base)
    except ValueError:
        return None
    buffer[:base].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    parts = [memoryview(buffer[: base + end].numpy()).cast("B")]
    if len(tail):
        parts.append(memoryview(tail.numpy()).cast("B"))
    return entries, header, parts
