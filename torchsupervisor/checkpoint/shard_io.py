"""Reading a checkpoint's shards: open, read ranges, check what no tensor checksum covers.

``open_shard`` opens a data file after checking that it is a regular file in the
checkpoint's directory and has the size the manifest records. Tensors are read by ranges
(``Readable.readinto``) by ``tensor_reads``: several at once where the storage says that is
faster (``parallel_reads``; local files: 8 MiB reads, 4 in flight), else in order on a helper
thread (``pipelined_reads``); either way the disk stays busy while the caller checksums what
arrived, in file order. ``check_shard`` verifies the bytes no tensor checksum covers: the
shard's header. Anything wrong raises ``CorruptCheckpointError`` naming the file.

Used by ``CheckpointReader`` and by every rank of a sharded restore.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import crc32c
import torch

from torchsupervisor.checkpoint.entries import dtype_to_code
from torchsupervisor.checkpoint.format import (
    ManifestError,
    ShardEntry,
    TensorEntry,
)
from torchsupervisor.checkpoint.shard_header import (
    parse_safetensors_entries,
    parse_safetensors_header,
    shard_checksum,
)
from torchsupervisor.errors import CorruptCheckpointError
from torchsupervisor.storage import (
    BY_PATH,
    NotRegularFileError,
    OutsideDirectoryError,
    Readable,
    Storage,
    read_exactly,
)

__all__ = [
    "check_shard",
    "open_checked",
    "open_shard",
    "parallel_reads",
    "pipelined_reads",
    "pread_exactly",
    "read_tensor",
    "scratch_reads",
    "tensor_reads",
]

_CHUNK_BYTES = 16 << 20
_PIPELINE_MIN_BYTES = 64 << 20
_PARALLEL_CHUNK_BYTES = 8 << 20


def check_shard(
    f: Readable,
    shard: ShardEntry,
    read: Mapping[tuple[int, int], int],
    entries: Iterable[tuple[str, TensorEntry]] = (),
) -> None:
    """Verify the bytes of a shard that no tensor checksum covers: its header.

    Reads the header (``shard.data_offset`` bytes, a few KiB) and compares its CRC with the
    manifest's ``header_crc32c``: the header is then the one written, whose tensors tile the
    data area exactly, so with the tensors' own checksums every byte read is verified (the
    tensors of the shard this checkpoint does not use are not read). A manifest written
    before ``header_crc32c`` existed: the header must have the right length field, be valid
    safetensors JSON whose tensors tile the data area exactly, and list every tensor read at
    the bytes it was read from; when all of the shard's tensors were read, the shard checksum
    (``shard_checksum``: header and tensor CRCs) is compared with the manifest's.

    Then the manifest must say what the shard's own header says: a tensor read with another
    dtype, shape or byte range than its header gives (a manifest edited, its checksum
    recomputed: the bytes would be reinterpreted) is damage.

    Args:
        f: The open shard (its size already checked against ``shard.size_bytes``).
        shard: The shard's manifest entry.
        read: ``{(begin, end): CRC-32C}`` of the tensors read from the shard (already
            verified against their own checksums), by byte range relative to the data area.
        entries: ``(name, manifest entry)`` of the tensors read from the shard, to compare
            with its header.

    Raises:
        CorruptCheckpointError: Naming the file, ``reason="header damaged"``, or
            ``reason="manifest disagrees with the shard"``.
    """

    def damaged(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"Checkpoint shard {path} is corrupt: header damaged ({what})",
            path=path,
            reason="header damaged",
        )

    path = f.path
    header = bytearray(shard.data_offset)
    pread_exactly(f, memoryview(header), 0)
    if shard.header_crc32c is not None:
        if crc32c.crc32c(header) != shard.header_crc32c:
            raise damaged("checksum mismatch")
        _check_entries(path, header, entries)
        return
    if len(header) < 8 or int.from_bytes(header[:8], "little") != len(header) - 8:
        raise damaged("its length field does not match the data offset")
    try:
        ranges = parse_safetensors_header(memoryview(header)[8:])
    except ManifestError as e:
        raise damaged(str(e)) from None
    end = 0
    for _, begin, stop in ranges:
        if begin != end:
            raise damaged(f"its tensors do not tile the data area (a gap or overlap at {end})")
        end = stop
    if end != shard.size_bytes - shard.data_offset:
        raise damaged(
            f"its tensors end at data byte {end}; the data area has "
            f"{shard.size_bytes - shard.data_offset} bytes"
        )
    listed = {(begin, stop) for _, begin, stop in ranges}
    missing = [r for r in read if r[1] > r[0] and r not in listed]
    if missing:
        raise damaged(f"it does not list the tensor read at data bytes {list(missing[0])}")
    if all(stop == begin or (begin, stop) in read for _, begin, stop in ranges):
        crcs = [read.get((begin, stop), 0) for _, begin, stop in ranges]
        if shard_checksum(header, crcs) != shard.crc32c:
            raise damaged("shard checksum mismatch")
    _check_entries(path, header, entries)


def _check_entries(
    path: str, header: bytearray, entries: Iterable[tuple[str, TensorEntry]]
) -> None:
    """Raise ``CorruptCheckpointError`` where the manifest and the shard's header disagree."""
    entries = list(entries)
    if not entries:
        return
    try:
        own = parse_safetensors_entries(memoryview(header)[8:])
    except ManifestError as e:
        own, trouble = {}, str(e)
    else:
        trouble = None
    for name, entry in entries:
        said = (dtype_to_code(entry.dtype), list(entry.shape), entry.begin, entry.end)
        found = own.get(name)
        if found != said:
            what = trouble or (
                f"it does not list {name!r}"
                if found is None
                else f"{name!r} is {_describe(found)} there, {_describe(said)} in the manifest"
            )
            raise CorruptCheckpointError(
                f"Checkpoint shard {path} is corrupt: the manifest disagrees with the shard's "
                f"own header ({what})",
                path=path,
                reason="manifest disagrees with the shard",
            )


def _describe(entry: tuple[str, list[int], int, int]) -> str:
    dtype, shape, begin, end = entry
    return f"{dtype} {shape} at data bytes {begin}-{end}"


def tensor_reads(
    f: Readable, tensors: list[tuple[str, int, int]]
) -> Iterator[tuple[str, torch.Tensor, memoryview]]:
    """Read ``(name, file offset, size in bytes)`` tensors the fastest way ``f`` allows.

    ``parallel_reads`` if ``f.concurrent_reads`` is above 1 and there is more than one chunk
    to read, else ``pipelined_reads``. Yields as they do, in order.
    """
    total = sum(nbytes for _, _, nbytes in tensors)
    if f.concurrent_reads > 1 and total > _PARALLEL_CHUNK_BYTES:
        return parallel_reads(f, tensors)
    return pipelined_reads(f, tensors)


def parallel_reads(
    f: Readable, tensors: list[tuple[str, int, int]]
) -> Iterator[tuple[str, torch.Tensor, memoryview]]:
    """Read ``(name, file offset, size in bytes)`` tensors by chunks, several at once.

    Up to ``f.concurrent_reads`` chunks of 8 MiB are read at a time on helper threads, each
    straight into its tensor's own buffer (not initialized: every byte is read), and at most
    ``2 * f.concurrent_reads`` chunks are asked for ahead of the one being yielded. Yields
    ``(name, buffer, chunk)`` in file order as each chunk is complete, like
    ``pipelined_reads``; a generator closed early cancels the reads not started and waits for
    the others.

    Raises:
        CorruptCheckpointError: If the file ends early.
        OSError: If a read fails.
    """
    ahead = 2 * f.concurrent_reads
    with ThreadPoolExecutor(
        f.concurrent_reads, thread_name_prefix="torchsupervisor-checkpoint-reader"
    ) as pool:
        pending: collections.deque[tuple[str, torch.Tensor, memoryview, Future[None]]]
        pending = collections.deque()
        chunks = _chunks(tensors, _PARALLEL_CHUNK_BYTES, torch.empty)
        try:
            while True:
                for name, raw, chunk, at in itertools.islice(chunks, ahead - len(pending)):
                    pending.append((name, raw, chunk, pool.submit(pread_exactly, f, chunk, at)))
                if not pending:
                    return
                name, raw, chunk, future = pending.popleft()
                future.result()
                yield name, raw, chunk
        finally:
            for *_, future in pending:
                future.cancel()


def _chunks(
    tensors: list[tuple[str, int, int]], chunk_bytes: int, allocate: Callable[..., torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor, memoryview, int]]:
    """Each tensor's buffer (``allocate``d as its first chunk is asked for) by chunks:
    ``(name, buffer, chunk of it, file offset of the chunk)``; one empty chunk for 0 bytes."""
    for name, offset, nbytes in tensors:
        raw = allocate(nbytes, dtype=torch.uint8)
        view = memoryview(raw.numpy())
        for start in range(0, nbytes, chunk_bytes):
            yield name, raw, view[start : start + chunk_bytes], offset + start
        if not nbytes:
            yield name, raw, view, offset


def pipelined_reads(
    f: Readable, tensors: list[tuple[str, int, int]]
) -> Iterator[tuple[str, torch.Tensor, memoryview]]:
    """Read ``(name, file offset, size in bytes)`` tensors on a helper thread, by chunks,
    after ``f.read_ahead`` from the first.

    Yields ``(name, buffer, chunk)`` as each chunk arrives; ``buffer`` is the tensor's uint8
    buffer (allocated by the reader, just before its first read, so that the disk is busy
    while memory is being allocated) and ``chunk`` a view of the bytes just read.

    Raises:
        CorruptCheckpointError: If the file ends early.
        OSError: If a read fails.
    """
    if tensors:
        f.read_ahead(tensors[0][1])
    ready: queue.SimpleQueue[tuple[str, torch.Tensor, memoryview] | BaseException | None]
    ready = queue.SimpleQueue()
    stop = threading.Event()

    def chunks() -> Iterator[tuple[str, torch.Tensor, memoryview]]:
        # Zero-filled, not just allocated: touching fresh pages in user space is several
        # times cheaper than letting the kernel fault them in during read().
        for name, raw, chunk, at in _chunks(tensors, _CHUNK_BYTES, torch.zeros):
            pread_exactly(f, chunk, at)
            yield name, raw, chunk

    if sum(nbytes for _, _, nbytes in tensors) < _PIPELINE_MIN_BYTES:
        yield from chunks()  # Not worth a thread.
        return

    def read_all() -> None:
        try:
            for item in chunks():
                if stop.is_set():
                    return
                ready.put(item)
            ready.put(None)
        except BaseException as e:
            ready.put(e)

    reader = threading.Thread(target=read_all, name="torchsupervisor-checkpoint-reader")
    reader.start()
    try:
        while True:
            item = ready.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        reader.join()


def scratch_reads(
    f: Readable, tensors: list[tuple[str, int, int]]
) -> Iterator[tuple[str, None, memoryview]]:
    """Read ``(name, file offset, size in bytes)`` tensors by chunks into one reused buffer.

    Yields ``(name, None, chunk)``: the chunk is valid until the next one is read (for
    checksums that keep nothing).
    """
    if tensors:
        f.read_ahead(tensors[0][1])
    buffer = memoryview(bytearray(min(_CHUNK_BYTES, max((n for _, _, n in tensors), default=0))))
    for name, offset, nbytes in tensors:
        if not nbytes:
            yield name, None, buffer[:0]
        for start in range(0, nbytes, _CHUNK_BYTES):
            chunk = buffer[: min(_CHUNK_BYTES, nbytes - start)]
            pread_exactly(f, chunk, offset + start)
            yield name, None, chunk


def pread_exactly(f: Readable, view: memoryview, offset: int) -> None:
    """Fill ``view`` with the bytes of ``f`` from ``offset`` (in bytes) on.

    Raises:
        CorruptCheckpointError: The file ends first (it is truncated).
    """
    try:
        read_exactly(f, view, offset)
    except EOFError:
        raise _truncated(f.path, None) from None


def read_tensor(f: Readable, offset: int, entry: TensorEntry) -> tuple[torch.Tensor, int]:
    """Read one tensor at ``offset``; return it and the CRC-32C of its bytes."""
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype), 0
    raw = torch.empty(entry.nbytes, dtype=torch.uint8)
    view = memoryview(raw.numpy())
    pread_exactly(f, view, offset)
    return raw.view(entry.dtype).reshape(entry.shape), crc32c.crc32c(view)


def open_checked(
    path: str, storage: Storage, directory: str | None, what: str = "Checkpoint shard"
) -> Readable:
    """Open a file of a checkpoint for reading; every failure a ``CorruptCheckpointError``
    naming it (``what`` and ``path``): missing, not a regular file, a link out of
    ``directory`` (None: not checked), unreadable. Our shards (``open_shard``), TF 1 data
    files (``interop/tf_bundle``) and DCP's (``interop/dcp_import``) are opened so.
    """
    try:
        return storage.open_read(path, inside=directory)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{what} {path} is missing", path=path, reason="missing file"
        ) from None
    except NotRegularFileError as e:
        raise CorruptCheckpointError(
            f"{what} {path} is not a regular file ({e.kind})", path=path, reason="not a file"
        ) from None
    except OutsideDirectoryError:
        raise CorruptCheckpointError(
            f"{what} {path} is not a regular file of the directory: a link out of the "
            "checkpoint's directory",
            path=path,
            reason="outside the directory",
        ) from None
    except OSError as e:
        raise CorruptCheckpointError(
            f"{what} {path} cannot be read: {e}", path=path, reason="unreadable"
        ) from e


def open_shard(
    path: str, expected_bytes: int, storage: Storage = BY_PATH, *, directory: str | None = None
) -> Readable:
    """Open a checkpoint shard for reading after checking that it has the expected size.

    Args:
        path: The shard's path.
        expected_bytes: Its size recorded in the manifest.
        storage: Where the checkpoint lives.
        directory: The checkpoint's directory: the shard, once symbolic links are resolved,
            must lie in it. None: not checked.

    Returns:
        The open shard (the caller closes it).

    Raises:
        CorruptCheckpointError: If the file is missing, unreadable, not a regular file, a
            link out of ``directory``, shorter (truncated) or longer than ``expected_bytes``,
            naming the file.
    """
    f = open_checked(path, storage, directory)
    if f.size != expected_bytes:
        f.close()
        what = "is truncated" if f.size < expected_bytes else "is too long"
        raise CorruptCheckpointError(
            f"Checkpoint shard {path} {what}: {f.size} bytes, expected {expected_bytes}",
            path=path,
            reason="truncated" if f.size < expected_bytes else "wrong size",
        )
    return f


def _truncated(path: str, expected: int | None) -> CorruptCheckpointError:
    detail = f" (expected {expected} bytes)" if expected is not None else ""
    return CorruptCheckpointError(
        f"Checkpoint shard {path} is truncated{detail}", path=path, reason="truncated"
    )
