"""``ShardedStorageReader``: DCP's storage half of a sharded restore, from our format.

It rebuilds DCP's metadata from the manifest's JSON (``to_dcp_metadata``); then every rank
reads the chunks that overlap its local shards, each one verified against its CRC-32C, so
that any world size restores any checkpoint of the format (DCP's planner reshards). Of a chunk
with blocks of rows (``row_blocks``) a rank that needs only some of its rows (a restore at
another world size) reads only the blocks that hold them, each verified against its own
CRC-32C: about the bytes it ends up holding, not every chunk it overlaps whole.
"""

from __future__ import annotations

import os
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from torchsupervisor.checkpoint.row_blocks import RowBlocks, covering
from torchsupervisor.checkpoint.shard_io import check_shard, open_shard
from torchsupervisor.checkpoint.sharded.common import BoundToPrefix, RememberErrors, chunk_key
from torchsupervisor.checkpoint.sharded.metadata import (
    ShardedManifest,
)
from torchsupervisor.errors import CorruptCheckpointError
from torchsupervisor.storage import BY_PATH, Readable, Storage, read_exactly

__all__ = ["ShardedStorageReader", "to_dcp_metadata"]


def to_dcp_metadata(manifest: ShardedManifest) -> Metadata:
    """Return DCP's ``Metadata`` for a manifest: every tensor's dtype, shape and chunks."""
    state: dict[str, Any] = {}
    for name, (dtype, shape) in manifest.tensor_specs().items():
        state[name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
            chunks=[
                ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                for c in manifest.chunks_of(name)
            ],
        )
    return Metadata(state_dict_metadata=state)


class ShardedStorageReader(BoundToPrefix, StorageReader, RememberErrors):
    """Read a checkpoint of our format for ``torch.distributed.checkpoint.load``.

    DCP calls, in this order:

    1. (all ranks) ``read_metadata``: DCP's metadata rebuilt from the manifest's JSON (none,
       after an error found before the load);
    2. (all ranks) ``set_up_storage_reader``;
    3. (all ranks) ``prepare_local_plan``: raise the error found before the load, if any (DCP
       sends an error of this step to every rank as it is; one of ``read_metadata`` it
       wraps in an ``AssertionError``); (coordinator) ``prepare_global_plan``: unchanged;
    4. (all ranks) ``read_data``: read each chunk the plan needs once, verify its CRC-32C,
       and copy the parts that overlap the local destinations into them.

    Args:
        prefix: The checkpoint prefix.
        manifest: Its parsed manifest (None only together with ``error``).
        storage: Where the checkpoints live (tests inject faults here).
        error: An error this rank found before the load (raised in step 3 so that every rank
            learns of it).

    Attributes:
        error: The exception this rank raised, if any.

    Thread safety: one load per instance, on one thread.
    Distributed: every rank of the group makes its own instance for the same prefix.
    """

    def __init__(
        self,
        prefix: str,
        manifest: ShardedManifest | None,
        *,
        storage: Storage = BY_PATH,
        error: BaseException | None = None,
    ) -> None:
        self._prefix = prefix
        self._dir = os.path.dirname(prefix)
        self._manifest = manifest
        self._storage = storage
        self._pending = error
        self.error = None

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        """Return DCP's metadata of the checkpoint (empty after an earlier error)."""
        with self._remembering():
            if self._pending is not None:
                return Metadata(state_dict_metadata={})  # ``prepare_local_plan`` raises it.
            assert self._manifest is not None
            return to_dcp_metadata(self._manifest)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: object, **kwargs: object
    ) -> None:
        """Nothing to set up."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Return ``plan`` unchanged, or raise this rank's earlier error."""
        with self._remembering():
            if self._pending is not None:
                raise self._pending
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Return ``plans`` unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the chunks ``plan`` needs, shard by shard, verifying each one's CRC-32C.

        Raises:
            CorruptCheckpointError: Naming the shard file, for a missing or truncated file,
                a chunk whose bytes do not match its checksum, or a damaged header
                (``reader.check_shard``).
        """
        with self._remembering():
            assert self._manifest is not None
            entry_of = {
                (name, c.offsets): c.entry
                for name in self._manifest.tensor_specs()
                for c in self._manifest.chunks_of(name)
            }
            wanted: dict[str, list[Any]] = {}
            for item in plan.items:
                if item.type != LoadItemType.TENSOR:
                    raise TypeError(f"{item.dest_index.fqn!r} is not a tensor in {self._prefix}")
                wanted.setdefault(entry_of[chunk_key(item.storage_index)], []).append(item)
            by_shard: dict[int, list[str]] = {}
            for name in wanted:
                by_shard.setdefault(self._manifest.tensors[name].shard, []).append(name)
            for shard_index, names in sorted(by_shard.items()):
                names.sort(key=lambda n: self._manifest.tensors[n].begin)
                with self._open_shard(shard_index) as f:
                    for name in names:
                        self._load_chunk(f, shard_index, name, wanted[name], planner)
                    check_shard(
                        f,
                        self._manifest.shards[shard_index],
                        {},
                        [(n, self._manifest.tensors[n]) for n in names],
                    )
            future: Future[None] = Future()
            future.set_result(None)
            return future

    def _shard_path(self, shard_index: int) -> str:
        assert self._manifest is not None
        return os.path.join(self._dir, self._manifest.shards[shard_index].file)

    def _open_shard(self, shard_index: int) -> Any:
        assert self._manifest is not None
        path = self._shard_path(shard_index)
        expected = self._manifest.shards[shard_index].size_bytes
        return open_shard(path, expected, self._storage, directory=self._dir)

    def _load_chunk(
        self, f: Readable, shard_index: int, name: str, items: list[Any], planner: LoadPlanner
    ) -> None:
        assert self._manifest is not None
        entry = self._manifest.tensors[name]
        offset = self._manifest.shards[shard_index].data_offset + entry.begin
        path = self._shard_path(shard_index)
        blocks = self._manifest.row_blocks.get(name)
        if blocks is not None:
            first = min(item.storage_offsets[0] for item in items)
            end = max(item.storage_offsets[0] + item.lengths[0] for item in items)
            b0, b1 = covering(blocks, first, end, entry.shape[0])
            if b1 - b0 < len(blocks[1]):  # Only some rows: only their blocks.
                self._load_rows(f, path, offset, name, items, planner, blocks, b0, b1)
                return
        # Read straight into the destination when it wants the whole chunk as it is stored.
        direct = None
        if len(items) == 1 and tuple(items[0].lengths) == entry.shape:
            target = planner.resolve_tensor(items[0]).detach()
            if (
                target.dtype == entry.dtype
                and target.device.type == "cpu"
                and target.is_contiguous()
                and type(target) is torch.Tensor
            ):
                direct = target
        chunk = direct if direct is not None else torch.empty(entry.shape, dtype=entry.dtype)
        raw = chunk.reshape(-1).view(torch.uint8) if chunk.numel() else None
        crc = 0
        if raw is not None:
            view = memoryview(raw.numpy())
            try:
                read_exactly(f, view, offset)
            except EOFError:
                raise CorruptCheckpointError(
                    f"Checkpoint shard {path} is truncated", path=path, reason="truncated"
                ) from None
            crc = crc32c.crc32c(view)
        if crc != entry.crc32c:
            raise CorruptCheckpointError(
                f"Checkpoint shard {path} is corrupt: checksum mismatch (damaged chunk: {name})",
                path=path,
                reason="checksum mismatch",
            )
        if direct is not None:
            planner.commit_tensor(items[0], direct)
            return
        for item in items:
            source = chunk[
                tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
            ]
            target = planner.resolve_tensor(item).detach()
            target.copy_(source)
            planner.commit_tensor(item, target)

    def _load_rows(
        self,
        f: Readable,
        path: str,
        offset: int,
        name: str,
        items: list[Any],
        planner: LoadPlanner,
        blocks: RowBlocks,
        b0: int,
        b1: int,
    ) -> None:
        """Read the blocks ``[b0, b1)`` of chunk ``name`` (at ``offset`` of the file), check
        each against its CRC-32C, and copy the items' rows out of them."""
        assert self._manifest is not None
        entry = self._manifest.tensors[name]
        rows, crcs = blocks
        first, end = b0 * rows, min(b1 * rows, entry.shape[0])
        part = torch.empty((end - first, *entry.shape[1:]), dtype=entry.dtype)
        view = memoryview(part.reshape(-1).view(torch.uint8).numpy())
        row_bytes = len(view) // (end - first)
        try:
            read_exactly(f, view, offset + first * row_bytes)
        except EOFError:
            raise CorruptCheckpointError(
                f"Checkpoint shard {path} is truncated", path=path, reason="truncated"
            ) from None
        step = rows * row_bytes
        for i, start in enumerate(range(0, len(view), step)):
            if crc32c.crc32c(view[start : start + step]) != crcs[b0 + i]:
                raise CorruptCheckpointError(
                    f"Checkpoint shard {path} is corrupt: checksum mismatch (damaged chunk: "
                    f"{name}, rows {first + i * rows} to {min(first + (i + 1) * rows, end) - 1})",
                    path=path,
                    reason="checksum mismatch",
                )
        for item in items:
            o0, n0 = item.storage_offsets[0], item.lengths[0]
            source = part[
                (
                    slice(o0 - first, o0 - first + n0),
                    *(slice(o, o + n) for o, n in zip(item.storage_offsets[1:], item.lengths[1:])),
                )
            ]
            target = planner.resolve_tensor(item).detach()
            target.copy_(source)
            planner.commit_tensor(item, target)
