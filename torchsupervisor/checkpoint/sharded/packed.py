"""What each rank of a replayed sharded save tells the coordinator, and the tensor table the
coordinator makes of it.

A save that replays the last one's plan (``replay.PlanCache``) gathers, instead of DCP's
pickled ``WriteResult`` s, one ``PackedWrite`` per rank: the shard it wrote, each chunk's place
in it as a plain tuple, and the chunks' CRC-32C in a list of their own. Between two such saves
only the CRCs differ, so the coordinator's ``TableMemo`` keeps the manifest's table (names in
order, entries without their CRC) made from the last save's rows, and takes it again while
every rank's rows are equal: only the CRCs are put in order (``format.PackedTensors``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint.storage import WriteResult

from torchsupervisor.checkpoint.format import PackedTensors, ShardEntry, TensorEntry
from torchsupervisor.checkpoint.sharded.common import ChunkKey, chunk_key

__all__ = ["PackedWrite", "StoredChunk", "TableMemo", "packed_rows", "written_chunks"]

Row = tuple[Any, ...]
"""A chunk of a ``PackedWrite``: tensor name, chunk offsets, entry name, dtype, shape, begin,
end (a ``TensorEntry`` of the rank's shard, but for its CRC)."""


@dataclasses.dataclass(frozen=True)
class StoredChunk:
    """Where one chunk was written (a WriteResult's ``storage_data``, sent to the coordinator)."""

    shard: ShardEntry
    name: str
    entry: TensorEntry


@dataclasses.dataclass(frozen=True)
class PackedWrite:
    """One rank's written chunks as plain tuples: what a replayed save sends the coordinator.

    DCP's ``WriteResult`` s (four objects and a ``torch.Size`` a chunk) cost 3 us a chunk to
    pickle and as much to unpickle, on the coordinator for every rank's: 8 ms a save of
    1,000 tensors on 2 ranks, holding the GIL.

    Attributes:
        shard: The shard file this rank wrote (None: it wrote none).
        file_index: Its index among the shard files.
        rows: Per chunk, in file order: a ``Row`` (the same at every save of one plan).
        crcs: Per chunk, its CRC-32C.
    """

    shard: ShardEntry | None
    file_index: int | None
    rows: list[Row]
    crcs: list[int]

    def chunks(self) -> Iterator[tuple[ChunkKey, str, ShardEntry, TensorEntry]]:
        """Each chunk's key, entry name, shard and entry.

        Raises:
            ValueError: If the rows and CRCs differ in number, or there are rows but no shard.
        """
        self._check()
        shard, index = self.shard, self.file_index
        for (fqn, offsets, name, dtype, shape, begin, end), crc in zip(self.rows, self.crcs):
            yield (fqn, offsets), name, shard, TensorEntry(index, dtype, shape, begin, end, crc)

    def _check(self) -> None:
        if (
            len(self.rows) != len(self.crcs)
            or (self.shard is None) != (self.file_index is None)
            or (self.shard is None and self.rows)
        ):
            raise ValueError(
                f"a rank's write result is inconsistent: {len(self.rows)} chunks, "
                f"{len(self.crcs)} CRCs, shard {self.shard}"
            )


def packed_rows(entries: list[tuple[str, TensorEntry]], keys: dict[str, ChunkKey]) -> list[Row]:
    """The ``PackedWrite.rows`` of a shard's entries (file order), keyed by chunk name."""
    return [(*keys[name], name, e.dtype, e.shape, e.begin, e.end) for name, e in entries]


def written_chunks(
    results: list[list[WriteResult]] | list[PackedWrite],
) -> Iterator[tuple[ChunkKey, str, ShardEntry, TensorEntry]]:
    """Each chunk's key, entry name, shard and entry, from every rank's results: DCP's
    ``WriteResult`` s (a save DCP planned) or ``PackedWrite`` s (a replayed save).

    Raises:
        TypeError: For a result that is neither.
        ValueError: For an inconsistent ``PackedWrite``.
    """
    for rank_results in results:
        if isinstance(rank_results, PackedWrite):
            yield from rank_results.chunks()
            continue
        for result in rank_results:
            stored = result.storage_data
            if not isinstance(stored, StoredChunk):
                raise TypeError(f"unexpected write result for {result.index.fqn!r}")
            yield chunk_key(result.index), stored.name, stored.shard, stored.entry


@dataclasses.dataclass(frozen=True, eq=False)
class _Table:
    """The manifest's tensor table (but for the CRCs) made from the ranks' rows."""

    rows: list[tuple[int | None, list[Row]]]  # Per rank: its file index and rows.
    names: dict[ChunkKey, str]  # Each chunk's entry name, by key.
    order: list[int]  # The chunks' places among every rank's rows, by entry name.
    entry_names: list[str]  # Sorted.
    layouts: list[tuple[Any, ...]]  # In the same order: (shard, dtype, shape, begin, end).

    @classmethod
    def of(cls, rows: list[tuple[int | None, list[Row]]]) -> _Table:
        flat = [(index, row) for index, rank_rows in rows for row in rank_rows]
        order = sorted(range(len(flat)), key=lambda i: flat[i][1][2])
        entry_names = [flat[i][1][2] for i in order]
        if len(set(entry_names)) != len(entry_names):
            raise ValueError("two chunks of the save have the same entry name")
        layouts = [(flat[i][0], *flat[i][1][3:7]) for i in order]
        names = {(row[0], row[1]): row[2] for _, row in flat}
        return cls(rows, names, order, entry_names, layouts)


class TableMemo:
    """The coordinator's tensor table of the last replayed save, for the next one.

    ``table`` gives what ``ShardedStorageWriter.finish`` makes the manifest from: 1,764
    chunks of a 1,008-tensor state on 2 ranks made 1,764 ``TensorEntry`` objects and a
    sorted dict of them (about 4 ms of the coordinator's writer thread, holding the GIL);
    while every rank's rows are equal to the last save's (a pass in C over each), the
    table is the last one's, and only the CRCs are put in its order.

    Holds the last save's rows and table until the next save or ``forget``.

    Thread safety: one save at a time (the coordinator's writer thread).
    """

    def __init__(self) -> None:
        self._last: _Table | None = None

    def forget(self) -> None:
        """Drop the kept table."""
        self._last = None

    def table(
        self, results: list[PackedWrite]
    ) -> tuple[dict[int, ShardEntry], dict[ChunkKey, str], PackedTensors]:
        """The shards by file index, the chunks' entry names by key, and the tensor table.

        Raises:
            ValueError: For an inconsistent ``PackedWrite``, or two chunks of one entry name.
        """
        shards: dict[int, ShardEntry] = {}
        for packed in results:
            packed._check()
            if packed.shard is not None:
                shards[packed.file_index] = packed.shard  # type: ignore[index]
        rows = [(p.file_index, p.rows) for p in results]
        last = self._last
        if last is None or last.rows != rows:
            self._last = None  # A table that raised is not kept.
            last = self._last = _Table.of(rows)
        crcs = list(itertools.chain.from_iterable(p.crcs for p in results))
        ordered = list(map(crcs.__getitem__, last.order))
        return shards, last.names, PackedTensors(last.entry_names, last.layouts, ordered)
