"""``Saver``: TF's checkpoint API over the writers, the commit protocol and the keeper.

Saving is split in two: a ``Writer`` (``writer.py``) stages the state on the calling thread (a
copy into host staging buffers), then persists it with the commit protocol, on the calling
thread for ``save`` and on the background writer thread for ``save_async``; the ``Keeper``
then updates the state file and deletes what retention lets go (``writers.py``, ``commit.py``,
``retention.py``). At most one save is in flight: a new save first waits until the one being
written is committed (or failed).

Saves are incremental by default (unchanged frozen tensors are referenced, not copied), and a
save is full whenever an incremental one would leave every kept checkpoint depending on one
data file (``policy.may_reference``). A state holding ``DTensor`` s (FSDP2) is saved and
restored by every rank together (``writers.ShardedWriter``, ``sharded/``); the writer is
chosen once per state (``writer_choice``).

TF name: ``tf.compat.v1.train.Saver``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from torchsupervisor.checkpoint import policy
from torchsupervisor.checkpoint.best import best_rule, check_metrics
from torchsupervisor.checkpoint.engine import CheckpointEngine
from torchsupervisor.checkpoint.files import (
    checkpoint_exists,
    get_checkpoint_mtimes,
)
from torchsupervisor.checkpoint.retention import Keeper
from torchsupervisor.checkpoint.save_targets import save_target
from torchsupervisor.checkpoint.snapshot import Stager, StagingBuffers
from torchsupervisor.checkpoint.write_after import Waitable, wait_before_writing
from torchsupervisor.checkpoint.writer import Directories, SaveStats, SaveTarget, Writer
from torchsupervisor.checkpoint.writer_choice import WriterChoice
from torchsupervisor.checkpoint.writers import replica_entries
from torchsupervisor.core.checks import (
    check_bool,
    check_clock,
    check_int,
    check_number,
    check_str,
)
from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.state_names import check_var_list, select_state
from torchsupervisor.storage import BY_PATH, Storage

if TYPE_CHECKING:
    from torchsupervisor.core.global_step import GlobalStepLike
    from torchsupervisor.core.session import SessionLike

__all__ = ["SaveStats", "Saver"]  # SaveStats: see writer.py


logger = logging.getLogger("torchsupervisor")

DEFAULT_MAX_SHARD_BYTES = 1 << 30
"""``max_shard_bytes`` of a ``sharded=True`` Saver that gives none: 1 GiB."""


def _check_origin(origin: Mapping[str, str | int] | None) -> dict[str, str | int] | None:
    if origin is None:
        return None
    checked = {}
    for key, value in dict(origin).items():
        if not isinstance(key, str) or not isinstance(value, (str, int)) or isinstance(value, bool):
            raise TypeError(f"origin must map strings to strings or integers, got {origin!r}")
        checked[key] = value
    return checked


class Saver:
    """Save and restore the state as checkpoints, keeping the newest ``max_to_keep``.

    Args:
        var_list: What to save. None: the whole state of the session passed to ``save`` /
            ``restore``. A mapping of names to stateful objects: exactly those (the session may
            then be None); a name may be a ``/`` path into a bigger checkpoint on restore
            (``{"model/backbone": net.backbone}``). A list (TF's ``Saver([var1, var2])``) of
            state entry names and objects of the session's state (tensors, sub-modules,
            optimizers): each object is saved under its path in the state, found by identity
            at each save and restore (``Saver([model.fc.weight])`` covers
            ``model/fc.weight``, as a checkpoint of the whole state names it).
        reshape, restore_sequentially, saver_def, builder, defer_build, write_version,
            filename: Accepted in TF's positional order and ignored: they configure TF's
            graph (restore ops, the ``SaverDef``, the V1/V2 format); nothing here needs them.
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
        keep_best: Also keep the best this many checkpoints by the metrics saved with them
            (``save(metrics=...)``), besides the newest ``max_to_keep``; a best one is
            deleted only once this many better ones exist (``checkpoint/best.py``). 0: none.
        best_fn: With ``keep_best``: the name of the metric that ranks them, or a function
            of the metrics returning the score (None: the checkpoint ranks nowhere).
        best_mode: ``"max"`` (a higher score is better, e.g. an accuracy) or ``"min"`` (a
            loss).
        origin: Who writes these checkpoints, recorded in every manifest of one process's
            state (``Manifest.origin``; the memory tier records its run id and rank there and
            refuses a snapshot of another's); None: nothing recorded.
        staging_buffers: Where the host staging buffers of a state on the CPU come from
            (``checkpoint.snapshot.StagingBuffers``: the memory tier stages straight into its
            files, ``storage.slots``); None: ordinary host memory.
        row_blocks: Also record the CRC-32C of each block of rows of the larger tensors
            (``Manifest.row_blocks``), so that restoring the checkpoint into a state sharded
            by rows (FSDP2, any world size) reads about the rows each rank holds instead of
            every tensor whole; it costs the writer a second CRC pass over those tensors
            (about 7 ms per 100 MB, beside the write) and the manifest about 11 bytes a
            block (at most 128 blocks a tensor). False for checkpoints only this process
            restores (the memory tier's). A state of DTensors always records them.

    Raises:
        ValueError: If ``var_list`` is given, empty, and ``allow_empty`` is False; for a
            negative ``max_to_keep``, a ``keep_checkpoint_every_n_hours`` that is not
            positive, a ``max_shard_bytes`` or ``full_save_every_n_saves`` below 1 (naming
            the argument and the value); a ``keep_best`` without ``best_fn`` or a
            ``best_mode`` other than ``"max"``/``"min"``.
        TypeError: For a ``var_list`` of another kind, or a list item that is neither a
            name, a tensor nor a stateful object; for an argument of the wrong type
            (``max_to_keep=2.5`` or ``"3"``, an ``origin`` value that is not a string or an
            integer), naming it and the value.

    Thread safety: ``save``/``save_async``/``restore`` are meant for one (training) thread;
    bookkeeping updated by the writer thread is protected by a lock.

    TF name: ``tf.compat.v1.train.Saver``.
    """

    def __init__(
        self,
        var_list: Mapping[str, Any] | list[str] | tuple[str, ...] | None = None,
        reshape: bool = False,
        sharded: bool = False,
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float = 10000.0,
        name: str | None = None,
        restore_sequentially: bool = False,
        saver_def: object = None,
        builder: Any = None,
        defer_build: bool = False,
        allow_empty: bool = False,
        write_version: int = 2,
        pad_step_number: bool = False,
        save_relative_paths: bool = True,
        filename: str | None = None,
        *,
        max_shard_bytes: int | None = None,
        incremental: bool = True,
        full_save_every_n_saves: int | None = None,
        storage: Storage | None = None,
        clock: Clock | None = None,
        keep_best: int = 0,
        best_fn: str | Callable[[Mapping[str, float]], float | None] | None = None,
        best_mode: str = "max",
        origin: Mapping[str, str | int] | None = None,
        staging_buffers: StagingBuffers | None = None,
        row_blocks: bool = True,
    ) -> None:
        del reshape, restore_sequentially, saver_def, builder, defer_build, write_version, filename
        check_var_list(var_list)
        if var_list is not None and not var_list and not allow_empty:
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
        self._origin = _check_origin(origin)
        self._row_blocks = check_bool("row_blocks", row_blocks)
        self._var_list = var_list
        self._write_after: Waitable | None = None  # The last save_async's write_after.
        # TF's "sharded" is several data files per save (``split_files``).
        self._prefix_options = {"pad_step_number": pad_step_number, "split_files": sharded}
        self._name = name or "save"
        self._allow_empty = allow_empty
        self._incremental = incremental
        self._max_shard_bytes = max_shard_bytes or (DEFAULT_MAX_SHARD_BYTES if sharded else None)
        self._storage = storage or BY_PATH
        self._clock = check_clock("clock", clock) or REAL_CLOCK
        self._keeper = Keeper(
            self._storage,
            self._clock,
            best=best_rule(keep_best, best_fn, best_mode),
            max_to_keep=max_to_keep,
            keep_every_secs=float(keep_checkpoint_every_n_hours) * 3600.0,
            save_relative_paths=save_relative_paths,
            incremental=incremental,
            full_every=full_save_every_n_saves or policy.default_full_save_interval(max_to_keep),
        )
        self._engine = CheckpointEngine()
        self._cancel = threading.Event()
        self._stager = Stager(staging_buffers)  # Host staging buffers, reused by either writer.
        self._directories = Directories(self._storage)
        self._optional: set[str] = set()
        # The writer: sharded (every rank writes its part) or this process's snapshot; chosen
        # once per state (at construction for a ``var_list`` mapping), with that state.
        self._writers = WriterChoice(
            (self._storage, self._clock, self._keeper, self._engine, self._stager,
             self._directories),
            self._cancel,
            {"incremental": incremental, "max_shard_bytes": self._max_shard_bytes,
             "allow_empty": allow_empty, "origin": self._origin, "row_blocks": self._row_blocks},
        )  # fmt: skip
        if isinstance(var_list, Mapping):
            self._writers.for_state(var_list, var_list)
        self.last_save: SaveStats | None = None
        """What the last committed save cost (None before the first)."""

    # ----------------------------------------------------------------------------- saving

    def save(
        self,
        sess: SessionLike | None,
        save_path: str,
        global_step: GlobalStepLike | None = None,
        latest_filename: str | None = None,
        meta_graph_suffix: str = "meta",
        write_meta_graph: bool = True,
        write_state: bool = True,
        strip_default_attrs: bool = False,
        save_debug_info: bool = False,
        *,
        metrics: Mapping[str, float] | None = None,
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
            metrics: What the run measured at this checkpoint (``{"accuracy": 0.98}``:
                numbers, or one-element tensors), stored in its manifest; ``keep_best``
                ranks checkpoints by them and ``torchsupervisor ls`` shows them. Not with a
                state of DTensors.

        Returns:
            The checkpoint prefix, or None for an empty state with ``allow_empty``.

        Raises:
            ValueError: For a ``latest_filename`` with a directory part, one that collides with
                ``save_path``, a missing parent directory, a negative ``global_step``, or
                nothing to save.
            TypeError: For a state entry that cannot be saved without pickle, or whose dtype
                the format cannot hold (``complex128``).
            LogdirLockedError: Another process writes to the directory (at the first save
                there).
            CheckpointSaveError: If writing fails; older checkpoints are untouched. (A state
                file that cannot be written after the commit is logged once, not raised.)
                For a state of DTensors, also when the ranks are at different saves (a save
                called on some ranks only): nothing is written.

        Distributed: a state of DTensors is saved by every rank together: call ``save`` on
        every rank at the same step. Whatever fails on one rank (its state, its directory,
        a ``state_dict`` that raises) is raised on every rank, and nothing is committed.

        TF name: ``tf.compat.v1.train.Saver.save`` (same arguments, in the same order).
        """
        del meta_graph_suffix, write_meta_graph, strip_default_attrs, save_debug_info
        start = time.perf_counter()
        metrics = check_metrics(metrics)
        state, writer = self._state_and_writer(sess)
        target, error = save_target(
            save_path, global_step, latest_filename, write_state, metrics,
            collective=writer.collective, **self._prefix_options,
        )  # fmt: skip
        staged = writer.stage(state, target, global_step, background=False, error=error)
        if staged is None:
            return None
        self.last_save = writer.persist(
            staged, target, time.perf_counter() - start, background=False
        )
        logger.debug("Checkpoint %s: %s", target.prefix, self.last_save)
        return target.prefix

    def save_async(
        self,
        sess: SessionLike | None,
        save_path: str,
        global_step: GlobalStepLike | None = None,
        latest_filename: str | None = None,
        write_state: bool = True,
        *,
        write_after: Waitable | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> concurrent.futures.Future[str | None]:
        """Take the snapshot now and write it on the background writer thread.

        Blocks only for the copy into host staging buffers (and, if a previous save is still
        being written, until that one is committed: at most one save is in flight).

        A state of DTensors (FSDP2) is saved by every rank: call it on every rank at the same
        step. Each rank copies only its local shards here; planning, writing, checksums, the
        ranks' agreement and the commit run on the writer threads, through a gloo group of
        their own (made at the first such call). A failure on any rank commits nothing and
        fails the future on every rank.

        Args:
            write_after: The writer thread starts writing once this event is set (at most
                ``WRITE_AFTER_WAIT_SECS`` later, at once when the save is cancelled): the
                ``CheckpointDriver`` passes its summary writer's flush of the steps up to the
                snapshot, so that they are on disk before the checkpoint commits. None: no
                wait.
            The others: see ``save``.

        Returns:
            A future resolving to the prefix once committed, or to the error of the write
            (``CheckpointSaveError``; also for a directory that does not exist, which the
            writer checks, with ``save``'s text). While a thread waits in its ``result()``,
            the write runs at that thread's CPU priority (``docs/checkpoints.md``).

        Raises:
            ValueError, TypeError: As ``save``, for problems found before the copy. For a
                state of DTensors nothing is raised here: every error, on any rank, fails
                the future on every rank (the ranks still meet in the collective).

        TF name: none (TF saved on the calling thread).
        """
        start = time.perf_counter()
        metrics = check_metrics(metrics)
        self._write_after = write_after  # What ``wait`` asks for (a save waits for it).
        state, writer = self._state_and_writer(sess)
        target, error = save_target(
            save_path, global_step, latest_filename, write_state, metrics,
            collective=writer.collective, **self._prefix_options,
        )  # fmt: skip
        staged = writer.stage(state, target, global_step, background=True, error=error)
        if staged is None:
            done: concurrent.futures.Future[str | None] = concurrent.futures.Future()
            done.set_result(None)
            return done
        stall = time.perf_counter() - start
        return self._engine.submit(self._persist, writer, staged, target, stall, write_after)

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
        self._stager.clear()  # No staging memory outlives the close.
        self._directories.release()

    @property
    def in_flight(self) -> bool:
        """True while an asynchronous save is being written.

        TF name: none.
        """
        return self._engine.in_flight

    def wait(self, timeout_secs: float | None = None) -> bool:
        """Wait for the save in flight, if any (its errors go to its future, not here).

        A save still waiting for its ``write_after`` gets it asked now when it can be asked
        (``ask()``: the summaries' flush a ``CheckpointDriver`` leaves for the next step
        boundary), since the caller's wait would otherwise hold that boundary back.

        Returns:
            True when nothing is in flight any more, False on timeout.

        TF name: none.
        """
        ask = getattr(self._write_after, "ask", None)
        if callable(ask):
            ask()
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
        # A writer stuck in a system call must not block the exit beyond the grace period.
        self._engine.abandon(timeout_secs)
        return self._engine.wait(timeout_secs)

    def allow_missing(self, *names: str) -> None:
        """Let ``restore`` skip these state entries, with a warning, when a checkpoint lacks them.

        For entries added to a run after checkpoints were written (the Supervisor's ``rng``
        entry on a checkpoint from a run that did not save it, say). Other missing entries are
        an error.

        TF name: none (TF's restore failed on any missing variable).
        """
        self._optional.update(names)

    def _state_and_writer(self, sess: SessionLike | None) -> tuple[Mapping[str, Any], Writer[Any]]:
        """What a save of ``sess`` writes, and with which writer. A collective writer saves
        what the replicas share (``replica_entries``), and takes no metrics yet."""
        state = self._state_for(sess)
        writer = self._writer_for(state, sess)
        if writer.collective:
            state = replica_entries(state)
        return state, writer

    def _state_for(self, sess: SessionLike | None) -> Mapping[str, Any]:
        if isinstance(self._var_list, Mapping):
            return self._var_list
        state = getattr(sess, "state", None)
        if state is None:
            raise ValueError(
                "This Saver has no var_list mapping, so it needs a session with a state; got "
                f"{type(sess).__name__}"
            )
        return select_state(state, self._var_list)

    def _writer_for(self, state: Mapping[str, Any], sess: SessionLike | None) -> Writer[Any]:
        """The writer of ``state``, decided once for the ``var_list`` mapping or the
        session's state (``writer_choice``)."""
        if isinstance(self._var_list, Mapping):
            source: object = self._var_list
        else:
            source = getattr(sess, "state", state)
        return self._writers.for_state(state, source)

    def _persist(
        self,
        writer: Writer[Any],
        staged: object,
        target: SaveTarget,
        stall_secs: float,
        write_after: Waitable | None,
    ) -> str:
        """Write a staged save on the writer thread, after ``write_after``."""
        wait_before_writing(write_after, self._cancel)
        self.last_save = writer.persist(staged, target, stall_secs, background=True)
        logger.debug("Checkpoint %s: %s", target.prefix, self.last_save)
        return target.prefix

    # ---------------------------------------------------------------------------- restoring

    def restore(self, sess: SessionLike | None, save_path: str | None) -> None:
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

        Distributed: a state of DTensors is restored by every rank together (a collective):
        a checkpoint that some rank cannot find raises the ``ValueError`` on every rank.

        TF name: ``tf.compat.v1.train.Saver.restore``.
        """
        if save_path is None:
            raise ValueError("Can't load save_path when it is None.")
        self._engine.wait()
        found = checkpoint_exists(save_path) or self._storage.exists(save_path + ".index")
        whole = self._state_for(sess)
        state = replica_entries(whole)
        self._writer_for(state, sess).restore(
            state,
            save_path,
            found=found,
            optional=self._optional,
            whole_state=self._var_list is None and state is whole,
        )

    # ------------------------------------------------------------------------- bookkeeping

    @property
    def last_checkpoints(self) -> list[str]:
        """The prefixes of the checkpoints this saver may still delete, oldest first.

        TF name: ``tf.compat.v1.train.Saver.last_checkpoints``.
        """
        return self._keeper.last_checkpoints

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
        self._keeper.set_last_checkpoints_with_time(entries)

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
