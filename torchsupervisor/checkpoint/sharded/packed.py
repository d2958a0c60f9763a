"""What each rank of a replayed sharded save tells the coordinator, and the tensor table the
coordinator makes of it.

A save that replays the last one's plan (``replay.PlanCache``) gathers, instead of DCP's
pickled ``WriteResult`` s, one ``PackedWrite`` per rank: the shard it wrote, each chunk's place
in it as a plain tuple, and the chunks' CRC-32C in a list of their own. Between two such saves
only the CRCs differ, so the coordinator's ``TableMemo`` keeps the manifest's table (names in
order, entries without their CRC) made from the last save's rows, and takes it again while
every rank's rows are equal: only the CRCs are put in order (``tensor_table.PackedTensors``).

The rows are not even sent again: a rank whose rows are the very ones it sent last
(``SentRows``) sends their number instead, and the coordinator takes the rows it received
under that number (pickling 880 rows cost each rank about 1.3 ms a save, and unpickling
them the coordinator as much, holding the GIL beside training).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torchsupervisor.checkpoint.entries import ShardEntry, TensorEntry
from torchsupervisor.checkpoint.row_blocks import RowBlocks
from torchsupervisor.checkpoint.sharded.common import ChunkKey, chunk_key
from torchsupervisor.checkpoint.tensor_table import PackedTensors

if TYPE_CHECKING:  # DCP costs a second to import; a process without sharded saves skips it.
    from torch.distributed.checkpoint.storage import WriteResult

__all__ = [
    "Chunk",
    "PackedWrite",
    "SentRows",
    "StoredChunk",
    "TableMemo",
    "packed_rows",
    "written_chunks",
]

Row = tuple[Any, ...]
"""A chunk of a ``PackedWrite``: tensor name, chunk offsets, entry name, dtype, shape, begin,
end (a ``TensorEntry`` of the rank's shard, but for its CRC)."""

Chunk = tuple[ChunkKey, str, ShardEntry, TensorEntry, "RowBlocks | None"]
"""A written chunk: its key, entry name, shard, entry, and blocks of rows (or None)."""


@dataclasses.dataclass(frozen=True)
class StoredChunk:
    """Where one chunk was written (a WriteResult's ``storage_data``, sent to the coordinator)."""

    shard: ShardEntry
    name: str
    entry: TensorEntry
    blocks: RowBlocks | None = None


@dataclasses.dataclass(frozen=True)
class PackedWrite:
    """One rank's written chunks as plain tuples: what a replayed save sends the coordinator.

    DCP's ``WriteResult`` s (four objects and a ``torch.Size`` a chunk) cost 3 us a chunk to
    pickle and as much to unpickle, on the coordinator for every rank's: 8 ms a save of
    1,000 tensors on 2 ranks, holding the GIL.

    Attributes:
        shard: The shard file this rank wrote (None: it wrote none).
        file_index: Its index among the shard files.
        rows: Per chunk, in file order: a ``Row`` (the same at every save of one plan). None:
            the rows this rank sent under ``rows_number`` (``SentRows``).
        crcs: Per chunk, its CRC-32C.
        rows_number: Which of this rank's rows these are: a number of their own, the same
            while they are the very same rows (0: not numbered).
        blocks: Per chunk, the CRC-32C of its blocks of rows (``row_blocks``; None: none),
            or None for no chunk.
    """

    shard: ShardEntry | None
    file_index: int | None
    rows: list[Row] | None
    crcs: list[int]
    rows_number: int = 0
    blocks: list[RowBlocks | None] | None = None

    def chunks(self) -> Iterator[Chunk]:
        """Each chunk's key, entry name, shard, entry and blocks of rows.

        Raises:
            ValueError: If the rows were not sent, the rows and CRCs differ in number, or
                there are rows but no shard.
        """
        rows = self._check(self.rows)
        shard, index = self.shard, self.file_index
        for (fqn, offsets, name, dtype, shape, begin, end), crc, blocks in zip(
            rows, self.crcs, self.blocks or itertools.repeat(None)
        ):
            entry = TensorEntry(index, dtype, shape, begin, end, crc)
            yield (fqn, offsets), name, shard, entry, blocks  # type: ignore[misc]

    def _check(self, rows: list[Row] | None) -> list[Row]:
        """``rows`` (this write's, or the ones it stands for), checked against the rest."""
        if rows is None:
            raise ValueError(
                f"a rank's write result is inconsistent: its rows #{self.rows_number} were "
                "not sent, and none were received under that number"
            )
        if (
            len(rows) != len(self.crcs)
            or (self.blocks is not None and len(self.blocks) != len(rows))
            or (self.shard is None) != (self.file_index is None)
            or (self.shard is None and rows)
        ):
            raise ValueError(
                f"a rank's write result is inconsistent: {len(rows)} chunks, "
                f"{len(self.crcs)} CRCs, shard {self.shard}"
            )
        return rows


class SentRows:
    """This rank's rows last sent to the coordinator, so that the very same ones are not
    sent again (``PackedWrite.rows`` None, with their number).

    The coordinator's ``TableMemo`` keeps what it received under each number; both are
    forgotten together (``replay.PlanCache.forget``, on every rank after a failed save). A
    number the coordinator does not hold fails the save on every rank (a ``ValueError``),
    never a table made from other rows.

    Attributes:
        spared: How many writes went without their rows (for tests and benchmarks).

    Thread safety: one save at a time (the writer thread).
    """

    def __init__(self) -> None:
        self._rows: list[Row] | None = None
        self._number = 0
        self.spared = 0

    def forget(self) -> None:
        """Send the rows again at the next save."""
        self._rows = None

    def pack(self, written: PackedWrite) -> PackedWrite:
        """``written`` as sent: without its rows if they are the very ones sent last."""
        rows = written.rows
        if rows is not None and rows is self._rows:
            self.spared += 1
            return dataclasses.replace(written, rows=None, rows_number=self._number)
        self._rows, self._number = rows, self._number + 1
        return dataclasses.replace(written, rows_number=self._number)


def packed_rows(entries: list[tuple[str, TensorEntry]], keys: dict[str, ChunkKey]) -> list[Row]:
    """The ``PackedWrite.rows`` of a shard's entries (file order), keyed by chunk name."""
    return [(*keys[name], name, e.dtype, e.shape, e.begin, e.end) for name, e in entries]


def written_chunks(
    results: list[list[WriteResult]] | list[PackedWrite],
) -> Iterator[Chunk]:
    """Each chunk's key, entry name, shard, entry and blocks, from every rank's results: DCP's
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
            yield chunk_key(result.index), stored.name, stored.shard, stored.entry, stored.blocks


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
        self._received: dict[int, tuple[int, list[Row]]] = {}  # By rank: number and rows.

    def forget(self) -> None:
        """Drop the kept table and the rows received (``SentRows.forget`` on every rank)."""
        self._last = None
        self._received = {}

    def table(
        self, results: list[PackedWrite]
    ) -> tuple[dict[int, ShardEntry], dict[ChunkKey, str], PackedTensors, dict[str, RowBlocks]]:
        """The shards by file index, the chunks' entry names by key, the tensor table, and
        the blocks of rows by entry name (``row_blocks``).

        Args:
            results: Each rank's ``PackedWrite``, by rank.

        Raises:
            ValueError: For an inconsistent ``PackedWrite`` (rows not sent among them), or
                two chunks of one entry name.
        """
        shards: dict[int, ShardEntry] = {}
        rows = []
        blocks: dict[str, RowBlocks] = {}
        for rank, packed in enumerate(results):
            own = packed.rows
            if own is None:  # The very rows this rank sent last, if received.
                number, own = self._received.get(rank, (0, None))
                if number != packed.rows_number:
                    own = None
            elif packed.rows_number:
                self._received[rank] = (packed.rows_number, own)
            rows.append((packed.file_index, packed._check(own)))
            for row, block in zip(own, packed.blocks or ()):  # type: ignore[arg-type]
                if block is not None:
                    blocks[row[2]] = block
            if packed.shard is not None:
                shards[packed.file_index] = packed.shard  # type: ignore[index]
        last = self._last
        if last is None or last.rows != rows:
            self._last = None  # A table that raised is not kept.
            last = self._last = _Table.of(rows)
        crcs = list(itertools.chain.from_iterable(p.crcs for p in results))
        ordered = list(map(crcs.__getitem__, last.order))
        tensors = PackedTensors(last.entry_names, last.layouts, ordered)
        return shards, last.names, tensors, blocks
