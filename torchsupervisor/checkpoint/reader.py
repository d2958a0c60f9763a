"""Reading checkpoints back, with every byte checked against its CRC-32C.

``CheckpointReader`` opens ``P.index``, validates the manifest (its own checksum, the types of
its fields, byte ranges that fit their shards) and reads tensors from the safetensors shards.
A full read (``read_tensors``, hence every restore) verifies every tensor's checksum and every
shard's: the header (8-byte length and JSON) is read and checked against the shard's recorded
header CRC, its tensors must tile the data area exactly, and when all of a shard's tensors were
read, the shard checksum is computed from the header and the tensors' CRCs (no byte is read
twice). A single-tensor read (``get_tensor``) verifies that tensor's checksum. Anything wrong
raises ``CorruptCheckpointError`` naming the file and what is wrong; nothing is ever unpickled.

TF names: ``tf.train.NewCheckpointReader`` / ``CheckpointReader``, ``tf.train.load_checkpoint``,
``tf.train.list_variables``, ``tf.train.load_variable``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import crc32c
import torch

from torchsupervisor.checkpoint.format import Manifest, ManifestError, TensorEntry
from torchsupervisor.checkpoint.index_file import read_index, reader_of
from torchsupervisor.checkpoint.row_blocks import BlockCheck
from torchsupervisor.checkpoint.shard_io import (
    check_shard,
    open_shard,
    pread_exactly,
    read_tensor,
    scratch_reads,
    tensor_reads,
)
from torchsupervisor.checkpoint.sharded.metadata import (
    SHARDED_TENSORS_KEY,
    ShardedManifest,
    ShardedTensorEntry,
)
from torchsupervisor.core.checks import check_path
from torchsupervisor.core.state import TensorSpec
from torchsupervisor.core.tree import decode_tree
from torchsupervisor.errors import CorruptCheckpointError, NotFoundError
from torchsupervisor.storage import (
    BY_PATH,
    Storage,
    storage_for,
)

__all__ = [
    "CheckpointReader",
    "NewCheckpointReader",
    "list_variables",
    "load_checkpoint",
    "load_variable",
]


# TF's name of the global step variable. A ``GlobalStep`` is saved as a plain int in the
# manifest's tree (``global_step/value``) and as the manifest's step; the reader shows that step
# as a 0-d int64 tensor under this name, as TF's checkpoints held it, unless a real tensor is
# called so.
GLOBAL_STEP_NAME = "global_step"


class CheckpointReader:
    """Read a checkpoint's manifest and tensors.

    Works on every checkpoint of our format: one written by ``Saver`` (every tensor whole) and
    one written by several ranks with ``save_sharded``, whose tensors are stored in chunks
    (``model/fc1.weight[0:4,0:16]``): the tensors are then listed with their global shapes and
    read assembled from their chunks, each chunk verified; the chunk entries are readable by
    name too. The checkpoint's global step is listed and read as ``"global_step"``, a 0-d int64
    tensor, as in TF (``load_variable(logdir, "global_step")``).

    Args:
        prefix: The checkpoint prefix (``logdir/model.ckpt-1234``).
        storage: Where the checkpoints live (tests inject faults here).
        index: The bytes of ``prefix.index`` if already read; None: read here.

    Raises:
        NotFoundError: If ``prefix.index`` does not exist (TF's text).
        CorruptCheckpointError: If the manifest is damaged or not in our format (a TF 1
            checkpoint is read by ``NewCheckpointReader`` and ``load_checkpoint``).

    Thread safety: read-only; each call opens its own files.

    TF name: ``tf.train.NewCheckpointReader`` / ``py_checkpoint_reader.CheckpointReader``.
    """

    def __init__(
        self, prefix: str, *, storage: Storage = BY_PATH, index: bytes | None = None
    ) -> None:
        prefix = check_path("prefix", prefix, allow_none=False)
        self._prefix = prefix
        self._storage = storage
        self._dir = os.path.dirname(prefix)
        data = read_index(prefix, storage) if index is None else index
        index_path = prefix + ".index"
        if reader_of(data) is not None:
            raise CorruptCheckpointError(
                f"Checkpoint index {index_path} is not in this format (a TF 1 checkpoint?): "
                "read it with NewCheckpointReader or load_checkpoint",
                path=index_path,
                reason="another format",
            )
        index = index_path
        try:
            if SHARDED_TENSORS_KEY.encode() in data:
                self._manifest = ShardedManifest.from_bytes(data)
                self._sharded: dict[str, ShardedTensorEntry] = self._manifest.sharded_tensors
            else:
                self._manifest = Manifest.from_bytes(data)
                self._sharded = {}
        except ManifestError as e:
            raise CorruptCheckpointError(
                f"Checkpoint index {index} is corrupt: {e}", path=index, reason=str(e)
            ) from None

    @property
    def prefix(self) -> str:
        """The checkpoint prefix, as given.

        TF name: none (TF's reader does not expose its file pattern).
        """
        return self._prefix

    @property
    def manifest(self) -> Manifest:
        """The parsed manifest (a ``ShardedManifest`` for a checkpoint of ``save_sharded``).

        TF name: none (our checkpoint format's index; TF's is a table of tensor slices).
        """
        return self._manifest

    @property
    def global_step(self) -> int | None:
        """The global step recorded in the checkpoint; None if it was saved without one.

        TF name: none (in TF, read the ``global_step`` variable with ``get_tensor``).
        """
        return self._manifest.global_step

    @property
    def is_sharded(self) -> bool:
        """True if some tensors are stored in chunks (a checkpoint of ``save_sharded``).

        TF name: none (TF's reader assembles slices without saying so).
        """
        return bool(self._sharded)

    def _specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        if self._sharded:
            specs = self._manifest.tensor_specs()
        else:
            specs = {name: (e.dtype, e.shape) for name, e in self._manifest.tensors.items()}
        if self._step_alias():
            specs[GLOBAL_STEP_NAME] = (torch.int64, ())
        return specs

    @property
    def step_alias(self) -> bool:
        """True if the listed ``"global_step"`` is the manifest's step, not a stored tensor.

        TF name: none.
        """
        return self._step_alias()

    def _step_alias(self) -> bool:
        """True if ``"global_step"`` names the manifest's step (no tensor has that name)."""
        return (
            self._manifest.global_step is not None
            and GLOBAL_STEP_NAME not in self._manifest.tensors
            and GLOBAL_STEP_NAME not in self._sharded
        )

    def get_variable_to_shape_map(self) -> dict[str, list[int]]:
        """Return ``{tensor name: shape as a list of ints}`` (global shapes; no chunk entries).

        TF name: ``tf.compat.v1.train.NewCheckpointReader(...).get_variable_to_shape_map``.
        """
        return {name: list(shape) for name, (_, shape) in self._specs().items()}

    def get_variable_to_dtype_map(self) -> dict[str, torch.dtype]:
        """Return ``{tensor name: torch dtype}`` (no chunk entries).

        TF name: ``tf.compat.v1.train.NewCheckpointReader(...).get_variable_to_dtype_map``
        (which gives TF dtypes).
        """
        return {name: dtype for name, (dtype, _) in self._specs().items()}

    def has_tensor(self, name: str) -> bool:
        """Return True if the checkpoint holds a tensor (or a chunk entry) called ``name``.

        ``"global_step"`` is there whenever the checkpoint records a global step.

        TF name: ``tf.compat.v1.train.NewCheckpointReader(...).has_tensor``.
        """
        return (
            name in self._manifest.tensors
            or name in self._sharded
            or (name == GLOBAL_STEP_NAME and self._step_alias())
        )

    def get_tensor(self, name: str) -> torch.Tensor:
        """Read one tensor (on the CPU), verifying its checksum.

        A tensor stored in chunks is assembled from them, each chunk verified.

        Args:
            name: The tensor's name (as ``get_variable_to_shape_map`` lists it) or a chunk
                entry's name.

        Returns:
            A new CPU tensor that owns its memory.

        Raises:
            NotFoundError: ``"Key <name> not found in checkpoint"``.
            CorruptCheckpointError: If its shard is missing, unreadable or of the wrong size,
                or its bytes are truncated or do not match the checksum.

        TF name: ``tf.compat.v1.train.NewCheckpointReader(...).get_tensor``.
        """
        sharded = self._sharded.get(name)
        if sharded is not None:
            out = torch.empty(sharded.shape, dtype=sharded.dtype)
            for chunk in sharded.chunks:
                out[_slices(chunk.offsets, chunk.sizes)] = self.get_tensor(chunk.entry)
            return out
        entry = self._manifest.tensors.get(name)
        if entry is None:
            if name == GLOBAL_STEP_NAME and self._step_alias():
                return torch.tensor(self._manifest.global_step, dtype=torch.int64)
            raise NotFoundError(f"Key {name} not found in checkpoint")
        shard = self._manifest.shards[entry.shard]
        path = self._shard_path(entry.shard)
        with self._open_shard(entry.shard) as f:
            tensor, crc = read_tensor(f, shard.data_offset + entry.begin, entry)
        if crc != entry.crc32c:
            raise CorruptCheckpointError(
                f"Tensor {name!r} in {path} is corrupt: checksum mismatch",
                path=path,
                reason="checksum mismatch",
            )
        return tensor

    def iter_tensor_bytes(
        self,
        name: str,
        piece_bytes: int = 16 << 20,
        buffer_for: Callable[[int], memoryview] | None = None,
    ) -> Iterator[memoryview]:
        """Yield the bytes of tensor ``name`` (row-major, little-endian) in pieces, for
        streaming it elsewhere without holding it whole.

        Each piece is at most ``piece_bytes`` and read into one buffer that the next piece
        reuses (copy or write a piece before asking for the next); or, with ``buffer_for``,
        into the buffer ``buffer_for(size)`` returns for each piece (at least ``size`` bytes:
        a pool, for reading ahead of a writer). A tensor stored in chunks
        along its first dimension streams chunk by chunk; one split along other dimensions is
        assembled first (its bytes held once). Every chunk's CRC-32C is checked before its
        last piece is yielded: a consumer that writes to a temporary file and commits only
        after the iteration ends never commits damaged bytes.

        Raises:
            NotFoundError: No such tensor.
            CorruptCheckpointError: Its shard is missing or short, or a CRC does not match.

        TF name: none.
        """
        sharded = self._sharded.get(name)
        if sharded is not None:
            rows = sorted(sharded.chunks, key=lambda c: c.offsets)
            if all(
                all(o == 0 for o in c.offsets[1:]) and tuple(c.sizes[1:]) == sharded.shape[1:]
                for c in rows
            ):
                for chunk in rows:
                    yield from self.iter_tensor_bytes(chunk.entry, piece_bytes, buffer_for)
                return
            whole = self.get_tensor(name).contiguous()
            data = (
                memoryview(whole.reshape(-1).view(torch.uint8).numpy())
                if whole.numel()
                else (memoryview(b""))
            )
            for start in range(0, len(data), piece_bytes):
                yield data[start : start + piece_bytes]
            return
        entry = self._manifest.tensors.get(name)
        if entry is None:
            if name == GLOBAL_STEP_NAME and self._step_alias():
                yield memoryview(self.get_tensor(name).numpy().tobytes())
                return
            raise NotFoundError(f"Key {name} not found in checkpoint")
        if entry.nbytes == 0:
            return
        path = self._shard_path(entry.shard)
        start = self._manifest.shards[entry.shard].data_offset + entry.begin
        size = min(piece_bytes, entry.nbytes)
        buffer = memoryview(bytearray(size)) if buffer_for is None else None
        crc, done = 0, 0
        with self._open_shard(entry.shard) as f:
            while done < entry.nbytes:
                take = min(size, entry.nbytes - done)
                view = (buffer if buffer is not None else buffer_for(take))[:take]
                pread_exactly(f, view, start + done)
                crc = crc32c.crc32c(view, crc)
                done += len(view)
                if done == entry.nbytes and crc != entry.crc32c:
                    raise CorruptCheckpointError(
                        f"Tensor {name!r} in {path} is corrupt: checksum mismatch",
                        path=path,
                        reason="checksum mismatch",
                    )
                yield view

    def read_tensors(self) -> dict[str, torch.Tensor]:
        """Read every tensor (on the CPU), verifying each one's checksum.

        Tensors are read shard by shard in file order, each straight into its own memory, and
        its CRC-32C is computed on the way (in C, without the GIL). Then each shard's header is
        read and verified against its own CRC (``check_shard``), so every byte read is
        checked. A shard may be shared with older checkpoints (incremental saves): only the
        byte ranges this checkpoint uses are read.

        Returns:
            ``{name: tensor}``; each tensor owns its memory. Tensors stored in chunks are
            assembled (the chunk entries are not returned).

        Raises:
            CorruptCheckpointError: For a missing or truncated shard, a tensor whose bytes do
                not match its checksum (the message names the shard file and the tensors), or
                a damaged shard header.
            OSError: If a read of a shard fails.

        TF name: none (TF reads one tensor at a time with ``get_tensor``).
        """
        out: dict[str, torch.Tensor] = {}
        for shard_index, entries in self._entries_by_shard():
            out.update(self._read_shard(shard_index, entries))
        for name, sharded in self._sharded.items():
            tensor = torch.empty(sharded.shape, dtype=sharded.dtype)
            for chunk in sharded.chunks:
                tensor[_slices(chunk.offsets, chunk.sizes)] = out.pop(chunk.entry)
            out[name] = tensor
        return out

    def read_tree(self) -> Any:
        """Read the whole state tree: tensors in place, numpy arrays where arrays were saved.

        Raises:
            CorruptCheckpointError: As ``read_tensors``, or for a tree that names an unknown
                tensor.

        TF name: none (TF restores variables one by one; the tree is our format's).
        """
        tensors = self.read_tensors()
        return self._decode_tree(
            tensors, lambda name, ndarray: tensors[name].numpy() if ndarray else tensors[name]
        )

    def read_specs(self) -> Any:
        """Return the state tree with ``TensorSpec`` leaves (dtype, shape), from the manifest.

        Nothing but the index is read: what a restore compares with the live state first.

        Raises:
            CorruptCheckpointError: Naming the index, if the tree names an unknown tensor.

        TF name: none (``get_variable_to_shape_map`` is TF's flat view).
        """
        dtypes = self.get_variable_to_dtype_map()
        shapes = self.get_variable_to_shape_map()
        return self._decode_tree(
            dtypes,
            lambda name, ndarray: TensorSpec(name, dtypes[name], tuple(shapes[name]), ndarray),
        )

    def _decode_tree(self, known: Any, leaf: Any) -> Any:
        """Decode the manifest's tree; a leaf naming a tensor not in ``known`` is damage.

        Raises:
            CorruptCheckpointError: Naming the index, for a tree that is not a valid
                encoding or names an unknown tensor.
        """

        def checked(name: str, ndarray: bool) -> Any:
            if name not in known:
                raise ManifestError(f"the tree names an unknown tensor {name!r}")
            return leaf(name, ndarray)

        try:
            return decode_tree(self._manifest.tree, checked)
        except ManifestError as e:
            index = self._prefix + ".index"
            raise CorruptCheckpointError(
                f"Checkpoint index {index} is corrupt: {e}", path=index, reason=str(e)
            ) from None

    def verify(self) -> None:
        """Check what a restore of this checkpoint reads, exactly as the restore checks it.

        The same checks, in the same order, as ``read_tree`` (hence ``Saver.restore``), without
        keeping the tensors: every shard a tensor of this checkpoint lives in is a regular
        file inside the checkpoint's directory with the size the manifest records
        (``check_files``); every tensor's bytes match its CRC-32C (and each block of its rows
        its own, where the manifest has them: ``Manifest.row_blocks``); every shard's header
        matches its own; the state tree names only tensors the manifest lists. Bytes the
        checkpoint does not read (tensors of an older shard that an incremental checkpoint
        does not use) are not checked: damage there does not affect this checkpoint. So
        ``verify`` passes exactly when a restore would read the checkpoint without error.

        Raises:
            CorruptCheckpointError: Naming the first bad file (and its damaged tensors).
            OSError: If a read fails.

        TF name: none (TF checks each tensor's checksum only as it reads it).
        """
        self.check_files()
        for shard_index, entries in self._entries_by_shard():
            self._read_shard(shard_index, entries, keep=False)
        self._decode_tree(set(self._manifest.tensors) | set(self._sharded), lambda *_: None)

    def check_files(self) -> None:
        """Check, without reading their tensors, the shards this checkpoint's tensors live in.

        Each must be a regular file inside the checkpoint's directory (a symbolic link that
        leaves it is damage) with exactly the size the manifest records, so that the byte
        ranges the manifest claims (bounded by those sizes when it was parsed) are really on
        disk; and its own header (checked against its checksum) must give every tensor the
        dtype, shape and byte range the manifest gives it. ``Saver.restore`` calls this before
        comparing the manifest with the live state: a manifest claiming a tensor larger than
        its file, or of another dtype or shape than the shard holds, is damage (and the
        restart falls back), not a mismatch with the state.

        Raises:
            CorruptCheckpointError: Naming the file: missing, not a regular file, outside the
                directory, of another size, its header damaged, or disagreeing with the
                manifest.

        TF name: none.
        """
        for shard_index, entries in self._entries_by_shard():
            with self._open_shard(shard_index) as f:
                check_shard(f, self._manifest.shards[shard_index], {}, entries)

    def _entries_by_shard(self) -> list[tuple[int, list[tuple[str, TensorEntry]]]]:
        """The manifest's tensors grouped by shard (in shard order), each group by offset."""
        by_shard: dict[int, list[tuple[str, TensorEntry]]] = {}
        for name, entry in self._manifest.tensors.items():
            by_shard.setdefault(entry.shard, []).append((name, entry))
        for entries in by_shard.values():
            entries.sort(key=lambda item: item[1].begin)
        return sorted(by_shard.items())

    def _shard_path(self, shard_index: int) -> str:
        return os.path.join(self._dir, self._manifest.shards[shard_index].file)

    def _open_shard(self, shard_index: int):
        path = self._shard_path(shard_index)
        expected = self._manifest.shards[shard_index].size_bytes
        return open_shard(path, expected, self._storage, directory=self._dir)

    def _read_shard(
        self, shard_index: int, entries: list[tuple[str, TensorEntry]], keep: bool = True
    ) -> dict[str, torch.Tensor]:
        """Read and check ``entries`` of one shard (``keep=False``: check only, return {})."""
        shard = self._manifest.shards[shard_index]
        path = self._shard_path(shard_index)
        raws: dict[str, torch.Tensor] = {}
        crcs = dict.fromkeys((name for name, _ in entries), 0)
        # Checking only (``verify``): the blocks of rows a resharded restore checks, too.
        blocks = None if keep else BlockCheck(entries, self._manifest.row_blocks)
        with self._open_shard(shard_index) as f:
            # Helper threads read (a copy from the page cache or a wait on the disk) while
            # this one checksums what was read, in order: all release the GIL.
            tensors = [(name, shard.data_offset + e.begin, e.nbytes) for name, e in entries]
            reads = tensor_reads(f, tensors) if keep else scratch_reads(f, tensors)
            # Closed before the file is, whatever happens: no read may outlive the file.
            with contextlib.closing(reads):
                for name, raw, view in reads:
                    if keep:
                        raws[name] = raw
                    crcs[name] = crc32c.crc32c(view, crcs[name])
                    if blocks is not None:
                        blocks.feed(name, view)
            damaged = [name for name, entry in entries if crcs[name] != entry.crc32c]
            damaged += [] if blocks is None else [n for n in blocks.damaged if n not in damaged]
            if damaged:
                raise CorruptCheckpointError(
                    f"Checkpoint shard {path} is corrupt: checksum mismatch (damaged tensors: "
                    f"{', '.join(damaged)})",
                    path=path,
                    reason="checksum mismatch",
                )
            check_shard(f, shard, {(e.begin, e.end): crcs[n] for n, e in entries}, entries)
        if not keep:
            return {}
        return {
            name: raws[name].view(entry.dtype).reshape(entry.shape)
            if entry.nbytes
            else torch.empty(entry.shape, dtype=entry.dtype)
            for name, entry in entries
        }


def _slices(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


def NewCheckpointReader(filepattern: str, *, storage: Storage = BY_PATH) -> CheckpointReader | Any:
    """Return a reader for the checkpoint prefix ``filepattern``: a ``CheckpointReader`` for
    one of ours, a ``TFBundleReader`` for a TF 1 checkpoint (V2 tensor bundle).

    Raises:
        NotFoundError: If the checkpoint does not exist.
        CorruptCheckpointError: If its index is damaged.

    TF name: ``tf.compat.v1.train.NewCheckpointReader``.
    """
    filepattern = check_path("filepattern", filepattern, allow_none=False)
    data = read_index(filepattern, storage)
    open_reader = reader_of(data)
    if open_reader is not None:
        return open_reader(filepattern, storage=storage, index=data)
    return CheckpointReader(filepattern, storage=storage, index=data)


def _checkpoint_prefix(ckpt_dir_or_file: str) -> str:
    from torchsupervisor.checkpoint.state_file import latest_checkpoint

    if storage_for(ckpt_dir_or_file).is_dir(ckpt_dir_or_file):
        prefix = latest_checkpoint(ckpt_dir_or_file)
        if prefix is None:
            raise ValueError(
                f"Couldn't find 'checkpoint' file or checkpoints in given directory "
                f"{ckpt_dir_or_file}"
            )
        return prefix
    return ckpt_dir_or_file


def load_checkpoint(ckpt_dir_or_file: str) -> CheckpointReader | Any:
    """Return a reader for a checkpoint prefix, or for the latest checkpoint of a directory
    (ours, or a TF 1 checkpoint: see ``NewCheckpointReader``).

    Raises:
        ValueError: If a directory holds no checkpoint.
        NotFoundError: If the prefix does not exist.

    TF name: ``tf.train.load_checkpoint``.
    """
    return NewCheckpointReader(_checkpoint_prefix(ckpt_dir_or_file))


def list_variables(ckpt_dir_or_file: str) -> list[tuple[str, list[int]]]:
    """Return ``[(name, shape)]`` of every tensor, sorted by name.

    TF name: ``tf.train.list_variables``.
    """
    shapes = load_checkpoint(ckpt_dir_or_file).get_variable_to_shape_map()
    return sorted(shapes.items())


def load_variable(ckpt_dir_or_file: str, name: str) -> torch.Tensor:
    """Return one tensor of a checkpoint (a ``:0`` suffix on ``name`` is ignored, as in TF).

    Raises:
        NotFoundError: If there is no such tensor.

    TF name: ``tf.train.load_variable``.
    """
    if name.endswith(":0"):
        name = name[:-2]
    return load_checkpoint(ckpt_dir_or_file).get_tensor(name)


def read_manifests(
    prefixes: Iterable[str], *, storage: Storage = BY_PATH
) -> dict[str, Manifest | None]:
    """Return each prefix's manifest, or None where it cannot be read (for listings)."""
    out: dict[str, Manifest | None] = {}
    for prefix in prefixes:
        try:
            out[prefix] = CheckpointReader(prefix, storage=storage).manifest
        except (NotFoundError, CorruptCheckpointError):
            out[prefix] = None
    return out
