"""The commit protocol: a checkpoint appears complete, or not at all, on any ``Storage``.

One protocol for the single-process writer (``persist``) and for every rank of a sharded save
(``checkpoint/sharded/writer.py`` calls ``retire``, ``put_shard`` and ``publish``):

1. ``retire``: refuse to overwrite data files of ``P`` that other checkpoints still
   reference; if ``P.index`` already exists (a save at the same step), delete it first: from
   then on the old ``P`` counts as incomplete and restores fall back to the previous one;
2. ``put_shard``: put each new shard ``P.data-0000i-of-0000N`` (``Storage.put``: locally a
   temporary name, fsync, rename, fsync of the directory). In ``persist`` a helper thread
   computes the CRC-32C of every copied tensor and of every new shard (in C, without the GIL)
   and encodes the manifest meanwhile, which takes the checksums off the commit's critical
   path;
3. ``publish``: put the manifest ``P.index``. Its presence is the commit point;
4. ``remove_stale_shards``: data files of an earlier save to ``P`` with another shard count.

If any step fails, the shards this attempt put are deleted and ``CheckpointSaveError`` is
raised; other checkpoints are never touched. Shards without an index that a crash leaves are
removed at the next start (``recovery.clean_checkpoint_dir``). The state file and retention
come after the commit, in the ``Saver``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import crc32c

from torchsupervisor.checkpoint import incremental
from torchsupervisor.checkpoint.format import (
    Manifest,
    ShardEntry,
    TensorEntry,
    data_filename,
)
from torchsupervisor.checkpoint.incremental import Committed
from torchsupervisor.checkpoint.references import referenced_data_files
from torchsupervisor.checkpoint.shard_header import shard_checksum
from torchsupervisor.checkpoint.snapshot import Snapshot
from torchsupervisor.checkpoint.tree_memo import TreeMemo
from torchsupervisor.core import thread_registry
from torchsupervisor.core import threads as priority
from torchsupervisor.core.tree import encode_tree
from torchsupervisor.errors import CheckpointSaveError
from torchsupervisor.storage import BY_PATH, Storage, WriteCancelled

__all__ = [
    "Commit",
    "delete_quietly",
    "needs_retirement",
    "persist",
    "publish",
    "put_shard",
    "remove_stale_shards",
    "retire",
    "same_prefix_shards",
]

logger = logging.getLogger("torchsupervisor")

_DATA_RE = re.compile(r"\.data-\d{5}-of-\d{5}")


@dataclass(frozen=True)
class Commit:
    """The result of a committed save.

    Attributes:
        manifest: What was written to ``P.index``.
        committed: For every tensor, where its bytes now live (for the next incremental save).
        bytes_written: Bytes of new shard data written (headers included; the index excluded).
    """

    manifest: Manifest
    committed: dict[str, Committed]
    bytes_written: int


def persist(
    snapshot: Snapshot,
    prefix: str,
    *,
    library_version: str,
    torch_version: str,
    world_size: int = 1,
    storage: Storage = BY_PATH,
    cancel: threading.Event | None = None,
    trees: TreeMemo | None = None,
    metrics: dict[str, float] | None = None,
    origin: dict[str, str | int] | None = None,
    row_blocks: bool = True,
) -> Commit:
    """Write ``snapshot`` as the checkpoint ``prefix`` with the commit protocol.

    Args:
        snapshot: The staged state.
        prefix: The checkpoint prefix, e.g. ``logdir/model.ckpt-1234``.
        library_version: Recorded in the manifest.
        torch_version: Recorded in the manifest.
        world_size: Recorded in the manifest (the number of replicas that trained).
        storage: Where the files go.
        cancel: If set while writing, the save stops and removes what it wrote (a save that
            cannot finish within a preemption grace period is abandoned, never half-written).
        trees: The last save's tree encodings, for a snapshot of a walk's skeleton
            (``tree_memo.TreeMemo``; used one save at a time); None: encoded anew.
        metrics: Recorded in the manifest (``Saver.save(metrics=)``); None: none.
        origin: Recorded in the manifest (``Saver(origin=)``); None: none.
        row_blocks: Record the CRC-32C of the larger tensors' blocks of rows
            (``Manifest.row_blocks``; ``Saver(row_blocks=)``).

    Returns:
        The manifest committed and where every tensor's bytes live.

    Raises:
        CheckpointSaveError: If anything fails (an ``OSError`` is the ``__cause__``); the
            temporary and partial files of this attempt have been removed.
        StaleReferenceError: (a ``CheckpointSaveError``) if reused tensors were modified
            behind PyTorch's back; nothing was written.

    Thread safety: meant for the writer thread; two saves to the same prefix must not overlap.
    """
    num_shards = len(snapshot.layout.shards)
    finals = [data_filename(prefix, i, num_shards) for i in range(num_shards)]
    ref_tensors: dict[str, TensorEntry] = {}
    ref_shards: list[ShardEntry] = []
    committed: dict[str, Committed] = {}
    try:
        _add_references(snapshot, prefix, finals, ref_tensors, ref_shards, committed, storage)
    except (OSError, ValueError) as e:
        raise CheckpointSaveError(f"Saving checkpoint {prefix} failed: {e}", path=prefix) from e

    def prepare_manifest() -> tuple[Manifest, bytes]:
        """Checksums, then the manifest and its encoding (on a helper thread)."""
        tensors: dict[str, TensorEntry] = {}
        shards: list[ShardEntry] = []
        blocks = {n: ref.blocks for n, ref in committed.items() if ref.blocks is not None}
        for i, shard_layout in enumerate(snapshot.layout.shards):
            entries, new_blocks = snapshot.checksummed(i, row_blocks=row_blocks)
            blocks.update(new_blocks)
            shard = ShardEntry(
                file=os.path.basename(finals[i]),
                size_bytes=shard_layout.size_bytes,
                data_offset=shard_layout.data_offset,
                crc32c=shard_checksum(shard_layout.header, [e.crc32c for _, e in entries]),
                header_crc32c=crc32c.crc32c(shard_layout.header),
            )
            shards.append(shard)
            for name, entry in entries:
                tensors[name] = entry
                source, version = snapshot.sources[name]
                if version is not None:
                    committed[name] = Committed(source, version, shard, entry, blocks.get(name))
        tensors.update(ref_tensors)  # Referenced shards follow the new ones.
        if trees is not None:
            tree, tree_text = trees.encode(snapshot.tree)
        else:
            tree, tree_text = encode_tree(snapshot.tree), None
        manifest = Manifest(
            global_step=snapshot.step,
            wall_time=snapshot.wall_time,
            tree=tree,
            tensors=tensors,
            shards=(*shards, *ref_shards),
            library_version=library_version,
            torch_version=torch_version,
            world_size=world_size,
            metrics=metrics,
            origin=origin,
            row_blocks=blocks,
        )
        return manifest, manifest.to_bytes(tree_text)

    manifest = _write(snapshot, prefix, finals, prepare_manifest, storage, cancel)
    remove_stale_shards(storage, prefix, set(finals))
    written = sum(s.size_bytes for s in snapshot.layout.shards)
    return Commit(manifest, committed, written)


class _Beside:
    """Run ``fn`` on the checksum helper thread, with the calling thread's CPU priority.

    One daemon helper thread serves every save in turn (starting a thread per save costs
    milliseconds on a busy machine: the new thread must get a core and the GIL before
    ``start()`` returns). The checkpoint writer runs at a low priority so that training does
    not wait for it; the helper runs at the writer's priority as it is when the job starts
    (raised if training waits for the save: ``threads.hurry``), never above it.

    Thread safety: create from the writer thread; ``result()`` from the same thread.
    """

    _lock = threading.Lock()
    _jobs: queue.SimpleQueue[_Beside | None] | None = None

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn: Callable[[], Any] | None = fn
        self._caller = threading.get_native_id()  # Whose priority the job runs at.
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        _Beside._queue().put(self)

    @classmethod
    def _queue(cls) -> queue.SimpleQueue[_Beside | None]:
        with cls._lock:
            if cls._jobs is None:
                cls._jobs = queue.SimpleQueue()
                threading.Thread(
                    target=_serve, args=(cls._jobs,), name="torchsupervisor-checksums", daemon=True
                ).start()
            return cls._jobs

    @classmethod
    def stop_helper(cls) -> None:
        """End the helper thread once it is idle (a later save starts a new one)."""
        with cls._lock:
            jobs, cls._jobs = cls._jobs, None
        if jobs is not None:
            jobs.put(None)

    @classmethod
    def _forget_thread(cls) -> None:
        """In a forked child the helper thread does not exist: start a new one when needed."""
        cls._jobs = None
        cls._lock = threading.Lock()

    def _run(self) -> None:
        fn, self._fn = self._fn, None
        try:
            self._result = fn()
        except BaseException as e:  # Re-raised by result() on the writer thread.
            self._error = e
        finally:
            # What ``fn`` holds (views of the snapshot) is freed before the writer goes on:
            # freed later, it could be freed after the interpreter began to shut down (see
            # ``engine``'s docstring, "at exit").
            del fn
            self._done.set()

    def result(self) -> Any:
        """Wait for ``fn`` and return its result (or raise its exception)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


def _serve(jobs: queue.SimpleQueue[_Beside | None]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        # The caller's priority now (four system calls a job): ``threads.hurry`` may have
        # raised the caller, or this thread, since the job was made.
        priority.follow(job._caller)
        job._run()
        del job  # Do not keep the last snapshot alive while idle.


def _quiet_helper(timeout_secs: float) -> list[str]:
    _Beside.stop_helper()  # Ends once idle; what it is doing belongs to a save in flight.
    return []


thread_registry.register("checksum helper", at_fork=_Beside._forget_thread, quiet=_quiet_helper)


def _add_references(
    snapshot: Snapshot,
    prefix: str,
    finals: list[str],
    tensors: dict[str, TensorEntry],
    shards: list[ShardEntry],
    committed: dict[str, Committed],
    storage: Storage,
) -> None:
    """Point the manifest at the committed bytes of the tensors the snapshot did not copy.

    Fills ``tensors``, ``shards`` (the referenced shard files, numbered after the
    ``len(finals)`` new ones) and ``committed``.
    """
    if not snapshot.references:
        return
    directory = os.path.dirname(prefix)
    own = {os.path.basename(final) for final in finals}
    index_of: dict[str, int] = {}
    for name, ref in snapshot.references.items():
        if ref.shard.file in own:
            raise ValueError(f"{ref.shard.file} is both referenced and rewritten")
        if ref.shard.file not in index_of:
            path = os.path.join(directory, ref.shard.file)
            if not storage.is_file(path) or storage.size(path) != ref.shard.size_bytes:
                raise CheckpointSaveError(
                    f"Saving checkpoint {prefix} failed: {path}, which holds unchanged "
                    "tensors of an earlier checkpoint, is missing or was modified",
                    path=path,
                )
            index_of[ref.shard.file] = len(finals) + len(shards)
            shards.append(ref.shard)
        tensors[name] = dataclasses.replace(ref.entry, shard=index_of[ref.shard.file])
        committed[name] = ref
    incremental.verify(snapshot.references, prefix)


def _write(
    snapshot: Snapshot,
    prefix: str,
    finals: list[str],
    prepare: Callable[[], tuple[Manifest, bytes]],
    storage: Storage,
    cancel: threading.Event | None,
) -> Manifest:
    """Put the shards while ``prepare`` makes the manifest beside; publish it; return it."""
    written: list[str] = []
    prepared: _Beside | None = None
    try:
        retire(storage, prefix, finals)
        for i, final in enumerate(finals):
            if prepared is None:
                # Started now, so that its Python part (the manifest) runs while this thread
                # waits in the write, without the GIL, rather than competing for it.
                prepared = _Beside(prepare)
            put_shard(storage, final, [snapshot.shard_view(i)], cancel)
            written.append(final)
        manifest, encoded = (prepared or _Beside(prepare)).result()
        if cancel is not None and cancel.is_set():
            raise WriteCancelled()
        publish(storage, prefix, encoded)
        return manifest
    except (OSError, ValueError, WriteCancelled) as e:
        try:  # The helper reads the staging buffers: done before they are reused.
            if prepared is not None:
                prepared.result()
        except BaseException:
            pass
        delete_quietly(storage, written)
        if isinstance(e, WriteCancelled):
            raise CheckpointSaveError(
                f"Saving checkpoint {prefix} was cancelled; nothing was committed", path=prefix
            ) from None
        raise CheckpointSaveError(f"Saving checkpoint {prefix} failed: {e}", path=prefix) from e


def retire(storage: Storage, prefix: str, finals: list[str]) -> None:
    """Before a save to ``prefix``: refuse shared data files, then delete an older index.

    Args:
        storage: Where the checkpoint lives.
        prefix: The checkpoint prefix about to be written.
        finals: The data files the save will write.

    Raises:
        ValueError: Data files of ``prefix`` are still referenced by other checkpoints
            (incremental ones); nothing was changed.
        OSError: The older index could not be deleted.
    """
    existing = same_prefix_shards(storage, prefix)
    if existing:
        used = referenced_data_files(os.path.dirname(prefix), exclude=[prefix], storage=storage)
        clash = sorted(os.path.basename(p) for p in existing if os.path.basename(p) in used)
        if clash:
            raise ValueError(
                f"cannot overwrite {prefix}: its data files {clash} still hold tensors of newer "
                "incremental checkpoints"
            )
    del finals  # Overwritten by the puts: only the referenced ones matter.
    index = prefix + ".index"
    if storage.exists(index):
        logger.info("Overwriting checkpoint %s", prefix)
        storage.delete(index)


def needs_retirement(storage: Storage, prefix: str) -> bool:
    """Whether ``retire`` before a save to ``prefix`` has anything to act on: an older save's
    index or data files under that very prefix.

    Raises:
        OSError: The index's existence could not be told.
    """
    return storage.exists(prefix + ".index") or bool(same_prefix_shards(storage, prefix))


def put_shard(
    storage: Storage, path: str, parts: list[memoryview], cancel: threading.Event | None = None
) -> None:
    """Put one data file of a checkpoint, its parts in order (see ``Storage.put``).

    Raises:
        WriteCancelled: ``cancel`` was set.
        OSError: The write failed; nothing of it remains.
    """
    storage.put(path, parts, cancel=cancel)


def publish(storage: Storage, prefix: str, manifest: bytes) -> None:
    """Put ``prefix.index``: the commit point. On failure it does not exist.

    Raises:
        OSError: The write failed (the checkpoint is not committed).
    """
    storage.put(prefix + ".index", [manifest])


def delete_quietly(storage: Storage, paths: list[str]) -> None:
    """Delete the files of a failed attempt; what cannot be deleted is logged."""
    for path in paths:
        try:
            storage.delete(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("Could not remove %s of a failed save: %s", path, e)


def same_prefix_shards(storage: Storage, prefix: str) -> list[str]:
    """The data files ``<prefix>.data-?????-of-?????`` that exist now."""
    directory = os.path.dirname(prefix)
    base = os.path.basename(prefix)
    try:
        names = storage.list(directory)
    except OSError:
        return []
    return [
        os.path.join(directory, name)
        for name in names
        if name.startswith(base) and _DATA_RE.fullmatch(name[len(base) :])
    ]


def remove_stale_shards(storage: Storage, prefix: str, keep: set[str]) -> None:
    """Remove data files of an earlier save to the same prefix with another shard count."""
    for path in same_prefix_shards(storage, prefix):
        if path not in keep:
            try:
                storage.delete(path)
            except OSError as e:
                logger.warning("Could not remove stale shard %s: %s", path, e)
