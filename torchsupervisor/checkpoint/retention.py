"""What a ``Saver`` keeps: retention per state file, after each commit, and incremental chains.

After a checkpoint is committed (``commit.py``), ``Keeper.record_and_sweep`` does the rest, in
this order, so that a crash at any point loses nothing:

1. record the checkpoint in the retention of its state file (``policy.record``, ``sweep``);
2. write the state file, naming the checkpoints about to be deleted (comment lines TF ignores:
   a crash before they are gone does not leak them; the next start finishes the deletion);
3. delete what retention lets go, only in the directory of the save path, never a data file
   a newer incremental checkpoint still references (those become orphans, deleted once no
   checkpoint references them);
4. write the state file again without the names: exactly TF's text.

The keeper also remembers, per prefix family (one ``save_path``), the tensors of the last
committed save that the next one may reference, and which full save each kept checkpoint's
data starts from, for ``policy.may_reference`` (two independent copies of every tensor).
References never cross from one family to another.

Thread safety: every method takes the keeper's lock; ``record_and_sweep`` runs on the saver's
writer thread while the training thread stages the next snapshot.

TF name: the bookkeeping of ``tf.compat.v1.train.Saver`` (``_RecordLastCheckpoint``,
``_MaybeDeleteOldCheckpoints``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from torchsupervisor.checkpoint import policy
from torchsupervisor.checkpoint.best import BestRule
from torchsupervisor.checkpoint.files import list_checkpoint_files, remove_checkpoint
from torchsupervisor.checkpoint.incremental import Committed
from torchsupervisor.checkpoint.reader import read_manifests
from torchsupervisor.checkpoint.references import referenced_data_files
from torchsupervisor.checkpoint.state_file import (
    state_file_path,
    update_checkpoint_state_internal,
)
from torchsupervisor.core.clock import Clock
from torchsupervisor.storage import Storage
from torchsupervisor.storage import paths as url_paths

__all__ = ["Keeper"]

logger = logging.getLogger("torchsupervisor")


def _family_key(save_path: str) -> str:
    return url_paths.normpath(url_paths.abspath(save_path))


def _state_key(save_path: str, latest_filename: str | None) -> tuple[str, str]:
    directory = url_paths.normpath(url_paths.abspath(os.path.dirname(save_path) or os.curdir))
    return directory, latest_filename or "checkpoint"


def _in_directory(path: str, directory: str, storage: Storage) -> bool:
    """True if checkpoint ``path`` lies in ``directory`` (symbolic links resolved)."""
    return storage.canonical(os.path.dirname(path)) == storage.canonical(directory)


def _in_family(prefix: str, save_path: str) -> bool:
    """True if ``prefix`` is ``save_path`` or ``save_path-<step>``."""
    prefix, save_path = url_paths.normpath(prefix), url_paths.normpath(save_path)
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


class Keeper:
    """The retention and incremental bookkeeping of one ``Saver`` (see the module docstring).

    Args:
        storage: Where the checkpoints live.
        clock: Time for timestamps and ``keep_checkpoint_every_n_hours``.
        max_to_keep: As ``Saver``.
        keep_every_secs: ``keep_checkpoint_every_n_hours`` in seconds.
        save_relative_paths: As ``Saver``.
        incremental: Whether saves may reference committed tensors.
        full_every: ``full_save_every_n_saves`` (resolved).
        best: Keep-best retention; None: the newest only.
    """

    def __init__(
        self,
        storage: Storage,
        clock: Clock,
        *,
        max_to_keep: int | None,
        keep_every_secs: float,
        save_relative_paths: bool,
        incremental: bool,
        full_every: int,
        best: BestRule | None = None,
    ) -> None:
        self._storage = storage
        self._best = best
        self._clock = clock
        self._max_to_keep = max_to_keep
        self._keep_every_secs = keep_every_secs
        self._save_relative_paths = save_relative_paths
        self._incremental = incremental
        self._full_every = full_every
        self._lock = threading.Lock()
        # Retention is kept per state file (directory and file name): each lists only its
        # own directory's checkpoints. ``_retention`` is the one of the last save (or, before
        # any save, the list given to ``set_last_checkpoints*``, bound at the first save).
        self._retention = policy.Retention(next_keep_time=clock.time() + keep_every_secs)
        self._retention_key: tuple[str, str] | None = None
        self._retentions: dict[tuple[str, str], policy.Retention] = {}
        # Incremental saves, per prefix family (save path): references never cross families.
        self._families: dict[str, _Family] = {}
        self._always_copy: set[str] = set()
        self._orphans: set[str] = set()
        self._state_file_failures: set[str] = set()

    # ------------------------------------------------------------------- incremental chains

    def copied_always(self, frozen: set[str]) -> set[str]:
        """``frozen`` without the tensors found modified behind PyTorch's back once."""
        with self._lock:
            return frozen - self._always_copy

    def committed(
        self,
        save_path: str,
        prefix: str,
        committed: dict[str, Committed],
        *,
        full: bool,
        recorded: bool,
    ) -> None:
        """Note a save committed to ``prefix``: what the next one may reference, its chain."""
        with self._lock:
            family = self.family(save_path)
            family.committed = committed
            family.link(prefix, full=full, recorded=recorded)

    def failed(self, save_path: str, stale: Iterable[str] = ()) -> None:
        """Note a failed save: the next save copies everything (``stale`` tensors always)."""
        with self._lock:
            family = self.family(save_path)
            family.committed = {}
            family.chain = None
            self._always_copy |= set(stale)

    def reusable(
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
        target = url_paths.normpath(prefix)
        retention = self._retentions.get(_state_key(save_path, latest_filename))
        if retention is None and self._retention_key is None:
            retention = self._retention
        tracked = [
            p
            for p, _ in (retention.tracked if retention is not None else ())
            if url_paths.normpath(p) != target and _in_family(p, save_path)
        ]
        if self._max_to_keep:
            kept = tracked[-(self._max_to_keep - 1) :] if self._max_to_keep > 1 else []
        else:
            kept = list(dict.fromkeys([*tracked, *family.chain_of]))
            kept = [p for p in kept if url_paths.normpath(p) != target]
        return [family.chain_of.get(p) for p in kept]

    def family(self, save_path: str) -> _Family:
        """The incremental bookkeeping of ``save_path``'s prefix family (lock held)."""
        key = _family_key(save_path)
        family = self._families.get(key)
        if family is None:
            family = self._families[key] = _Family()
        return family

    def record(
        self,
        prefix: str,
        save_path: str,
        latest_filename: str | None,
        metrics: Mapping[str, float] | None = None,
    ) -> tuple[list[str], list[str], list[str]]:
        """Record ``prefix`` in the retention of its state file; return what retention says.

        Args:
            metrics: The checkpoint's metrics (keep best ranks it by them); None: none.

        Returns:
            ``(listed, to_delete, preserved)``: the prefixes the state file lists (the newest
            and the best, oldest first), those to delete now and those kept for good
            (``keep_checkpoint_every_n_hours``).
        """
        key = _state_key(save_path, latest_filename)
        best = self._best
        with self._lock:
            self._switch_retention(key)
            retention = policy.record(
                self._retention,
                prefix,
                self._clock.time(),
                self._max_to_keep,
                score=None if best is None else best.of(metrics),
                keep_best=0 if best is None else best.keep,
                higher_is_better=best is None or best.higher_is_better,
            )
            retention, to_delete, preserved = policy.sweep(retention, self._keep_every_secs)
            self._retention = self._retentions[key] = retention
            family = self.family(save_path)
            for path in to_delete + preserved:  # No longer counted by the chain rule.
                family.chain_of.pop(path, None)
            return policy.listed(retention), to_delete, preserved

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
            best = tuple(
                b for b in self._retention.best if _in_directory(b[0], key[0], self._storage)
            )
            retention = policy.Retention(
                tracked=entries, next_keep_time=self._retention.next_keep_time, best=best
            )
        else:
            retention = self._retentions.get(key) or policy.Retention(
                next_keep_time=self._clock.time() + self._keep_every_secs
            )
        self._retentions[key] = retention
        self._retention, self._retention_key = retention, key

    def record_and_sweep(
        self,
        prefix: str,
        save_path: str,
        latest_filename: str | None,
        *,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Record the committed ``prefix``, write the state file, then delete what retention
        lets go: only checkpoints of the directory of ``save_path``, never a file elsewhere.

        A state file that cannot be written (a directory in its place, an immutable file, a
        full disk) does not undo the commit and does not stop retention: the error is logged
        once, naming the state file, and a restart finds the checkpoints by scanning the
        directory (``recovery.plan_restore``).
        """
        save_dir = os.path.dirname(save_path)
        tracked, to_delete, preserved = self.record(prefix, save_path, latest_filename, metrics)

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

    # ------------------------------------------------------------------------- TF's lists

    @property
    def last_checkpoints(self) -> list[str]:
        """The prefixes the current state file lists (the newest and the best), oldest first."""
        with self._lock:
            return policy.listed(self._retention)

    def set_last_checkpoints_with_time(self, entries: tuple[tuple[str, float], ...]) -> None:
        """Replace the tracked list of the current state file (``(prefix, time)``).

        With keep-best retention, the best of them are found again from the metrics in their
        manifests, so that a restarted run never deletes a best checkpoint of the last one.
        """
        best: tuple[tuple[str, float, float], ...] = ()
        if self._best is not None:
            manifests = read_manifests([p for p, _ in entries], storage=self._storage)
            scored = [
                (p, self._best.of(m.metrics if (m := manifests[p]) else None), t)
                for p, t in entries
            ]
            ranked, _ = policy.rank_best(
                [(p, s, t) for p, s, t in scored if s is not None],
                self._best.keep,
                self._best.higher_is_better,
            )
            best = tuple(ranked)
        with self._lock:
            self._retention = policy.Retention(
                tracked=entries, next_keep_time=self._retention.next_keep_time, best=best
            )
            if self._retention_key is not None:
                self._retentions[self._retention_key] = self._retention
