"""The text of a manifest's tensor table, made from the last save's where only CRCs changed.

A manifest lists every tensor's entry (``entries.TensorEntry``), readable and canonical
(``format.Manifest.to_bytes``). The saves of one state write the same names and entries but
for the CRCs, so ``tensors_field`` keeps each recent table's text as the pieces between one
CRC and the next, and a save only joins them with its CRCs. ``PackedTensors`` is a table held
as lists, for a writer that knows the names and layouts from the last save (a sharded save's
coordinator, ``sharded.packed.TableMemo``).
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Mapping
from typing import Any

from torchsupervisor.checkpoint.entries import TensorEntry, dtype_to_code
from torchsupervisor.checkpoint.manifest_json import (
    EncodedMapping,
    json_int,
    json_ints,
    json_string,
)

__all__ = ["PackedTensors", "tensors_field"]


class PackedTensors(Mapping[str, TensorEntry]):
    """A manifest's tensor table held as lists: names, entries without their CRC, CRCs.

    What a writer that knows a table's names and layouts from the last save hands
    ``tensors_field`` (which then takes them as they are): a sharded save of 1,000 tensors
    would otherwise make and take apart 1,800 ``TensorEntry`` objects a save on the
    coordinator. A read-only ``Mapping`` of ``TensorEntry`` like the ``dict`` it stands for
    (each entry made when read).

    Args:
        names: The tensors' names, in the table's order (the manifest's: sorted), unique.
        layouts: Each one's ``(shard, dtype, shape, begin, end)``, in the same order.
        crcs: Each one's CRC-32C, in the same order.

    Raises:
        ValueError: If the three lists differ in length.
    """

    __slots__ = ("_index", "crcs", "layouts", "names")

    def __init__(self, names: list[str], layouts: list[tuple[Any, ...]], crcs: list[int]) -> None:
        if not len(names) == len(layouts) == len(crcs):
            raise ValueError(
                f"{len(names)} names, {len(layouts)} layouts and {len(crcs)} CRCs: not one each"
            )
        self.names, self.layouts, self.crcs = names, layouts, crcs
        self._index: dict[str, int] | None = None

    def __getitem__(self, name: str) -> TensorEntry:
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self.names)}
        i = self._index[name]
        return TensorEntry(*self.layouts[i], self.crcs[i])

    def __iter__(self) -> Any:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def item_parts(layout: tuple[Any, ...]) -> tuple[str, str]:
    """The readable text of an entry of ``layout`` (``(shard, dtype, shape, begin, end)``)
    up to its CRC, and the canonical text after it."""
    shard, dtype, shape, begin, end = layout
    key = (shard, dtype, tuple(shape), begin, end)
    parts = TENSOR_ITEM_PARTS.get(key)
    if parts is None:
        if len(TENSOR_ITEM_PARTS) >= MAX_TENSOR_ITEM_PARTS:
            TENSOR_ITEM_PARTS.clear()
        code = json_string(dtype_to_code(dtype))
        parts = TENSOR_ITEM_PARTS[key] = (
            f'{{"shard": {shard:d}, "dtype": {code}, "shape": [{json_ints(shape, ", ")}], '
            f'"offsets": [{begin:d}, {end:d}], "crc32c": ',
            f',"dtype":{code},"offsets":[{begin:d},{end:d}],'
            f'"shape":[{json_ints(shape, ",")}],"shard":{shard:d}}}',
        )
    return parts


# The readable text of a tensor entry up to its CRC and the canonical text after it, by the
# entry's other fields: the saves of one state write the same entries but for the CRCs, and
# encoding them anew cost 3.5 us an entry (1,800 a sharded save of 1,000 tensors). A pure
# function of its key (equal keys give equal texts), so it is never stale; cleared when full
# (65,536 entries, some 30 MB at most).
TENSOR_ITEM_PARTS: dict[tuple[Any, ...], tuple[str, str]] = {}
MAX_TENSOR_ITEM_PARTS = 1 << 16

entry_layout = operator.attrgetter("shard", "dtype", "shape", "begin", "end")
_entry_crc = operator.attrgetter("crc32c")


class _TensorsText:
    """The text of a table of tensors (names and entries' layouts in order) but for the CRCs.

    Held as the text between one CRC and the next, readable and canonical, so that a table's
    texts are two joins in C (one concatenation per entry and text made them 0.5 ms slower
    for 1,764 entries).
    """

    __slots__ = ("c_end", "c_glue", "glue", "layouts", "names", "order")

    def __init__(self, names: list[str], layouts: list[tuple[Any, ...]]) -> None:
        self.names, self.layouts = names, layouts  # Not empty.
        parts = list(map(item_parts, layouts))
        heads = [f"  {json_string(n)}: {head}" for n, (head, _) in zip(names, parts)]
        self.glue = [heads[0], *["},\n" + h for h in heads[1:]]]  # Each before its CRC.
        self.order = sorted(range(len(names)), key=names.__getitem__)  # The canonical order.
        c_heads = [f'{json_string(names[i])}:{{"crc32c":' for i in self.order]
        c_tails = [parts[i][1] for i in self.order]
        self.c_glue = ["{" + c_heads[0], *[t + "," + h for t, h in zip(c_tails, c_heads[1:])]]
        self.c_end = c_tails[-1] + "}"

    def encode(self, crcs: list[str]) -> EncodedMapping:
        """The field with these CRCs (JSON texts, in the table's order)."""
        text = "".join(itertools.chain.from_iterable(zip(self.glue, crcs))) + "}"
        ordered = map(crcs.__getitem__, self.order)
        canonical = "".join(itertools.chain.from_iterable(zip(self.c_glue, ordered)))
        return EncodedMapping(text, canonical + self.c_end)


def tensors_field(tensors: Mapping[str, TensorEntry]) -> EncodedMapping | dict[str, Any]:
    """The ``tensors`` field of a manifest, encoded (``EncodedMapping``; ``{}`` when empty).

    The saves of one state write the same names and entries but for the CRCs: the texts of
    the last few tables are kept (``RECENT_TENSORS_TEXTS``) and used again when the names and
    every entry's other fields are equal, which a pass in C over each list tells. A sharded
    save of 1,008 tensors (1,764 entries), the coordinator's CPU for the manifest's text
    (``to_bytes``, with the ``sharded_tensors`` field kept likewise): 6.5-6.6 -> 3.6-4.2 ms.
    """
    if not tensors:
        return {}
    if isinstance(tensors, PackedTensors):
        names, layouts, crcs = tensors.names, tensors.layouts, tensors.crcs
    else:
        names = list(tensors)
        entries = list(tensors.values())
        layouts = list(map(entry_layout, entries))
        crcs = list(map(_entry_crc, entries))
    with _TENSORS_TEXTS_LOCK:
        texts = next(
            (t for t in RECENT_TENSORS_TEXTS if t.names == names and t.layouts == layouts), None
        )
    if texts is None:
        texts = _TensorsText(names, layouts)
        with _TENSORS_TEXTS_LOCK:
            kept = RECENT_TENSORS_TEXTS
            kept.insert(0, texts)
            del kept[MAX_TENSORS_TEXTS:]
            while len(kept) > 1 and sum(len(t.names) for t in kept) > MAX_TENSORS_TEXT_ENTRIES:
                del kept[-1]  # The newest is kept, however large.
    try:
        return texts.encode(list(map(int.__repr__, crcs)))  # An int as JSON, in C; else:
    except TypeError:  # A missing CRC (None), or not an int: ``json_int`` writes or refuses it.
        return texts.encode(list(map(json_int, crcs)))


# The texts of the tables of the last few manifests written, newest first (each saver writes
# one state's; a process may have several savers, each on its own writer thread, hence the
# lock): 4 tables and 131,072 entries at most (about 300 bytes an entry), or the newest.
RECENT_TENSORS_TEXTS: list[_TensorsText] = []
MAX_TENSORS_TEXTS = 4
MAX_TENSORS_TEXT_ENTRIES = 1 << 17
_TENSORS_TEXTS_LOCK = threading.Lock()
