"""The JSON form of a sharded checkpoint's layout: which chunks make up each tensor.

A sharded checkpoint (``sharded.save_sharded``) is a checkpoint of the usual format
(``format.py``) in which every rank wrote its own safetensors shard. A tensor that was split
between ranks (a ``DTensor`` of an FSDP2 model, say) is stored as several *chunks*, each one a
tensor of its own in a shard, named after the tensor and the slice it holds::

    model/fc1.weight[0:4,0:16]      rows 0-3 (rank 0's part)
    model/fc1.weight[4:7,0:16]      rows 4-6 (rank 1's part)

A tensor stored in one piece that covers it whole keeps its plain name
(``optimizer/state/fc1.weight/step``), exactly as in an unsharded checkpoint. Every chunk is an
entry of the manifest's ``tensors`` table (shard, dtype, shape, byte range, CRC-32C), so any
``CheckpointReader`` lists and verifies them. The manifest (``P.index``) carries one more
field, covered by its checksum, that says how chunks make up the tensors the state tree names::

    "sharded_tensors": {
      "model/fc1.weight": {"dtype": "F32", "shape": [7, 16], "chunks": [
        {"offsets": [0, 0], "sizes": [4, 16], "entry": "model/fc1.weight[0:4,0:16]"},
        {"offsets": [4, 0], "sizes": [3, 16], "entry": "model/fc1.weight[4:7,0:16]"}]}}

This is all that ``torch.distributed.checkpoint`` needs to plan a load with another world size
(each tensor's global shape and dtype, and the global offsets and sizes of its chunks); the
planner's own metadata file (a pickle) is never written. A checkpoint without the field (one
written by ``Saver``) is the special case where every tensor is one whole chunk.

The larger chunks also have the CRC-32C of each block of their rows (the manifest's
``row_blocks`` field: ``format.py``, ``row_blocks.py``), so that a restore at another world
size reads only the blocks that hold its rows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from torchsupervisor.checkpoint.format import (
    Manifest,
    ManifestError,
    dtype_from_code,
    dtype_to_code,
    signed_json,
)
from torchsupervisor.checkpoint.manifest_json import EncodedItem, EncodedMapping, json_string

__all__ = [
    "SHARDED_TENSORS_KEY",
    "ChunkEntry",
    "ShardedManifest",
    "ShardedTensorEntry",
    "chunk_entry_name",
]

SHARDED_TENSORS_KEY = "sharded_tensors"


def chunk_entry_name(
    name: str, offsets: Sequence[int], sizes: Sequence[int], shape: Sequence[int], whole: bool
) -> str:
    """Return the name under which a chunk of tensor ``name`` is stored.

    Args:
        name: The tensor's name in the state (``model/fc1.weight``).
        offsets: Where the chunk starts in the tensor, per dimension.
        sizes: The chunk's size per dimension.
        shape: The tensor's (global) shape.
        whole: True when the tensor is stored as this one chunk only; with offsets all 0 and
            sizes equal to the shape, the chunk then keeps the tensor's own name.

    Returns:
        ``name`` for a whole tensor, else ``name[o0:e0,o1:e1,...]`` (Python slice notation,
        ``e = o + size``; a 0-d tensor is always whole).
    """
    if whole and all(o == 0 for o in offsets) and tuple(sizes) == tuple(shape):
        return name
    return f"{name}[{','.join(f'{o}:{o + s}' for o, s in zip(offsets, sizes))}]"


@dataclass(frozen=True)
class ChunkEntry:
    """One stored piece of a tensor.

    Attributes:
        offsets: Where the chunk starts in the tensor, per dimension.
        sizes: The chunk's size per dimension.
        entry: The name of the manifest's ``tensors`` entry that holds its bytes.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    entry: str


@dataclass(frozen=True)
class ShardedTensorEntry:
    """A tensor stored in several chunks (or in one that does not carry its name).

    Attributes:
        dtype: The tensor's dtype (every chunk has it).
        shape: The tensor's global shape.
        chunks: Its chunks; together they cover it exactly once.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[ChunkEntry, ...]

    @functools.cached_property
    def encoded(self) -> EncodedItem:
        """Its item of the manifest's ``sharded_tensors``, encoded once: a replayed save
        reuses the entries of the save before it (``writer.ChunkLayout``)."""
        return sharded_item(self)


@dataclass(frozen=True)
class ShardedManifest(Manifest):
    """A manifest with the chunk layout of the tensors that were stored in pieces.

    Attributes:
        sharded_tensors: ``{tensor name: ShardedTensorEntry}`` for every tensor stored in
            chunks; a tensor stored whole is an ordinary ``tensors`` entry and is not listed.
    """

    sharded_tensors: dict[str, ShardedTensorEntry] = field(default_factory=dict)

    def chunk_entries(self) -> set[str]:
        """Return the names of the ``tensors`` entries that are chunks of a bigger tensor."""
        return {c.entry for t in self.sharded_tensors.values() for c in t.chunks}

    def tensor_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Return ``{tensor name: (dtype, global shape)}`` of the tensors the tree names.

        These are the whole tensors of the ``tensors`` table and the tensors stored in chunks;
        the chunk entries themselves are not listed.
        """
        chunks = self.chunk_entries()
        out = {name: (e.dtype, e.shape) for name, e in self.tensors.items() if name not in chunks}
        out.update({name: (t.dtype, t.shape) for name, t in self.sharded_tensors.items()})
        return out

    def chunks_of(self, name: str) -> tuple[ChunkEntry, ...]:
        """Return the chunks of tensor ``name`` (one covering it all for a whole tensor).

        Raises:
            KeyError: If there is no tensor ``name``.
        """
        sharded = self.sharded_tensors.get(name)
        if sharded is not None:
            return sharded.chunks
        entry = self.tensors[name]
        return (ChunkEntry((0,) * len(entry.shape), entry.shape, name),)

    def to_bytes(self, tree_text: EncodedItem | None = None) -> bytes:
        """Serialize to the JSON text of ``P.index``, the chunk layout included in its CRC.

        ``tree_text``: the texts of ``tree`` where the caller has them
        (``tree_memo.TreeMemo``), written as they are.
        """
        body = self.body()
        tree = body.pop("tree")
        if self.sharded_tensors:
            body[SHARDED_TENSORS_KEY] = _sharded_field(self.sharded_tensors)
        body["tree"] = tree if tree_text is None else tree_text
        return signed_json(body, _EXPANDED)

    @classmethod
    def from_bytes(cls, data: bytes) -> ShardedManifest:
        """Parse and validate the bytes of ``P.index``, with or without a chunk layout.

        Raises:
            ManifestError: If the text is not a valid manifest, its checksum does not match,
                or its chunk layout is inconsistent (a chunk outside its tensor, chunks that do
                not add up to the tensor, a chunk entry missing or of another dtype or shape).
        """
        base = Manifest.from_bytes(data)
        body = json.loads(data.decode("utf-8"))  # Valid: checked by Manifest.from_bytes.
        raw = body.get(SHARDED_TENSORS_KEY, {})
        sharded = _parse_sharded(raw, base)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Manifest)}
        return cls(**fields, sharded_tensors=sharded)


def _sharded_field(sharded: dict[str, ShardedTensorEntry]) -> EncodedMapping:
    """The manifest's ``sharded_tensors`` field, encoded; kept for the very same mapping.

    A save that replays the last one's plan has the very same mapping (``ChunkLayout``, which
    never changes one once made), so its text is made once (750 items, 0.5 ms a save).
    """
    last = _LAST_SHARDED[0]  # One read of a tuple: what one writer thread put there.
    if last is not None and last[0] is sharded:
        return last[1]
    text = ",\n".join(f"  {json_string(name)}: {t.encoded.text}" for name, t in sharded.items())
    pairs = [f"{json_string(name)}:{sharded[name].encoded.canonical}" for name in sorted(sharded)]
    field = EncodedMapping(text, "{" + ",".join(pairs) + "}")
    _LAST_SHARDED[0] = (sharded, field)  # Held: its id stays its own.
    return field


_LAST_SHARDED: list[tuple[dict[str, ShardedTensorEntry], EncodedMapping] | None] = [None]


def sharded_item(t: ShardedTensorEntry) -> EncodedItem:
    """``{"dtype": ..., "shape": [...], "chunks": [{"offsets", "sizes", "entry"}, ...]}``,
    readable and canonical (as ``json`` writes them, without its cost: 1,000 a save)."""
    code = json_string(dtype_to_code(t.dtype))
    texts, canonicals = [], []
    for c in t.chunks:
        entry = json_string(c.entry)
        offsets, sizes = [f"{o:d}" for o in c.offsets], [f"{n:d}" for n in c.sizes]
        texts.append(
            f'{{"offsets": [{", ".join(offsets)}], "sizes": [{", ".join(sizes)}], '
            f'"entry": {entry}}}'
        )
        canonicals.append(
            f'{{"entry":{entry},"offsets":[{",".join(offsets)}],"sizes":[{",".join(sizes)}]}}'
        )
    shape = [f"{n:d}" for n in t.shape]
    return EncodedItem(
        f'{{"dtype": {code}, "shape": [{", ".join(shape)}], "chunks": [{", ".join(texts)}]}}',
        f'{{"chunks":[{",".join(canonicals)}],"dtype":{code},"shape":[{",".join(shape)}]}}',
    )


def _parse_sharded(raw: object, base: Manifest) -> dict[str, ShardedTensorEntry]:
    if not isinstance(raw, dict):
        raise ManifestError(f"{SHARDED_TENSORS_KEY} is not an object")
    out: dict[str, ShardedTensorEntry] = {}
    used: set[str] = set()
    try:
        for name, spec in raw.items():
            if name in base.tensors:
                raise ManifestError(f"tensor {name!r} is both stored whole and in chunks")
            dtype = dtype_from_code(spec["dtype"])
            shape = _dims(spec["shape"])
            chunks = []
            volume = 0
            for c in spec["chunks"]:
                chunk = ChunkEntry(_dims(c["offsets"]), _dims(c["sizes"]), c["entry"])
                _check_chunk(name, dtype, shape, chunk, base, used)
                used.add(chunk.entry)
                volume += math.prod(chunk.sizes)
                chunks.append(chunk)
            if not chunks or volume != math.prod(shape):
                raise ManifestError(f"the chunks of tensor {name!r} do not cover it exactly")
            out[name] = ShardedTensorEntry(dtype, shape, tuple(chunks))
    except (KeyError, TypeError, AttributeError) as e:
        raise ManifestError(
            f"malformed {SHARDED_TENSORS_KEY} field ({type(e).__name__}: {e})"
        ) from None
    return out


def _dims(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value
    ):
        raise ManifestError(f"expected a list of non-negative integers, got {value!r:.80}")
    return tuple(value)


def _check_chunk(
    name: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    chunk: ChunkEntry,
    base: Manifest,
    used: set[str],
) -> None:
    if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
        raise ManifestError(f"a chunk of tensor {name!r} has the wrong number of dimensions")
    if any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, shape)):
        raise ManifestError(f"a chunk of tensor {name!r} lies outside its shape {list(shape)}")
    entry = base.tensors.get(chunk.entry) if isinstance(chunk.entry, str) else None
    if entry is None:
        raise ManifestError(f"a chunk of tensor {name!r} names an unknown entry {chunk.entry!r}")
    if chunk.entry in used:
        raise ManifestError(f"entry {chunk.entry!r} is used by two chunks")
    if entry.dtype != dtype or entry.shape != chunk.sizes:
        raise ManifestError(
            f"entry {chunk.entry!r} ({entry.dtype}, {list(entry.shape)}) does not match its "
            f"chunk of tensor {name!r} ({dtype}, {list(chunk.sizes)})"
        )


_EXPANDED = ("shards", "tensors", SHARDED_TENSORS_KEY)
