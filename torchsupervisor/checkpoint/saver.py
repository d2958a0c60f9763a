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
from dataclasses import dataclass
from typing import Any

import torch

from torchsupervisor._version import __version__
from torchsupervisor.checkpoint import policy
from torchsupervisor.checkpoint.commit import persist
from torchsupervisor.checkpoint.engine import CheckpointEngine
from torchsupervisor.checkpoint.format import ManifestError, decode_tree
from torchsupervisor.checkpoint.incremental import Committed, StaleReferenceError
from torchsupervisor.checkpoint.management import (
    checkpoint_exists,
    get_checkpoint_mtimes,
    list_checkpoint_files,
    remove_checkpoint,
)
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.checkpoint.references import referenced_data_files
from torchsupervisor.checkpoint.sharded import is_sharded, load_sharded, save_sharded
from torchsupervisor.checkpoint.snapshot import Snapshot, Stager
from torchsupervisor.checkpoint.state_file import update_checkpoint_state_internal
from torchsupervisor.checkpoint.storage import LOCAL_FS, FileSystem
from torchsupervisor.clock import REAL_CLOCK, Clock
from torchsupervisor.errors import CheckpointSaveError, CorruptCheckpointError, NotFoundError
from torchsupervisor.global_step import read_step
from torchsupervisor.state import (
    ShardedStateError,
    TensorSpec,
    check_state,
    flatten_state,
    load_state,
    select_state,
)

__all__ = ["SaveStats", "Saver"]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _local_shard_bytes(prefix: str) -> int:
    """Bytes of the data shard this rank wrote for sharded checkpoint ``prefix``."""
    directory, base = os.path.split(prefix)
    mine = f"{base}.data-{_rank():05d}-of-"
    try:
        names = [n for n in os.listdir(directory or ".") if n.startswith(mine)]
        return sum(os.path.getsize(os.path.join(directory or ".", n)) for n in names)
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
            then lists only the newest).
        keep_checkpoint_every_n_hours: Additionally keep one checkpoint per this many hours.
        name: A name for logs.
        allow_empty: Without it, saving an empty state raises ``ValueError("No variables to
            save")``; with it, ``save`` returns None.
        pad_step_number: Name checkpoints ``prefix-%08d`` instead of ``prefix-%d``.
        save_relative_paths: Write paths relative to the directory in the state file.
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
        fs: The file-system seam (tests inject faults here).
        clock: Time source for timestamps and retention.

    Raises:
        ValueError: If ``var_list`` is given, empty, and ``allow_empty`` is False; for a
            ``max_shard_bytes`` or ``full_save_every_n_saves`` below 1.
        TypeError: For a ``var_list`` of another kind.

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
        save_relative_paths: bool = False,
        max_shard_bytes: int | None = None,
        incremental: bool = True,
        full_save_every_n_saves: int | None = None,
        fs: FileSystem | None = None,
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
        if max_shard_bytes is not None and max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        if full_save_every_n_saves is not None and full_save_every_n_saves < 1:
            raise ValueError(
                f"full_save_every_n_saves must be at least 1, got {full_save_every_n_saves}"
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
        self._fs = fs or LOCAL_FS
        self._clock = clock or REAL_CLOCK
        self._lock = threading.Lock()
        self._retention = policy.Retention(
            next_keep_time=self._clock.time() + self._keep_every_secs
        )
        self._stager = Stager()
        self._engine = CheckpointEngine()
        self._cancel = threading.Event()
        self._optional: set[str] = set()
        self._incremental = incremental
        self._full_every = full_save_every_n_saves or policy.default_full_save_interval(max_to_keep)
        self._committed: dict[str, Committed] = {}
        self._committed_dir: str | None = None
        # Chains (policy.may_reference): the full save the last committed save's data starts
        # from, how many saves that chain has, and the chain of every checkpoint recorded.
        self._chain: str | None = None
        self._chain_saves = 0
        self._chain_of: dict[str, str] = {}
        self._always_copy: set[str] = set()
        self._orphans: set[str] = set()
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
            TypeError: For a state entry that cannot be saved without pickle.
            CheckpointSaveError: If writing fails; older checkpoints are untouched.

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
        call ever returns.

        TF name: none (TF's Saver had no writer thread).
        """
        if self._cancel.is_set() and self._engine.in_flight:
            logger.warning(
                "Not waiting for the cancelled checkpoint save: it is stuck in a file-system "
                "call and will commit nothing"
            )
            return
        self._engine.close()

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
        save_dir = os.path.dirname(save_path)
        if check_dir:
            self._check_dir(save_path)
        state = self._state_for(sess)
        frozen: set[str] = set()
        skeleton, tensors = flatten_state(state, frozen=frozen if self._incremental else None)
        if not skeleton:
            if self._allow_empty:
                return prefix, None
            raise ValueError("No variables to save")
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
            committed=self._reusable(save_dir, prefix, frozen),
            reusable=frozen,
        )
        return prefix, snapshot

    def _reusable(
        self, save_dir: str, prefix: str, frozen: set[str]
    ) -> dict[str, Committed] | None:
        """The committed tensors a save to ``prefix`` may reference instead of copying.

        Only tensors that are frozen now (``frozen``: see ``state.flatten_state``) and were
        frozen when they were copied (the snapshot records versions for those alone): a
        trainable parameter or an optimizer's state may be updated in place without a
        version-counter bump (``Adam(fused=True)``), so its counter proves nothing. Never the
        numpy arrays of the state (new wrappers at every save), nor the data of ``prefix``
        itself (overwritten). None (a full save) when referencing would leave every kept
        checkpoint depending on the same data (``policy.may_reference``).
        """
        with self._lock:
            if not self._incremental or save_dir != self._committed_dir or not self._committed:
                return None
            if not policy.may_reference(
                self._kept_chains(prefix), self._chain, self._chain_saves, self._full_every
            ):
                return None
            own = os.path.basename(prefix) + ".data-"
            return {
                name: c
                for name, c in self._committed.items()
                if name in frozen and not c.shard.file.startswith(own)
            }

    def _kept_chains(self, prefix: str) -> list[str | None]:
        """The chains of the checkpoints still kept once ``prefix`` is saved (lock held).

        With ``max_to_keep``: the newest ``max_to_keep - 1`` tracked ones other than
        ``prefix`` (checkpoints kept by ``keep_checkpoint_every_n_hours`` are not counted:
        the rule stays on the safe side). Keeping everything: every checkpoint known.
        """
        target = os.path.normpath(prefix)
        tracked = [p for p, _ in self._retention.tracked if os.path.normpath(p) != target]
        if self._max_to_keep:
            kept = tracked[-(self._max_to_keep - 1) :] if self._max_to_keep > 1 else []
        else:
            kept = list(dict.fromkeys([*tracked, *self._chain_of]))
            kept = [p for p in kept if os.path.normpath(p) != target]
        return [self._chain_of.get(p) for p in kept]

    def _start_chain_link(self, prefix: str, full: bool, recorded: bool) -> None:
        """Note which chain the save just committed to ``prefix`` belongs to (lock held)."""
        if full or self._chain is None:
            self._chain, self._chain_saves = prefix, 1
        else:
            self._chain_saves += 1
        self._chain_of.pop(prefix, None)
        if recorded:
            self._chain_of[prefix] = self._chain

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
                fs=self._fs,
                cancel=self._cancel,
            )
        except CheckpointSaveError as e:
            with self._lock:
                self._committed = {}  # The next save copies everything.
                self._chain = None
                if isinstance(e, StaleReferenceError):
                    self._always_copy |= e.names
            raise
        finally:
            self._stager.release(snapshot)
        committed = time.perf_counter()
        with self._lock:
            self._committed = result.committed
            self._committed_dir = os.path.dirname(save_path)
            self._start_chain_link(prefix, full=not snapshot.references, recorded=write_state)
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
        if save_dir and not self._fs.exists(save_dir):
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
        self._engine.wait()
        start = time.perf_counter()
        save_sharded(
            state,
            prefix,
            global_step=global_step,
            write_state=False,
            fs=self._fs,
            clock=self._clock,
            stager=self._stager,
        )
        committed = time.perf_counter()
        with self._lock:
            self._committed = {}  # Sharded saves are never incremental.
            self._start_chain_link(prefix, full=True, recorded=write_state)
        if write_state:
            if _rank() == 0:
                self._record_and_sweep(prefix, save_path, latest_filename)
            else:  # Same bookkeeping; files are rank 0's business.
                with self._lock:
                    self._retention = policy.record(
                        self._retention, prefix, self._clock.time(), self._max_to_keep
                    )
                    self._retention, gone, kept = policy.sweep(
                        self._retention, self._keep_every_secs
                    )
                    for path in gone + kept:
                        self._chain_of.pop(path, None)
        total = time.perf_counter() - start
        self.last_save = SaveStats(
            prefix=prefix,
            stall_secs=total,
            commit_secs=committed - start,
            total_secs=total,
            bytes_written=_local_shard_bytes(prefix),
            bytes_reused=0,
        )
        return prefix

    def _record_and_sweep(self, prefix: str, save_path: str, latest_filename: str | None) -> None:
        with self._lock:
            retention = policy.record(
                self._retention, prefix, self._clock.time(), self._max_to_keep
            )
            retention, to_delete, preserved = policy.sweep(retention, self._keep_every_secs)
            self._retention = retention
            tracked = [path for path, _ in retention.tracked]
            for path in to_delete + preserved:  # No longer counted by the chain rule.
                self._chain_of.pop(path, None)
        try:
            update_checkpoint_state_internal(
                save_dir=os.path.dirname(save_path),
                model_checkpoint_path=prefix,
                all_model_checkpoint_paths=tracked,
                latest_filename=latest_filename,
                save_relative_paths=self._save_relative_paths,
                fs=self._fs,
            )
        except OSError as e:
            raise CheckpointSaveError(
                f"Checkpoint {prefix} was committed but the state file could not be updated "
                f"(a restart still finds it by scanning the directory): {e}",
                path=prefix,
            ) from e
        for path in preserved:
            logger.info("Keeping checkpoint %s (keep_checkpoint_every_n_hours)", path)
        for path in to_delete:
            try:
                remove_checkpoint(path, fs=self._fs)
            except OSError as e:
                logger.warning("Ignoring: %s", e)
            # Data files still referenced by a newer incremental checkpoint were kept.
            self._orphans.update(list_checkpoint_files(path))
        self._collect_orphans(os.path.dirname(save_path))

    def _collect_orphans(self, directory: str) -> None:
        """Delete kept data files of deleted checkpoints once no checkpoint references them."""
        if not self._orphans:
            return
        needed = referenced_data_files(directory, fs=self._fs)
        for path in sorted(self._orphans):
            if not self._fs.exists(path):
                self._orphans.discard(path)
            elif os.path.basename(path) not in needed:
                try:
                    self._fs.remove(path)
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
            CorruptCheckpointError: If a file is missing, truncated or fails its checksum; the
                state is then unchanged.
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
        if not checkpoint_exists(save_path):
            raise ValueError("The passed save_path is not a valid checkpoint: " + save_path)
        logger.info("Restoring parameters from %s", save_path)
        state = self._state_for(sess)
        if is_sharded(state):  # A collective: every rank reads the chunks it needs.
            load_sharded(state, save_path, allow_missing=self._optional, fs=self._fs)
            return
        reader = CheckpointReader(save_path, fs=self._fs)
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
