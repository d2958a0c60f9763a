"""Step-boundary snapshots: the state copied into reusable host staging buffers.

``Stager.stage`` is the only part of a checkpoint that runs on the training thread. It flattens
the state, plans the shard layout, and copies every tensor into one staging buffer per shard.
Each buffer already holds the shard's safetensors header followed by the tensor bytes, so the
background writer persists a shard with a single write from the buffer.

Buffers are allocated once and reused by the next snapshot of the same layout (same names,
dtypes and shapes); they are pinned when the state lives on a GPU, and the device-to-host copies
are fenced before ``stage`` returns, so the snapshot never mixes two steps.

Tensors that did not change since the last committed checkpoint (``incremental.py``) are not
copied: the snapshot records a reference to their committed bytes instead. Only tensors the
caller declares reusable (frozen ones, ``state.flatten_state(frozen=...)``) have their version
counter recorded, so only they can be referenced by a later snapshot.
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import crc32c
import torch

from torchsupervisor.checkpoint.format import (
    DATA_ALIGNMENT_BYTES,
    TensorEntry,
    dtype_to_code,
)
from torchsupervisor.checkpoint.incremental import Committed, is_unchanged, tensor_version
from torchsupervisor.checkpoint.row_blocks import RowBlocks, shard_checksums
from torchsupervisor.checkpoint.shard_header import safetensors_header
from torchsupervisor.storage.local import DIRECT_IO_ALIGNMENT

__all__ = [
    "CopyDone",
    "Layout",
    "ShardLayout",
    "Snapshot",
    "Stager",
    "StagingBuffers",
    "plan_layout",
]

_foreach_copy = getattr(torch, "_foreach_copy_", None)  # A private op (torch 2.1 and later).


@dataclass(frozen=True)
class ShardLayout:
    """One shard: its tensors in file order (offsets relative to the data) and its header."""

    entries: tuple[tuple[str, TensorEntry], ...]
    header: bytes

    @property
    def data_offset(self) -> int:
        """Where the tensor data starts in the file, in bytes (the header's length)."""
        return len(self.header)

    @property
    def size_bytes(self) -> int:
        """The size of the shard file in bytes."""
        return len(self.header) + (self.entries[-1][1].end if self.entries else 0)


@dataclass(frozen=True)
class Layout:
    """Where every tensor goes: shards in order; equal layouts can share staging buffers."""

    shards: tuple[ShardLayout, ...]

    @property
    def size_bytes(self) -> int:
        """The total size of all shard files in bytes."""
        return sum(s.size_bytes for s in self.shards)


def plan_layout(
    tensors: dict[str, torch.Tensor],
    max_shard_bytes: int | None = None,
    *,
    tail: Collection[str] = (),
    header_spare: int = 0,
) -> Layout:
    """Assign every tensor a shard and a byte range.

    The data section starts 64-byte aligned and has no gaps (safetensors allows none), so the
    order alone aligns the tensors: first those whose size is a whole number of 64-byte lines,
    each of which then starts on a line, then the others by decreasing item size, each aligned
    for its dtype; by name within each. A 4-byte tensor among the large ones (Adam's ``step``)
    would otherwise shift every tensor after it off its cache lines, and a copy into a
    misaligned destination is slower (here, 13.5 ms instead of 10 ms for 48 MB on one thread).
    A new shard starts when adding a tensor would exceed ``max_shard_bytes`` (None: a single
    shard); one tensor is never split.

    Args:
        tensors: The flat tensor table.
        max_shard_bytes: See above.
        tail: Tensors placed after all the others, from a 64-byte boundary:
            the staging of a sharded save, whose other tensors' bytes are written in place
            (``sharded.writer``) while these (replicated, written by one rank) are copied.
        header_spare: With a value above 0, each header keeps at least this many bytes of
            padding and its length is a multiple of ``DIRECT_IO_ALIGNMENT``, so that a header
            with longer names can take its place and the data stay aligned for direct I/O.

    Raises:
        TypeError: If a tensor's dtype has no safetensors code (``complex128``, say), naming
            the tensor's state path and the dtype.
    """
    tail = set(tail)
    order = sorted(tensors, key=lambda n: (n in tail, *_placement(tensors[n]), n))
    groups: list[list[tuple[str, TensorEntry]]] = [[]]
    offset = 0
    for name in order:
        t = tensors[name]
        try:
            dtype_to_code(t.dtype)  # Fails early, on the training thread.
        except ValueError as e:
            raise TypeError(f"Cannot save {name!r}: {e}") from None
        nbytes = t.numel() * t.dtype.itemsize
        if max_shard_bytes is not None and groups[-1] and offset + nbytes > max_shard_bytes:
            groups.append([])
            offset = 0
        if name in tail and groups[-1] and groups[-1][-1][0] not in tail:
            offset = -(-offset // DATA_ALIGNMENT_BYTES) * DATA_ALIGNMENT_BYTES
        entry = TensorEntry(
            shard=len(groups) - 1,
            dtype=t.dtype,
            shape=tuple(t.shape),
            begin=offset,
            end=offset + nbytes,
        )
        groups[-1].append((name, entry))
        offset += nbytes
    if header_spare > 0:
        spare = {"spare": header_spare, "alignment": DIRECT_IO_ALIGNMENT}
        headers = [safetensors_header(group, **spare) for group in groups]
    else:
        headers = [safetensors_header(group) for group in groups]
    return Layout(tuple(ShardLayout(tuple(g), h) for g, h in zip(groups, headers)))


def _placement(tensor: torch.Tensor) -> tuple[bool, int]:
    """Where a tensor goes in a shard (``plan_layout``): whole 64-byte lines first, then by
    decreasing item size."""
    nbytes = tensor.numel() * tensor.dtype.itemsize
    return (nbytes == 0 or nbytes % DATA_ALIGNMENT_BYTES != 0, -tensor.dtype.itemsize)


class StagingBuffers(Protocol):
    """Where a ``Stager`` takes its host buffers from, instead of ordinary host memory: files
    of the memory tier mapped in memory (``storage.slots.SlotFiles``)."""

    def allocate(self, size_bytes: int) -> torch.Tensor:
        """A new uint8 buffer of ``size_bytes`` (> 0)."""
        ...

    def reusable(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` may be copied into now."""
        ...

    def retired(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` will never be copied into again (the stager drops it)."""
        ...


class CopyDone(Protocol):
    """Marks when the copies queued on a device stream are done (``torch.cuda.Event``)."""

    def synchronize(self) -> None: ...


@dataclass(frozen=True, eq=False)
class Snapshot:
    """An immutable copy of the state at one step, ready to be persisted.

    Attributes:
        step: The global step it was taken at (None when there is no global step).
        wall_time: When it was taken, in seconds since the epoch.
        tree: The state's skeleton (``state.flatten_state``: tensor references and immutable
            values in new containers), encoded for the manifest on the writer thread.
        layout: The shard layout of the copied tensors.
        buffers: One uint8 host tensor per shard: header + tensor data, the exact file bytes.
        sources: For each copied tensor, the live tensor and its version counter at the copy
            (None for a tensor without one, or one that is not reusable: a later snapshot
            never references it); for a reusable one, a detached alias of the memory copied.
        references: Tensors not copied because they are unchanged since they were committed.
        views: Every copied tensor as a host tensor over its staging buffer, made once per
            buffer set (``tensors``).
        copies: For a snapshot of device tensors staged with ``wait=False``, the events that
            mark the end of its copies (one per device; ``torch.cuda.Event``); the buffers
            hold the state only after ``wait_copied()``. Empty otherwise.
    """

    step: int | None
    wall_time: float
    tree: object
    layout: Layout
    buffers: tuple[torch.Tensor, ...]
    sources: dict[str, tuple[torch.Tensor, int | None]] = field(default_factory=dict)
    references: dict[str, Committed] = field(default_factory=dict)
    views: Mapping[str, torch.Tensor] = field(default_factory=dict)
    copies: tuple[CopyDone, ...] = ()

    def wait_copied(self) -> None:
        """Block until the device-to-host copies into the buffers are done (the writer thread,
        before it reads them); at once for a snapshot of host tensors."""
        for event in self.copies:
            event.synchronize()

    def shard_view(self, shard: int) -> memoryview:
        """Return the bytes of shard ``shard`` (a view on its staging buffer, no copy)."""
        return memoryview(self.buffers[shard].numpy()).cast("B")

    def checksummed(
        self,
        shard: int,
        entries: list[tuple[str, TensorEntry]] | None = None,
        *,
        row_blocks: bool = False,
    ) -> tuple[list[tuple[str, TensorEntry]], dict[str, RowBlocks]]:
        """Return the entries of shard ``shard`` (all, or the given ones of it, by name) with
        the CRC-32C of each tensor's bytes in its staging buffer (``crc32c`` set), and, when
        ``row_blocks``, the CRC-32C of each larger tensor's blocks of rows, by name (computed
        in the same pass: ``row_blocks.shard_checksums``; else empty)."""
        if entries is None:
            entries = self.layout.shards[shard].entries
        data = self.shard_view(shard)[self.layout.shards[shard].data_offset :]
        blocks: dict[str, RowBlocks] = {}
        if row_blocks:
            crcs, found = shard_checksums(data, entries)
            blocks = {name: b for (name, _), b in zip(entries, found) if b is not None}
        else:
            crcs = [crc32c.crc32c(data[e.begin : e.end]) for _, e in entries]
        return [(name, e.with_fields(crc32c=crc)) for (name, e), crc in zip(entries, crcs)], blocks

    def tensors(self) -> dict[str, torch.Tensor]:
        """Return every copied tensor as a host tensor over its staging buffer (no copy).

        Valid until the snapshot is released; references (``references``) are not included.
        """
        return dict(self.views)


def _entry_view(buffer: torch.Tensor, data_offset: int, entry: TensorEntry) -> torch.Tensor:
    """One tensor of a shard's staging buffer, as a tensor of its dtype and shape (no copy)."""
    data = buffer[data_offset + entry.begin : data_offset + entry.end]
    return data.view(entry.dtype).view(entry.shape)


def _aligned_empty(size_bytes: int, pin: bool) -> torch.Tensor:
    """A uint8 host buffer whose first byte is aligned for direct I/O."""
    raw = torch.empty(size_bytes + DIRECT_IO_ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
    offset = -raw.data_ptr() % DIRECT_IO_ALIGNMENT
    return raw[offset : offset + size_bytes]


@dataclass(frozen=True, eq=False)
class _Staging:
    """Staging buffers for one layout, with a destination view per tensor."""

    signature: tuple[Any, ...]
    layout: Layout
    buffers: tuple[torch.Tensor, ...]
    destinations: tuple[tuple[str, torch.Tensor], ...]
    views: dict[str, torch.Tensor]  # The destinations, and the tensors of no bytes.

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The destinations' names, in order."""
        return tuple(name for name, _ in self.destinations)

    @functools.cached_property
    def targets(self) -> tuple[torch.Tensor, ...]:
        """The destinations' tensors, in order."""
        return tuple(dst for _, dst in self.destinations)

    @classmethod
    def allocate(
        cls,
        signature: tuple[Any, ...],
        layout: Layout,
        pin: bool,
        source: StagingBuffers | None = None,
    ) -> _Staging:
        buffers = []
        destinations = []
        views = {}
        for shard_layout in layout.shards:
            if source is not None and not pin and shard_layout.size_bytes:
                buffer = source.allocate(shard_layout.size_bytes)
            else:
                buffer = _aligned_empty(shard_layout.size_bytes, pin)
            base = shard_layout.data_offset
            header = torch.frombuffer(bytearray(shard_layout.header), dtype=torch.uint8)
            buffer[:base].copy_(header)
            for name, entry in shard_layout.entries:
                if entry.end > entry.begin:
                    views[name] = _entry_view(buffer, base, entry)
                    destinations.append((name, views[name]))
                else:
                    views[name] = torch.empty(entry.shape, dtype=entry.dtype)
            buffers.append(buffer)
        return cls(signature, layout, tuple(buffers), tuple(destinations), views)


_is_cpu = operator.attrgetter("is_cpu")


def _source(tensor: torch.Tensor, reusable: bool) -> tuple[torch.Tensor, int | None]:
    """What a snapshot records of a copied tensor: for a reusable one, an alias of the very
    memory copied (detached: a later ``.data =`` on a live parameter gives it other memory
    without a version-counter bump, which the alias's address then tells) and its version."""
    if not reusable:
        return tensor, None
    return tensor.detach(), tensor_version(tensor)


def _signature(tensors: dict[str, torch.Tensor], *options: object) -> tuple[Any, ...]:
    return (*options, *((n, t.dtype, t.shape) for n, t in tensors.items()))


def _copy_from_devices(
    destinations: Iterable[tuple[str, torch.Tensor]],
    tensors: Mapping[str, torch.Tensor],
    *,
    wait: bool,
) -> tuple[CopyDone, ...]:
    """Copy device tensors into (pinned) host buffers; return the events that mark the end of
    the CUDA copies (none when ``wait``: they are waited for here, device by device).

    A CUDA copy is queued on the current stream of its source's device, after the work that
    produced the value and before the work queued later; an event recorded on each of those
    streams marks its end. No device-wide ``torch.cuda.synchronize()``: only the streams the
    copies were queued on are waited for, and with ``wait=False`` not even those (the writer
    thread waits, in ``Snapshot.wait_copied``). Other devices (MPS, XPU) copy blocking.
    """
    devices: dict[torch.device, None] = {}
    for name, dst in destinations:
        source = tensors[name]
        cuda = source.device.type == "cuda"
        dst.copy_(source, non_blocking=cuda)
        if cuda:
            devices[source.device] = None
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    if wait:
        for event in events:
            event.synchronize()
        return ()
    return tuple(events)


class Stager:
    """Copies the state into host staging buffers that are reused between snapshots.

    The layout (shard assignment, offsets, safetensors headers) and the buffers are computed
    once per state structure (names, dtypes, shapes) and reused while it does not change, so a
    snapshot costs little more than copying the bytes.

    With ``buffers`` (the memory tier's ``SlotFiles``), the buffers come from there, and a
    released buffer set is staged into again only once ``buffers`` says it may be (a slot
    file is not while it is a committed snapshot's data file); the sets that may not are kept
    for later, those retired dropped. A state on a GPU stages into pinned memory as always.

    Thread safety: ``stage`` runs on the training thread; ``release`` may be called from the
    writer thread. A buffer set is never handed out twice before it is released.

    Args:
        buffers: Where the host buffers come from; None: ordinary (or pinned) host memory,
            one buffer set kept for the next snapshot.
    """

    _MAX_KEPT = 8  # Buffer sets kept waiting to be reusable (``buffers``): more are dropped.

    def __init__(self, buffers: StagingBuffers | None = None) -> None:
        self._lock = threading.Lock()
        self._buffers = buffers
        self._free: list[_Staging] = []
        self._in_use: dict[int, _Staging] = {}

    def stage(
        self,
        tree: object,
        tensors: dict[str, torch.Tensor],
        *,
        step: int | None,
        wall_time: float,
        max_shard_bytes: int | None = None,
        committed: Mapping[str, Committed] | None = None,
        reusable: Collection[str] | None = None,
        tail: Collection[str] = (),
        header_spare: int = 0,
        keep_sources: bool = True,
        layout_key: Any = None,
        wait: bool = True,
    ) -> Snapshot:
        """Copy ``tensors`` into staging buffers and return the snapshot.

        Args:
            tree: The state's skeleton (free of references to live objects).
            tensors: The flat tensor table of the state (any device; tensors that require
                gradients are read under ``no_grad``).
            step: The global step of the snapshot.
            wall_time: The snapshot time in seconds since the epoch.
            max_shard_bytes: See ``plan_layout``.
            committed: Where tensors of earlier checkpoints were committed; those unchanged
                since are referenced instead of copied. None: copy everything.
            reusable: The tensors a later snapshot may reference if they stay unchanged
                (their version counters are recorded); the others are copied every time.
                None: every tensor.
            tail, header_spare: See ``plan_layout`` (a sharded save's staging).
            keep_sources: Record each tensor and its version counter in ``sources`` (for a
                later incremental snapshot); False: ``sources`` stays empty.
            layout_key: What the tensors' names, dtypes and shapes are, where the caller
                knows it more cheaply than by reading them: equal for two calls exactly when
                those are equal. None: they are read from ``tensors``.
            wait: Return once the copies of CUDA tensors are done. False: return once they are
                queued, on the current stream of each tensor's device, after the work queued
                there before (which is what makes the state's values final); the snapshot's
                ``copies`` events mark their end and its reader calls ``wait_copied()``
                first. Later work on those streams (the next step's kernels) runs after the
                copies, so it cannot change what they read. Other devices are always waited
                for.

        Returns:
            A snapshot whose buffers hold the exact bytes of the shard files (with ``tail``,
            the bytes of the other tensors, and the tail's tensors after a gap).
        """
        references: dict[str, Committed] = {}
        if committed:
            for name, tensor in tensors.items():
                previous = committed.get(name)
                if previous is not None and is_unchanged(tensor, previous):
                    references[name] = previous
            if references:
                tensors = {n: t for n, t in tensors.items() if n not in references}
        sources = (
            {name: _source(t, reusable is None or name in reusable) for name, t in tensors.items()}
            if keep_sources
            else {}
        )
        on_gpu = not all(map(_is_cpu, tensors.values()))  # Not ``device``: a new object each.
        options = (max_shard_bytes, tuple(sorted(tail)), header_spare)
        if layout_key is None:
            signature = _signature(tensors, *options)
        else:
            signature = (*options, layout_key)
        staging = self._take(signature, tensors, options, on_gpu)
        copies: tuple[CopyDone, ...] = ()
        with torch.no_grad():  # The tensors may be live parameters.
            if on_gpu:
                copies = _copy_from_devices(staging.destinations, tensors, wait=wait)
            elif _foreach_copy is None:
                for name, dst in staging.destinations:
                    dst.copy_(tensors[name])
            elif staging.destinations:
                # One call for every copy: 0.7 us a tensor instead of 1.8 (a state of 1600
                # tensors: 1.1 ms instead of 2.9, before the bytes).
                _foreach_copy(list(staging.targets), [tensors[name] for name in staging.names])
        snapshot = Snapshot(
            step,
            wall_time,
            tree,
            staging.layout,
            staging.buffers,
            sources,
            references,
            staging.views,
            copies,
        )
        with self._lock:
            self._in_use[id(snapshot)] = staging
        return snapshot

    def release(self, snapshot: Snapshot) -> None:
        """Give a persisted snapshot's buffers back for reuse by the next snapshot (once the
        device copies into them are done: a save given up before it waited for them)."""
        snapshot.wait_copied()
        with self._lock:
            staging = self._in_use.pop(id(snapshot), None)
            if staging is None:
                return
            if self._buffers is None:
                self._free = [staging]
            else:
                self._free = [*self._free, staging][-self._MAX_KEPT :]

    def clear(self) -> None:
        """Drop the buffer sets kept for the next snapshot (their memory is freed with the
        last snapshot using them)."""
        with self._lock:
            self._free = []

    def _take(
        self,
        signature: tuple[Any, ...],
        tensors: dict[str, torch.Tensor],
        options: tuple[int | None, tuple[str, ...], int],
        on_gpu: bool,
    ) -> _Staging:
        source = self._buffers
        with self._lock:
            if source is None:
                free, self._free = self._free, []
                if free and free[0].signature == signature:
                    return free[0]
            else:
                self._free = [s for s in self._free if not any(map(source.retired, s.buffers))]
                for i, staging in enumerate(self._free):
                    if staging.signature == signature and all(
                        map(source.reusable, staging.buffers)
                    ):
                        return self._free.pop(i)
        max_shard_bytes, tail, header_spare = options  # The layout's, as given to ``stage``.
        layout = plan_layout(tensors, max_shard_bytes, tail=tail, header_spare=header_spare)
        pin = on_gpu and torch.cuda.is_available()
        return _Staging.allocate(signature, layout, pin, source)
