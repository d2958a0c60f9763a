"""Export a checkpoint's model to Hugging Face's format: sharded safetensors and their index.

``export_hf(checkpoint, out_dir)`` writes the tensors under one entry of the saved state
(``model`` by default, the names of ``model.state_dict()``) as
``model-00001-of-0000N.safetensors`` files of at most ``max_shard_bytes`` each (a tensor
larger than that gets a file of its own), then ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``), last: a reader that
finds the index finds every file it names. Dtypes are kept. This is the layout
``transformers``' ``from_pretrained`` and ``load_sharded_checkpoint`` read (with the model's
``config.json``, which is the user's).

It streams: each file's header is written from the manifest (names, dtypes, shapes, offsets),
then each tensor's bytes are copied from the checkpoint's shards in pieces of 16 MiB through
one reused buffer, every CRC-32C checked on the way (``CheckpointReader.iter_tensor_bytes``),
so memory stays at a piece whatever the model's size, for a checkpoint of one process or of
sharded ranks (FSDP2 chunks along the first dimension stream chunk by chunk; others are
assembled, one tensor at a time), on disk or in a bucket. Each file is written under a
temporary name and renamed when complete: a damaged tensor, found at its last piece, leaves
no file with its bytes.

TF name: none.
"""

from __future__ import annotations

import json
import os
import queue
import re
import struct
import threading
from collections.abc import Iterator
from typing import Any

from torchsupervisor.checkpoint.reader import GLOBAL_STEP_NAME, CheckpointReader, load_checkpoint
from torchsupervisor.core.dtypes import dtype_to_code
from torchsupervisor.errors import AlreadyExistsError, InvalidArgumentError
from torchsupervisor.storage import LocalStorage, storage_for

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "INDEX_FILE", "export_hf", "plan_shards"]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""The largest file ``export_hf`` writes (5 GB: ``save_pretrained``'s default), a tensor
larger than it aside."""
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors\Z")
_POLL_SECS = 0.1
PIECE_BYTES = 16 << 20
"""The bytes copied at a time (one buffer, reused)."""


class _Stopped(Exception):
    """The consumer of a ``ReadAhead`` went away: its thread stops."""


_END = object()


class BufferPool:
    """``depth`` buffers of ``piece_bytes``, made once and shared by the ``ReadAhead`` of
    every file of an export (a new 16 MiB buffer costs its page faults: 12 ms here)."""

    def __init__(self, piece_bytes: int, depth: int = 3) -> None:
        self.free: queue.Queue[memoryview] = queue.Queue()
        self.members: dict[int, memoryview] = {}
        for _ in range(depth):
            buffer = memoryview(bytearray(piece_bytes))
            self.members[id(buffer.obj)] = buffer
            self.free.put(buffer)


class ReadAhead:
    """The pieces ``produce(buffer_for)`` yields, read on a helper thread into the buffers of
    ``pool``, ahead of the consumer: reading and checking the next pieces overlaps writing
    this one (each call releases the GIL). A piece's buffer goes back to the pool when the
    consumer asks for the next piece (``Storage.put_streamed``'s rule); an error of the
    producer is raised in the consumer; a consumer that stops early stops the thread.

    TF name: none.
    """

    def __init__(self, produce: Any, pool: BufferPool) -> None:
        self._produce = produce
        self._free = pool.free
        self._members = pool.members
        self._ready: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="torchsupervisor-export-read", daemon=True
        )

    def _buffer_for(self, size: int) -> memoryview:
        while not self._stop.is_set():
            try:
                buffer = self._free.get(timeout=_POLL_SECS)
            except queue.Empty:
                continue
            return buffer if len(buffer) >= size else memoryview(bytearray(size))
        raise _Stopped

    def _run(self) -> None:
        try:
            for piece in self._produce(self._buffer_for):
                self._ready.put(piece)
            self._ready.put(_END)
        except _Stopped:
            pass
        except BaseException as e:  # Raised in the consumer's thread.
            self._ready.put(e)

    def _release(self, piece: memoryview) -> None:
        buffer = self._members.get(id(piece.obj))
        if buffer is not None:
            self._free.put(buffer)

    def __iter__(self) -> Iterator[memoryview]:
        self._thread.start()
        current = None
        try:
            while True:
                item = self._ready.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                current = item
                yield item
                self._release(item)  # Asked for the next piece: this one was written.
                current = None
        finally:
            if current is not None:  # The consumer stopped at this piece.
                self._release(current)
            self._stop.set()
            self._thread.join()
            while not self._ready.empty():  # Read ahead of a consumer that stopped early.
                item = self._ready.get()
                if isinstance(item, memoryview):
                    self._release(item)


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[tuple[str, int]]]:
    """Split ``(name, bytes)`` in order into files of at most ``max_shard_bytes`` each (a
    tensor larger than that alone in its file)."""
    shards: list[list[tuple[str, int]]] = [[]]
    total = 0
    for name, size in sizes:
        if shards[-1] and total + size > max_shard_bytes:
            shards.append([])
            total = 0
        shards[-1].append((name, size))
        total += size
    return shards if shards[0] else []


def _specs(reader: CheckpointReader) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """Every stored tensor's dtype and shape (the global step, in the metadata, aside)."""
    dtypes = reader.get_variable_to_dtype_map()
    shapes = reader.get_variable_to_shape_map()
    if reader.step_alias:
        del shapes[GLOBAL_STEP_NAME]
    return {n: (dtypes[n], tuple(s)) for n, s in shapes.items()}


def _header(
    specs: dict[str, tuple[Any, tuple[int, ...]]], names: list[tuple[str, str]], metadata: dict
) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, source in names:
        dtype, shape = specs[source]
        size = _nbytes(dtype, shape)
        header[name] = {
            "dtype": dtype_to_code(dtype),
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # The data starts 8-byte aligned, as safetensors writes.
    return struct.pack("<Q", len(text)) + text


def _nbytes(dtype: Any, shape: tuple[int, ...]) -> int:
    import torch

    numel = 1
    for d in shape:
        numel *= d
    return numel * torch.empty((), dtype=dtype).element_size()


def export_hf(
    checkpoint: str,
    out_dir: str,
    *,
    subtree: str | None = "model",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> list[str]:
    """Write ``checkpoint``'s tensors under ``subtree`` as Hugging Face sharded safetensors.

    Args:
        checkpoint: A checkpoint prefix, or a log directory (its newest checkpoint); on disk
            or in a bucket.
        out_dir: The directory to write (made if missing; local or a bucket).
        subtree: The state entry that is the model (``"model"``: the tensors named
            ``model/...``, written without that part); None: every tensor, full names.
        max_shard_bytes: The largest file, in bytes.
        overwrite: Replace an existing export (its index is deleted first, its files that
            the new one does not write, last); else ``AlreadyExistsError``.

    Returns:
        The files written, the index last.

    Raises:
        InvalidArgumentError: Nothing under ``subtree`` (the message lists the entries), or
            ``max_shard_bytes`` < 1.
        AlreadyExistsError: ``out_dir`` holds an index already and not ``overwrite``.
        CorruptCheckpointError: A tensor fails its checksum (its file is not written).
        ValueError: A dtype safetensors cannot store (``complex128``).

    TF name: none.
    """
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise InvalidArgumentError(
            f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}"
        )
    reader = load_checkpoint(checkpoint)
    if not isinstance(reader, CheckpointReader):
        raise InvalidArgumentError(
            f"{checkpoint} is not a checkpoint of torchsupervisor (a TF 1 one: restore it into "
            "a model with interop.restore_tf_checkpoint, save, then export)"
        )
    specs = _specs(reader)
    if subtree:
        head = subtree.rstrip("/") + "/"
        names = [(n[len(head) :], n) for n in sorted(specs) if n.startswith(head)]
        if not names:
            roots = sorted({n.split("/", 1)[0] for n in specs})
            raise InvalidArgumentError(
                f"No tensor under '{head}' in {reader.prefix}; the state entries with tensors "
                f"are: {', '.join(roots)}"
            )
    else:
        names = [(n, n) for n in sorted(specs)]
    storage = storage_for(out_dir)
    index_path = os.path.join(out_dir, INDEX_FILE)
    if storage.exists(index_path):
        if not overwrite:
            raise AlreadyExistsError(
                f"{index_path} exists; pass overwrite=True (--force) to replace it"
            )
        storage.delete(index_path)  # First: no index ever names a mix of old and new files.
    storage.makedirs(out_dir)
    sources = dict(names)
    plan = plan_shards([(n, _nbytes(*specs[s])) for n, s in names], max_shard_bytes)
    metadata = {"format": "pt", "source": reader.prefix}
    if reader.global_step is not None:
        metadata["global_step"] = str(reader.global_step)
    written, weight_map, total = [], {}, 0
    pool = BufferPool(PIECE_BYTES)
    for k, shard in enumerate(plan):
        file = f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors"
        path = os.path.join(out_dir, file)
        header = _header(specs, [(n, sources[n]) for n, _ in shard], metadata)

        def pieces(buffer_for: Any, shard: list = shard) -> Iterator[memoryview]:
            for name, _ in shard:
                yield from reader.iter_tensor_bytes(sources[name], PIECE_BYTES, buffer_for)

        def chunks(header: bytes = header, pieces: Any = pieces) -> Iterator[Any]:
            yield header
            yield from ReadAhead(pieces, pool)

        if isinstance(storage, LocalStorage):
            storage.put_streamed(path, chunks())
        else:  # An object store copies each piece into its upload part as it comes.
            storage.put(path, chunks())
        written.append(path)
        for name, size in shard:
            weight_map[name] = file
            total += size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    storage.put(index_path, [json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"])
    for name in storage.list(out_dir):  # The files of an earlier export that are not ours.
        path = os.path.join(out_dir, name)
        if _SHARD_FILE.match(name) and path not in written:
            storage.delete(path)
    return [*written, index_path]
