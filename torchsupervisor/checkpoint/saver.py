"""``Saver``: TF's checkpoint API composed from the snapshot, commit and retention parts.

Saving is split in two. ``stage`` (on the calling thread) copies the state into host staging
buffers; ``persist`` (on the calling thread for ``save``, on the writer thread for
``save_async``) writes the files with the commit protocol, then updates the ``checkpoint`` state
file, then deletes the checkpoints that retention lets go. At most one save is in flight: a new
save first waits until the one being written is committed (or failed), then takes its snapshot.
(The Supervisor never makes the training thread wait: a checkpoint its timer asks for while a
save is in flight is taken at the first step boundary after that save commits.)

Saves are incremental by default: a frozen tensor (one nothing in the state trains or updates:
``state.flatten_state``) unchanged since the last committed checkpoint of the same directory is
neither copied nor written again; the new manifest references the bytes already on disk
(``incremental.py``), and retention keeps data files as long as a kept
checkpoint references them. A save is full (references nothing) whenever an incremental one
would leave every kept checkpoint depending on one data file (``policy.may_reference``): the
kept checkpoints always hold two independent copies of every tensor, so one damaged file
never leaves a restart without a valid checkpoint.

A state holding ``DTensor`` s (an FSDP2 model) is saved with ``sharded.save_sharded``: every rank
of the process group calls ``save`` at the same step and writes its own part, synchronously
(the call returns once the checkpoint is committed; ``save_async`` does the same). Rank 0 then
updates the state file and applies retention. ``restore`` of such a state is a collective too
(``sharded.load_sharded``); any world size restores any checkpoint of the format.

TF name: ``tf.compat.v1.train.Saver``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchsupervisor._version import __version__
from torchsupervisor.checkpoint import policy
from torchsupervisor.checkpoint.commit import persist
from torchsupervisor.checkpoint.engine import CheckpointEngine
from torchsupervisor.checkpoint.files import (
    checkpoint_exists,
    get_checkpoint_mtimes,
    list_checkpoint_files,
    remove_checkpoint,
)
from torchsupervisor.checkpoint.format import ManifestError, decode_tree
from torchsupervisor.checkpoint.incremental import Committed, StaleReferenceError
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.checkpoint.references import referenced_data_files
from torchsupervisor.checkpoint.sharded.collective import is_sharded, load_sharded, save_sharded
from torchsupervisor.checkpoint.snapshot import Snapshot, Stager
from torchsupervisor.checkpoint.state_file import (
    state_file_path,
    update_checkpoint_state_internal,
)
from torchsupervisor.core.checks import check_bool, check_int, check_number, check_str
from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.global_step import read_step
from torchsupervisor.core.state import (
    ShardedStateError,
    TensorSpec,
    check_state,
    flatten_state,
    load_state,
    select_state,
)
from torchsupervisor.errors import CheckpointSaveError, CorruptCheckpointError, NotFoundError
from torchsupervisor.storage import LOCAL, DirectoryLock, Storage

__all__ = ["SaveStats", "Saver"]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _local_shard_bytes(prefix: str, storage: Storage) -> int:
    """Bytes of the data shard this rank wrote for sharded checkpoint ``prefix``."""
    directory, base = os.path.split(prefix)
    mine = f"{base}.data-{_rank():05d}-of-"
    try:
        names = [n for n in storage.list(directory) if n.startswith(mine)]
        return sum(storage.size(os.path.join(directory, n)) for n in names)
    except OSError:
        return 0


def _world_size() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _report_differences(
    manifest: Any, tree: Any, state: Mapping[str, Any], source: str, whole_state: bool
) -> None:
    """Warn about what differs between the run that saved a checkpoint and this one.

    What would make the restore fail or change values (missing entries, shapes, dtypes) is
    checked by ``state.check_state`` before anything is loaded; this reports the rest:
    entries of the checkpoint that nothing restores (when the whole state is restored),
    another world size, another torch or torchsupervisor version.
    """
    if whole_state and isinstance(tree, Mapping):
        unused = sorted(str(k) for k in tree if k not in state)
        if unused:
            logger.warning("Checkpoint %s has entries the state does not use: %s", source, unused)
    if manifest.world_size != _world_size():
        logger.warning(
            "Checkpoint %s was written by %d replicas; this run has %d",
            source,
            manifest.world_size,
            _world_size(),
        )
    if manifest.torch_version.split("+")[0] != torch.__version__.split("+")[0]:
        logger.warning(
            "Checkpoint %s was written with torch %s; this is torch %s",
            source,
            manifest.torch_version,
            torch.__version__,
        )
    if manifest.library_version != __version__:
        logger.warning(
            "Checkpoint %s was written with torchsupervisor %s; this is torchsupervisor %s",
            source,
            manifest.library_version,
            __version__,
        )


def _spec_tree(reader: CheckpointReader) -> Any:
    """The checkpoint's state tree with ``TensorSpec`` leaves, from its manifest alone.

    Raises:
        CorruptCheckpointError: If the tree names a tensor the manifest does not list.
    """
    dtypes = reader.get_variable_to_dtype_map()
    shapes = reader.get_variable_to_shape_map()

    def leaf(name: str, ndarray: bool) -> TensorSpec:
        if name not in dtypes:
            raise ManifestError(f"the tree names an unknown tensor {name!r}")
        return TensorSpec(name, dtypes[name], tuple(shapes[name]), ndarray)

    try:
        return decode_tree(reader.manifest.tree, leaf)
    except ManifestError as e:
        index = reader.prefix + ".index"
        raise CorruptCheckpointError(
            f"Checkpoint index {index} is corrupt: {e}", path=index, reason=str(e)
        ) from None


logger = logging.getLogger("torchsupervisor")

_DEFAULT_SHARD_BYTES = 1 << 30


def _family_key(save_path: str) -> str:
    return os.path.normpath(os.path.abspath(save_path))


def _state_key(save_path: str, latest_filename: str | None) -> tuple[str, str]:
    directory = os.path.normpath(os.path.abspath(os.path.dirname(save_path) or os.curdir))
    return directory, latest_filename or "checkpoint"


def _in_directory(path: str, directory: str, storage: Storage) -> bool:
    """True if checkpoint ``path`` lies in ``directory`` (symbolic links resolved)."""
    return storage.canonical(os.path.dirname(path)) == storage.canonical(directory)


def _in_family(prefix: str, save_path: str) -> bool:
    """True if ``prefix`` is ``save_path`` or ``save_path-<step>``."""
    prefix, save_path = os.path.normpath(prefix), os.path.normpath(save_path)
    return prefix == save_path or (
        prefix.startswith(save_path + "-") and prefix[len(save_path) + 1 :].isdigit()
    )


@dataclass
class _Family:
    """The incremental bookkeeping of one prefix family (one ``save_path``).

    Attributes:
        committed: The tensors of the last committed save, which the next may reference.
        chain: The full save the last committed save's data starts from
            (``policy.may_reference``); None: none (first save, or the last one failed).
        chain_saves: Saves in that chain, the full one included.
        chain_of: The chain of every checkpoint of the family recorded in a state file.
    """

    committed: dict[str, Committed] = field(default_factory=dict)
    chain: str | None = None
    chain_saves: int = 0
    chain_of: dict[str, str] = field(default_factory=dict)

    def link(self, prefix: str, full: bool, recorded: bool) -> None:
        """Note which chain the save just committed to ``prefix`` belongs to."""
        if full or self.chain is None:
            self.chain, self.chain_saves = prefix, 1
        else:
            self.chain_saves += 1
        self.chain_of.pop(prefix, None)
        if recorded:
            self.chain_of[prefix] = self.chain


@dataclass(frozen=True)
class SaveStats:
    """What the last committed save cost.

    Attributes:
        prefix: The checkpoint written.
        stall_secs: Time the calling (training) thread spent in the snapshot.
        commit_secs: Time from the end of the snapshot until the index was committed.
        total_secs: ``commit_secs`` plus the state file and the deletion of old checkpoints.
        bytes_written: Bytes of shard data written (headers included, the index excluded).
        bytes_reused: Bytes of unchanged tensors referenced instead of written (incremental).
    """

    prefix: str
    stall_secs: float
    commit_secs: float
    total_secs: float
    bytes_written: int
    bytes_reused: int


class Saver:
    """Save and restore the state as checkpoints, keeping the newest ``max_to_keep``.

    Args:
        var_list: What to save. None: the whole state of the session passed to ``save`` /
            ``restore``. A mapping of names to stateful objects: exactly those (the session may
            then be None); a name may be a ``/`` path into a bigger checkpoint on restore
            (``{"model/backbone": net.backbone}``). A list of names: those entries of the
            session's state.
        sharded: Split the data into shards of at most ``max_shard_bytes`` (default 1 GiB).
        max_to_keep: How many recent checkpoints to keep (0 or None: keep all; the state file
            then lists only the newest). Counted per state file: each directory saved to
            keeps its own list, and a checkpoint is deleted only in the directory of the save
            path it was saved with, never elsewhere.
        keep_checkpoint_every_n_hours: Additionally keep one checkpoint per this many hours.
        name: A name for logs.
        allow_empty: Without it, saving an empty state raises ``ValueError("No variables to
            save")``; with it, ``save`` returns None.
        pad_step_number: Name checkpoints ``prefix-%08d`` instead of ``prefix-%d``.
        save_relative_paths: Write paths relative to the state file's directory
            (``model_checkpoint_path: "model.ckpt-600"``), so that a copy of the logdir is
            independent of its original. True by default, a deliberate difference from TF
            1 (whose default was False; TF 2's ``CheckpointManager`` always does this).
            False: absolute paths, as TF 1 wrote them (read either way).
        max_shard_bytes: Largest shard in bytes (one tensor is never split); None: one shard
            unless ``sharded``.
        incremental: Reference the committed bytes of frozen tensors that did not change
            since the previous save to the same directory instead of copying and writing them
            again. Frozen: not a trainable parameter (``requires_grad``), not an optimizer's
            state, not a buffer of a module in training mode (``docs/checkpoints.md``). A
            save is full anyway when needed to keep two independent copies of every tensor
            among the kept checkpoints (see ``full_save_every_n_saves``).
        full_save_every_n_saves: Write a full (non-incremental) checkpoint at least every this
            many saves. None: ``max_to_keep - 1`` (at least 1: with ``max_to_keep`` of 1 or 2
            every save is full), or 4 when every checkpoint is kept. With ``max_to_keep``
            set, larger values than the default have no effect: a save that would leave every
            kept checkpoint depending on one data file is always full. When every checkpoint
            is kept, larger values make longer chains: fewer bytes, more checkpoints broken
            by one damaged full save. Smaller values cost bytes and lose less on a damaged
            file (a damaged full save breaks the incremental ones that follow it).
        storage: Where the checkpoints live (tests inject faults here).
        clock: Time source for timestamps and retention.

    Raises:
        ValueError: If ``var_list`` is given, empty, and ``allow_empty`` is False; for a
            negative ``max_to_keep``, a ``keep_checkpoint_every_n_hours`` that is not
            positive, a ``max_shard_bytes`` or ``full_save_every_n_saves`` below 1 (naming
            the argument and the value).
        TypeError: For a ``var_list`` of another kind; for an argument of the wrong type
            (``max_to_keep=2.5`` or ``"3"``), naming it and the value.

    Thread safety: ``save``/``save_async``/``restore`` are meant for one (training) thread;
    bookkeeping updated by the writer thread is protected by a lock.

    TF name: ``tf.compat.v1.train.Saver``.
    """

    def __init__(
        self,
        var_list: Mapping[str, Any] | list[str] | tuple[str, ...] | None = None,
        *,
        sharded: bool = False,
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float = 10000.0,
        name: str | None = None,
        allow_empty: bool = False,
        pad_step_number: bool = False,
        save_relative_paths: bool = True,
        max_shard_bytes: int | None = None,
        incremental: bool = True,
        full_save_every_n_saves: int | None = None,
        storage: Storage | None = None,
        clock: Clock | None = None,
    ) -> None:
        if var_list is not None:
            if not isinstance(var_list, (Mapping, list, tuple)):
                raise TypeError(
                    "var_list must be None, a mapping of names to stateful objects, or a list of "
                    f"state names; got {type(var_list).__name__}"
                )
            if not var_list and not allow_empty:
                raise ValueError("No variables to save")
        max_to_keep = check_int("max_to_keep", max_to_keep, allow_none=True)
        keep_checkpoint_every_n_hours = check_number(
            "keep_checkpoint_every_n_hours", keep_checkpoint_every_n_hours, positive=True
        )
        check_str("name", name, allow_none=True)
        sharded = check_bool("sharded", sharded)
        allow_empty = check_bool("allow_empty", allow_empty)
        pad_step_number = check_bool("pad_step_number", pad_step_number)
        save_relative_paths = check_bool("save_relative_paths", save_relative_paths)
        incremental = check_bool("incremental", incremental)
        max_shard_bytes = check_int("max_shard_bytes", max_shard_bytes, minimum=1, allow_none=True)
        full_save_every_n_saves = check_int(
            "full_save_every_n_saves", full_save_every_n_saves, minimum=1, allow_none=True
        )
        self._var_list = var_list
        self._sharded = sharded
        self._max_to_keep = max_to_keep
        self._keep_every_secs = float(keep_checkpoint_every_n_hours) * 3600.0
        self._name = name or "save"
        self._allow_empty = allow_empty
        self._pad_step_number = pad_step_number
        self._save_relative_paths = save_relative_paths
        self._max_shard_bytes = max_shard_bytes or (_DEFAULT_SHARD_BYTES if sharded else None)
        self._storage = storage or LOCAL
        self._clock = clock or REAL_CLOCK
        self._lock = threading.Lock()
        # Retention is kept per state file (directory and file name): each lists only its
        # own directory's checkpoints. ``_retention`` is the one of the last save (or, before
        # any save, the list given to ``set_last_checkpoints*``, bound at the first save).
        self._retention = policy.Retention(
            next_keep_time=self._clock.time() + self._keep_every_secs
        )
        self._retention_key: tuple[str, str] | None = None
        self._retentions: dict[tuple[str, str], policy.Retention] = {}
        self._stager = Stager()
        self._engine = CheckpointEngine()
        self._cancel = threading.Event()
        self._optional: set[str] = set()
        self._incremental = incremental
        self._full_every = full_save_every_n_saves or policy.default_full_save_interval(max_to_keep)
        # Incremental saves, per prefix family (save path): references never cross families.
        self._families: dict[str, _Family] = {}
        self._always_copy: set[str] = set()
        self._orphans: set[str] = set()
        self._state_file_failures: set[str] = set()
        self._dir_locks: dict[str, DirectoryLock] = {}
        self.last_save: SaveStats | None = None
        """What the last committed save cost (None before the first)."""

    # ----------------------------------------------------------------------------- saving

    def save(
        self,
        sess: Any,
        save_path: str,
        global_step: Any = None,
        latest_filename: str | None = None,
        meta_graph_suffix: str = "meta",
        write_meta_graph: bool = True,
        write_state: bool = True,
        strip_default_attrs: bool = False,
        save_debug_info: bool = False,
    ) -> str | None:
        """Save a checkpoint and return its prefix once it is committed.

        Args:
            sess: The session whose state is saved (may be None when ``var_list`` is a mapping).
            save_path: The prefix without step, e.g. ``logdir/model.ckpt``. Its directory must
                exist.
            global_step: If given (int, ``GlobalStep`` or integer tensor), appended to the
                prefix: ``save_path-<step>``, and recorded in the manifest.
            latest_filename: Name of the state file in the same directory (default
                ``"checkpoint"``).
            meta_graph_suffix: Ignored: there is no meta graph to write (TF's ``.meta`` file).
            write_meta_graph: Ignored, as ``meta_graph_suffix``.
            write_state: Record the checkpoint in the state file and apply retention.
            strip_default_attrs: Ignored (a meta-graph option).
            save_debug_info: Ignored (graph debug information).

        Returns:
            The checkpoint prefix, or None for an empty state with ``allow_empty``.

        Raises:
            ValueError: For a ``latest_filename`` with a directory part, one that collides with
                ``save_path``, a missing parent directory, or nothing to save.
            TypeError: For a state entry that cannot be saved without pickle, or whose dtype
                the format cannot hold (``complex128``).
            LogdirLockedError: Another process writes to the directory (at the first save
                there).
            CheckpointSaveError: If writing fails; older checkpoints are untouched. (A state
                file that cannot be written after the commit is logged once, not raised.)

        TF name: ``tf.compat.v1.train.Saver.save`` (same arguments, in the same order).
        """
        del meta_graph_suffix, write_meta_graph, strip_default_attrs, save_debug_info
        start = time.perf_counter()
        try:
            prefix, snapshot = self._stage(
                sess, save_path, global_step, latest_filename, check_dir=True
            )
        except ShardedStateError:  # DTensors: a collective, every rank writes its part.
            state = self._state_for(sess)
            return self._save_sharded(state, save_path, global_step, latest_filename, write_state)
        if snapshot is None:
            return None
        stall = time.perf_counter() - start
        return self._persist(
            snapshot, prefix, save_path, latest_filename, write_state, stall, False
        )

    def save_async(
        self,
        sess: Any,
        save_path: str,
        global_step: Any = None,
        latest_filename: str | None = None,
        write_state: bool = True,
    ) -> concurrent.futures.Future[str | None]:
        """Take the snapshot now and write it on the background writer thread.

        Blocks only for the copy into host staging buffers (and, if a previous save is still
        being written, until that one is committed: at most one save is in flight).

        Args:
            See ``save``.

        Returns:
            A future resolving to the prefix once committed, or to the error of the write
            (``CheckpointSaveError``; also for a directory that does not exist, which the
            writer checks, with ``save``'s text).

        Raises:
            ValueError, TypeError: As ``save``, for problems found before the copy.

        TF name: none (TF saved on the calling thread).
        """
        start = time.perf_counter()
        done: concurrent.futures.Future[str | None]
        try:
            # The directory is checked by the writer: a stat is not worth a stall.
            prefix, snapshot = self._stage(
                sess, save_path, global_step, latest_filename, check_dir=False
            )
        except ShardedStateError:  # DTensors: a collective, written now on every rank.
            state = self._state_for(sess)
            done = concurrent.futures.Future()
            try:
                done.set_result(
                    self._save_sharded(state, save_path, global_step, latest_filename, write_state)
                )
            except CheckpointSaveError as e:
                done.set_exception(e)
            return done
        if snapshot is None:
            done = concurrent.futures.Future()
            done.set_result(None)
            return done
        stall = time.perf_counter() - start
        return self._engine.submit(
            self._persist, snapshot, prefix, save_path, latest_filename, write_state, stall, True
        )

    def close(self) -> None:
        """Wait for the save in flight and end the writer thread (a later save restarts it).

        A cancelled save that is still in flight (its writer stuck in a file-system call, a
        hung fsync say) is not waited for: it commits nothing, and removes its files if the
        call ever returns. The writer locks of the directories saved to are released (a
        later save takes them again).

        TF name: none (TF's Saver had no writer thread).
        """
        if self._cancel.is_set() and self._engine.in_flight:
            logger.warning(
                "Not waiting for the cancelled checkpoint save: it is stuck in a file-system "
                "call and will commit nothing"
            )
            return
        self._engine.close()
        with self._lock:
            locks, self._dir_locks = self._dir_locks, {}
        for lock in locks.values():
            lock.release()

    def _lock_directory(self, save_path: str) -> None:
        """Take the writer lock of ``save_path``'s directory at the first save there.

        Raises:
            LogdirLockedError: Another process writes to that directory.
        """
        directory = os.path.dirname(save_path)
        if directory in self._dir_locks:  # One dict lookup per save: the training thread's.
            return
        if not self._storage.is_dir(directory):
            return  # The save reports the missing directory.
        lock = self._storage.lock(directory)  # Shared with other handles on the same dir.
        with self._lock:
            self._dir_locks[directory] = lock

    @property
    def in_flight(self) -> bool:
        """True while an asynchronous save is being written.

        TF name: none.
        """
        return self._engine.in_flight

    def wait(self, timeout_secs: float | None = None) -> bool:
        """Wait for the save in flight, if any (its errors go to its future, not here).

        Returns:
            True when nothing is in flight any more, False on timeout.

        TF name: none.
        """
        return self._engine.wait(timeout_secs)

    def cancel(self, timeout_secs: float | None = None) -> bool:
        """Abandon the save being written: its files are removed, nothing is committed.

        The writer stops at the next 64 MiB chunk or stage. Used when a preemption grace
        period runs out: a checkpoint that cannot finish is abandoned, never left half-written
        (it would not count anyway: the index, written last, would be missing).

        The cancellation stays in force until that save has ended, even when ``timeout_secs``
        expires first (the writer may be stuck in a system call: it then stops as soon as the
        call returns, and commits nothing).

        Returns:
            True if no save is in flight any more, False if ``timeout_secs`` expired first.

        TF name: none (TF had no preemption grace period).
        """
        if not self._engine.in_flight:
            return True
        self._cancel.set()
        self._engine.abandon()  # A writer stuck in a system call must not block the exit.
        return self._engine.wait(timeout_secs)

    def allow_missing(self, *names: str) -> None:
        """Let ``restore`` skip these state entries, with a warning, when a checkpoint lacks them.

        For entries added to a run after checkpoints were written (the Supervisor's ``rng``
        entry on a checkpoint from a run that did not save it, say). Other missing entries are
        an error.

        TF name: none (TF's restore failed on any missing variable).
        """
        self._optional.update(names)

    def _state_for(self, sess: Any) -> Mapping[str, Any]:
        if isinstance(self._var_list, Mapping):
            return self._var_list
        state = getattr(sess, "state", None)
        if state is None:
            raise ValueError(
                "This Saver has no var_list mapping, so it needs a session with a state; got "
                f"{type(sess).__name__}"
            )
        return select_state(state, self._var_list)

    def _checkpoint_prefix(
        self, save_path: str, global_step: Any, latest_filename: str | None
    ) -> tuple[str, int | None]:
        latest_filename = latest_filename or "checkpoint"
        if os.path.split(latest_filename)[0]:
            raise ValueError("'latest_filename' must not contain path components")
        step = None if global_step is None else read_step(global_step)
        if step is None:
            if os.path.basename(save_path) == latest_filename and not self._sharded:
                raise ValueError(
                    f"'latest_filename' collides with 'save_path': '{latest_filename}' and "
                    f"'{save_path}'"
                )
            return save_path, None
        pattern = "%s-%08d" if self._pad_step_number else "%s-%d"
        return pattern % (save_path, step), step

    def _stage(
        self,
        sess: Any,
        save_path: str,
        global_step: Any,
        latest_filename: str | None,
        *,
        check_dir: bool,
    ) -> tuple[str, Snapshot | None]:
        prefix, step = self._checkpoint_prefix(save_path, global_step, latest_filename)
        if check_dir:
            self._check_dir(save_path)
        state = self._state_for(sess)
        frozen: set[str] = set()
        skeleton, tensors = flatten_state(state, frozen=frozen if self._incremental else None)
        if not skeleton:
            if self._allow_empty:
                return prefix, None
            raise ValueError("No variables to save")
        self._lock_directory(save_path)  # Not for a sharded state: flatten_state raised.
        self._engine.wait()
        self._cancel.clear()  # A cancellation is for the save it was aimed at only.
        with self._lock:
            frozen -= self._always_copy
        snapshot = self._stager.stage(
            skeleton,
            tensors,
            step=step,
            wall_time=self._clock.time(),
            max_shard_bytes=self._max_shard_bytes,
            committed=self._reusable(save_path, prefix, frozen, latest_filename),
            reusable=frozen,
        )
        return prefix, snapshot

    def _reusable(
        self, save_path: str, prefix: str, frozen: set[str], latest_filename: str | None
    ) -> dict[str, Committed] | None:
        """The committed tensors a save to ``prefix`` may reference instead of copying.

        Only tensors of the same prefix family (the same ``save_path``: references never
        cross from one family to another, so deleting one family's checkpoints never breaks
        another's) that are frozen now (``frozen``: see ``state.flatten_state``) and were
        frozen when they were copied (the snapshot records versions for those alone): a
        trainable parameter or an optimizer's state may be updated in place without a
        version-counter bump (``Adam(fused=True)``), so its counter proves nothing. Never the
        numpy arrays of the state (new wrappers at every save), nor the data of ``prefix``
        itself (overwritten). None (a full save) when referencing would leave every kept
        checkpoint depending on the same data (``policy.may_reference``).
        """
        with self._lock:
            family = self._families.get(_family_key(save_path))
            if not self._incremental or family is None or not family.committed:
                return None
            kept = self._kept_chains(family, save_path, prefix, latest_filename)
            if not policy.may_reference(kept, family.chain, family.chain_saves, self._full_every):
                return None
            own = os.path.basename(prefix) + ".data-"
            return {
                name: c
                for name, c in family.committed.items()
                if name in frozen and not c.shard.file.startswith(own)
            }

    def _kept_chains(
        self, family: _Family, save_path: str, prefix: str, latest_filename: str | None
    ) -> list[str | None]:
        """The chains of the family's checkpoints still kept once ``prefix`` is saved.

        With ``max_to_keep``: the family's checkpoints among the newest ``max_to_keep - 1``
        tracked by the state file of ``prefix`` other than ``prefix`` (checkpoints kept by
        ``keep_checkpoint_every_n_hours`` are not counted: the rule stays on the safe side).
        Keeping everything: every checkpoint of the family known. Lock held.
        """
        target = os.path.normpath(prefix)
        retention = self._retentions.get(_state_key(save_path, latest_filename))
        if retention is None and self._retention_key is None:
            retention = self._retention
        tracked = [
            p
            for p, _ in (retention.tracked if retention is not None else ())
            if os.path.normpath(p) != target and _in_family(p, save_path)
        ]
        if self._max_to_keep:
            kept = tracked[-(self._max_to_keep - 1) :] if self._max_to_keep > 1 else []
        else:
            kept = list(dict.fromkeys([*tracked, *family.chain_of]))
            kept = [p for p in kept if os.path.normpath(p) != target]
        return [family.chain_of.get(p) for p in kept]

    def _family(self, save_path: str) -> _Family:
        """The incremental bookkeeping of ``save_path``'s prefix family (lock held)."""
        key = _family_key(save_path)
        family = self._families.get(key)
        if family is None:
            family = self._families[key] = _Family()
        return family

    def _persist(
        self,
        snapshot: Snapshot,
        prefix: str,
        save_path: str,
        latest_filename: str | None,
        write_state: bool,
        stall_secs: float,
        check_dir: bool,
    ) -> str:
        """Write ``snapshot`` (on the writer thread for ``save_async``, which left the check
        of the directory to it: ``check_dir``), then record it and apply retention."""
        start = time.perf_counter()
        try:
            if check_dir:
                try:
                    self._check_dir(save_path)
                except ValueError as e:
                    raise CheckpointSaveError(str(e), path=prefix) from None
            result = persist(
                snapshot,
                prefix,
                library_version=__version__,
                torch_version=torch.__version__,
                world_size=_world_size(),
                storage=self._storage,
                cancel=self._cancel,
            )
        except CheckpointSaveError as e:
            with self._lock:
                family = self._family(save_path)
                family.committed = {}  # The next save copies everything.
                family.chain = None
                if isinstance(e, StaleReferenceError):
                    self._always_copy |= e.names
            raise
        finally:
            self._stager.release(snapshot)
        committed = time.perf_counter()
        with self._lock:
            family = self._family(save_path)
            family.committed = result.committed
            family.link(prefix, full=not snapshot.references, recorded=write_state)
        if write_state:
            self._record_and_sweep(prefix, save_path, latest_filename)
        self.last_save = SaveStats(
            prefix=prefix,
            stall_secs=stall_secs,
            commit_secs=committed - start,
            total_secs=time.perf_counter() - start,
            bytes_written=result.bytes_written,
            bytes_reused=sum(c.entry.nbytes for c in snapshot.references.values()),
        )
        logger.debug("Checkpoint %s: %s", prefix, self.last_save)
        return prefix

    def _check_dir(self, save_path: str) -> None:
        save_dir = os.path.dirname(save_path)
        if save_dir and not self._storage.exists(save_dir):
            raise ValueError(f"Parent directory of {save_path} doesn't exist, can't save.")

    def _save_sharded(
        self,
        state: Mapping[str, Any],
        save_path: str,
        global_step: Any,
        latest_filename: str | None,
        write_state: bool,
    ) -> str:
        """Save a state of DTensors with every rank writing its part (a collective)."""
        prefix, _ = self._checkpoint_prefix(save_path, global_step, latest_filename)
        self._check_dir(save_path)
        if _rank() == 0:  # The other ranks write their shards under rank 0's lock.
            self._lock_directory(save_path)
        self._engine.wait()
        start = time.perf_counter()
        save_sharded(
            state,
            prefix,
            global_step=global_step,
            write_state=False,
            storage=self._storage,
            clock=self._clock,
            stager=self._stager,
        )
        committed = time.perf_counter()
        with self._lock:
            family = self._family(save_path)
            family.committed = {}  # Sharded saves are never incremental.
            family.link(prefix, full=True, recorded=write_state)
        if write_state:
            if _rank() == 0:
                self._record_and_sweep(prefix, save_path, latest_filename)
            else:  # Same bookkeeping; files are rank 0's business.
                self._record(prefix, save_path, latest_filename)
        total = time.perf_counter() - start
        self.last_save = SaveStats(
            prefix=prefix,
            stall_secs=total,
            commit_secs=committed - start,
            total_secs=total,
            bytes_written=_local_shard_bytes(prefix, self._storage),
            bytes_reused=0,
        )
        return prefix

    def _record(
        self, prefix: str, save_path: str, latest_filename: str | None
    ) -> tuple[list[str], list[str], list[str]]:
        """Record ``prefix`` in the retention of its state file; return what retention says.

        Returns:
            ``(tracked, to_delete, preserved)``: the prefixes the state file lists (oldest
            first), those to delete now and those kept for good
            (``keep_checkpoint_every_n_hours``).
        """
        key = _state_key(save_path, latest_filename)
        with self._lock:
            self._switch_retention(key)
            retention = policy.record(
                self._retention, prefix, self._clock.time(), self._max_to_keep
            )
            retention, to_delete, preserved = policy.sweep(retention, self._keep_every_secs)
            self._retention = self._retentions[key] = retention
            family = self._family(save_path)
            for path in to_delete + preserved:  # No longer counted by the chain rule.
                family.chain_of.pop(path, None)
            return [path for path, _ in retention.tracked], to_delete, preserved

    def _switch_retention(self, key: tuple[str, str]) -> None:
        """Make ``key``'s state file the current one (lock held).

        Before the first save, the list given to ``set_last_checkpoints*`` (or
        ``recover_last_checkpoints``) is bound to the state file of that save; its entries in
        another directory are dropped (never deleted: see ``_record_and_sweep``).
        """
        if self._retention_key == key:
            return
        if self._retention_key is None:
            entries = tuple(
                e for e in self._retention.tracked if _in_directory(e[0], key[0], self._storage)
            )
            for path, _ in self._retention.tracked:
                if not _in_directory(path, key[0], self._storage):
                    logger.info("Not tracking %s: it is not in %s", path, key[0])
            retention = policy.Retention(
                tracked=entries, next_keep_time=self._retention.next_keep_time
            )
        else:
            retention = self._retentions.get(key) or policy.Retention(
                next_keep_time=self._clock.time() + self._keep_every_secs
            )
        self._retentions[key] = retention
        self._retention, self._retention_key = retention, key

    def _record_and_sweep(self, prefix: str, save_path: str, latest_filename: str | None) -> None:
        """Record the committed ``prefix``, write the state file, then delete what retention
        lets go: only checkpoints of the directory of ``save_path``, never a file elsewhere.

        A state file that cannot be written (a directory in its place, an immutable file, a
        full disk) does not undo the commit and does not stop retention: the error is logged
        once, naming the state file, and a restart finds the checkpoints by scanning the
        directory (``recovery.plan_restore``).
        """
        save_dir = os.path.dirname(save_path)
        tracked, to_delete, preserved = self._record(prefix, save_path, latest_filename)

        def write_state_file(pending: list[str]) -> bool:
            try:
                update_checkpoint_state_internal(
                    save_dir=save_dir,
                    model_checkpoint_path=prefix,
                    all_model_checkpoint_paths=tracked,
                    latest_filename=latest_filename,
                    save_relative_paths=self._save_relative_paths,
                    pending_deletions=pending,
                    storage=self._storage,
                )
            except OSError as e:
                self._state_file_failed(state_file_path(save_dir, latest_filename), prefix, e)
                return False
            self._state_file_failures.discard(state_file_path(save_dir, latest_filename))
            return True

        # What retention deletes is named in the state file first: a crash before it is gone
        # does not leak it (the next start finishes the deletion). Once it is gone, the file
        # is written again without the names: exactly TF's text.
        pending = [p for p in to_delete if _in_directory(p, save_dir, self._storage)]
        written = write_state_file(pending)
        for path in preserved:
            logger.info("Keeping checkpoint %s (keep_checkpoint_every_n_hours)", path)
        for path in to_delete:
            if not _in_directory(path, save_dir, self._storage):
                logger.warning(
                    "Not deleting checkpoint %s: it is not in %s, the directory of this "
                    "saver's save path",
                    path,
                    save_dir or os.curdir,
                )
                continue
            try:
                remove_checkpoint(path, storage=self._storage)
            except OSError as e:
                logger.warning("Ignoring: %s", e)
            # Data files still referenced by a newer incremental checkpoint were kept.
            self._orphans.update(list_checkpoint_files(path, self._storage))
        if written and pending:
            write_state_file([p for p in pending if self._storage.exists(p + ".index")])
        self._collect_orphans()

    def _state_file_failed(self, state_path: str, prefix: str, error: OSError) -> None:
        """Log, once per state file until it can be written again, that it could not be."""
        if state_path in self._state_file_failures:
            logger.debug("State file %s still cannot be written: %s", state_path, error)
            return
        self._state_file_failures.add(state_path)
        logger.error(
            "Cannot write the checkpoint state file %s (%s). Checkpoint %s is committed and "
            "kept; a restart finds the checkpoints by scanning the directory. (Logged once "
            "until the state file can be written again.)",
            state_path,
            error.strerror or error,
            prefix,
        )

    def _collect_orphans(self) -> None:
        """Delete kept data files of deleted checkpoints once no checkpoint references them.

        Each file is checked against the checkpoints of its own directory.
        """
        if not self._orphans:
            return
        needed: dict[str, set[str]] = {}
        for path in sorted(self._orphans):
            directory = os.path.dirname(path)
            if directory not in needed:
                needed[directory] = referenced_data_files(directory, storage=self._storage)
            if not self._storage.exists(path):
                self._orphans.discard(path)
            elif os.path.basename(path) not in needed[directory]:
                try:
                    self._storage.delete(path)
                    self._orphans.discard(path)
                except OSError as e:
                    logger.warning("Ignoring: %s", e)

    # ---------------------------------------------------------------------------- restoring

    def restore(self, sess: Any, save_path: str | None) -> None:
        """Load the checkpoint ``save_path`` into the state, after verifying its checksums.

        Before anything is loaded, the manifest is compared with the live state (the run
        fingerprint): every entry present, every shape equal, dtypes convertible, a module's
        keys equal. A mismatch raises with the state untouched. A dtype that changed within
        its kind or towards a wider one (float32 saved, float64 live) is converted, with a
        warning naming the entry and both dtypes. Another world size, torch version or
        torchsupervisor version than the checkpoint's is logged as a warning naming both
        values. Then every byte read is verified, and only then is the state loaded.

        Args:
            sess: The session whose state receives the values (None with a mapping var_list).
            save_path: A checkpoint prefix, as returned by ``save`` or ``latest_checkpoint``.

        Raises:
            ValueError: ``"Can't load save_path when it is None."`` or
                ``"The passed save_path is not a valid checkpoint: <path>"``.
            CorruptCheckpointError: If a file is missing, truncated, not a regular file (a
                FIFO, a directory), a link out of the checkpoint's directory, or fails its
                checksum, or the manifest is damaged; the state is then unchanged.
            NotFoundError: If an entry of the state is not in the checkpoint (and was not
                allowed with ``allow_missing``); the state is then unchanged.
            InvalidArgumentError: If a value does not fit its object: another shape (the
                message names the entry, the checkpoint and both shapes), a dtype of a lower
                kind (floating saved, integer live), a module's missing or unexpected keys;
                the state is then unchanged (except for failures only the objects' own
                ``load_state_dict`` detects).

        TF name: ``tf.compat.v1.train.Saver.restore``.
        """
        if save_path is None:
            raise ValueError("Can't load save_path when it is None.")
        self._engine.wait()
        if not checkpoint_exists(save_path) and not self._storage.exists(save_path + ".index"):
            raise ValueError("The passed save_path is not a valid checkpoint: " + save_path)
        logger.info("Restoring parameters from %s", save_path)
        state = self._state_for(sess)
        if is_sharded(state):  # A collective: every rank reads the chunks it needs.
            load_sharded(state, save_path, allow_missing=self._optional, storage=self._storage)
            return
        reader = CheckpointReader(save_path, storage=self._storage)
        # The files must hold what the manifest claims before its shapes are believed: a
        # damaged manifest (a 2**40-byte tensor) is damage, not a mismatch with the state.
        reader.check_files()
        specs = _spec_tree(reader)

        def required(name: str) -> None:
            if name not in self._optional:
                raise NotFoundError(f"Key {name} not found in checkpoint {save_path}")

        warnings = check_state(state, specs, source=save_path, on_missing=required)
        _report_differences(reader.manifest, specs, state, save_path, self._var_list is None)
        for message in warnings:
            logger.warning("%s", message)
        tree = reader.read_tree()

        def missing(name: str) -> None:
            required(name)
            logger.warning(
                "Checkpoint %s has no %r entry; it keeps its current value", save_path, name
            )

        load_state(state, tree, source=save_path, on_missing=missing)

    # ------------------------------------------------------------------------- bookkeeping

    @property
    def last_checkpoints(self) -> list[str]:
        """The prefixes of the checkpoints this saver may still delete, oldest first.

        TF name: ``tf.compat.v1.train.Saver.last_checkpoints``.
        """
        with self._lock:
            return [path for path, _ in self._retention.tracked]

    def set_last_checkpoints(self, last_checkpoints: Iterable[str]) -> None:
        """Replace the tracked list; these checkpoints are never deleted (infinite timestamp).

        Deprecated in TF in favour of ``set_last_checkpoints_with_time``.

        TF name: ``tf.compat.v1.train.Saver.set_last_checkpoints``.
        """
        self.set_last_checkpoints_with_time([(path, float("inf")) for path in last_checkpoints])

    def set_last_checkpoints_with_time(
        self, last_checkpoints_with_time: Iterable[tuple[str, float]]
    ) -> None:
        """Replace the tracked list with ``(prefix, timestamp_secs)`` pairs, oldest first.

        TF name: ``tf.compat.v1.train.Saver.set_last_checkpoints_with_time``.
        """
        entries = tuple((str(path), float(ts)) for path, ts in last_checkpoints_with_time)
        with self._lock:
            self._retention = policy.Retention(
                tracked=entries, next_keep_time=self._retention.next_keep_time
            )
            if self._retention_key is not None:
                self._retentions[self._retention_key] = self._retention

    def recover_last_checkpoints(self, checkpoint_paths: Iterable[str]) -> None:
        """Track existing checkpoints after a restart, timestamped with their files' mtimes.

        Paths whose files do not exist are dropped.

        TF name: ``tf.compat.v1.train.Saver.recover_last_checkpoints``.
        """
        entries = []
        for path in checkpoint_paths:
            mtimes = get_checkpoint_mtimes([path])
            if mtimes:
                entries.append((path, mtimes[0]))
        self.set_last_checkpoints_with_time(entries)
