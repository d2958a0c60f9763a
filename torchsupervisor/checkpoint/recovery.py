"""Restarting from a directory: what a crash left, the checkpoint to resume from, what to track.

``clean_checkpoint_dir`` removes what a crash left (temporary files, checkpoints without an
index, checkpoints retention was deleting) and brings a state file that a crash left behind
up to date, at the chief's start.

``plan_restore`` reads a directory once and answers both questions of a restart. It is the one
code path of every restart (``SessionManager``) and of the tools that predict one
(``torchsupervisor verify`` and ``ls``), so that their answers always agree.

The order in which a restart tries checkpoints (``RestorePlan.candidates``):

1. committed checkpoints that the state file does not list, that are newer (by global step,
   then time) than its ``model_checkpoint_path``, and that were committed after the state file
   was last written: a crash between the commit of a checkpoint and the update of the state
   file must not send training back one interval (a checkpoint committed before the state
   file's last write was left out of it on purpose, by a hand edit: it is not adopted);
2. the state file's ``model_checkpoint_path`` (so a hand-edited state file is obeyed, however
   it was trimmed), then its older entries, newest first;
3. every other committed checkpoint of the directory, newest first (a state file that was lost
   or damaged, or that lists absolute paths of a logdir that was moved).

A state file that cannot be used (empty, garbled, unreadable, a FIFO or a directory) is
reported once and ignored: the checkpoints are found by scanning the directory. A listed path
outside the directory whose base name is a committed checkpoint of the directory (a logdir
copied with ``cp -r``, or moved, whose state file holds absolute paths) is replaced by that
checkpoint of the directory, so that a copy never reads, and its ``Saver`` never deletes,
files of the original.

The checkpoints the restarted ``Saver`` tracks for ``max_to_keep`` (``RestorePlan.tracked``,
oldest first): those the state file lists that lie in the directory, followed by the
committed checkpoints it does not list that are newer than its newest entry (a checkpoint
committed just before a crash, before the state file was updated: adopted, so that it is
listed and deleted in turn instead of leaking). Without a state file every committed
checkpoint of the directory is newer than the (missing) newest entry and is adopted. With an
unusable state file none is adopted: checkpoints it may have preserved on purpose
(``keep_checkpoint_every_n_hours``) cannot be told apart, and keeping a file is always safe.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from torchsupervisor.checkpoint.files import (
    clean_stale_temporaries,
    find_incomplete_checkpoints,
    remove_checkpoint,
)
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.checkpoint.state_file import (
    read_checkpoint_state,
    read_pending_deletions,
    state_file_path,
    update_checkpoint_state_internal,
)
from torchsupervisor.errors import CorruptCheckpointError, NotFoundError
from torchsupervisor.storage import BY_PATH, Storage
from torchsupervisor.storage import paths as url_paths

__all__ = [
    "RestorePlan",
    "clean_checkpoint_dir",
    "plan_restore",
    "restore_candidates",
    "scan_checkpoints",
]

logger = logging.getLogger("torchsupervisor")

_UNREADABLE = (0, -1, 0.0)

_Key = tuple[int, int, float]


def _sort_key(prefix: str, storage: Storage) -> _Key:
    try:
        manifest = CheckpointReader(prefix, storage=storage).manifest
    except (NotFoundError, CorruptCheckpointError):
        return _UNREADABLE
    step = -1 if manifest.global_step is None else manifest.global_step
    return (1, step, manifest.wall_time)


def _scan(directory: str, storage: Storage) -> list[tuple[_Key, str]]:
    try:
        names = storage.list(directory)
    except OSError:
        return []
    keyed = [
        (_sort_key(prefix, storage), prefix)
        for prefix in (
            os.path.join(directory, name[: -len(".index")])
            for name in names
            if name.endswith(".index")
        )
    ]
    keyed.sort(key=lambda item: item[0], reverse=True)
    return keyed


def scan_checkpoints(directory: str, *, storage: Storage = BY_PATH) -> list[str]:
    """Return the prefixes of every committed checkpoint (``*.index``) in ``directory``.

    Sorted newest first by the global step in the manifest, then the manifest's wall time;
    checkpoints whose manifest cannot be read come last (they are reported when tried).

    TF name: none.
    """
    return [prefix for _, prefix in _scan(directory, storage)]


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """What a restart of ``directory`` does (see the module docstring).

    Attributes:
        directory: The checkpoint directory.
        candidates: Prefixes to try, in order, without duplicates; each has a ``.index``.
        tracked: Prefixes the restarted ``Saver`` tracks for ``max_to_keep``, oldest first:
            all in ``directory``.
        adopted: The part of ``tracked`` the state file does not list (committed after its
            last update).
        state_file_error: Why the state file was ignored, if it exists and was.
        has_state_file: Whether a usable state file was read.
    """

    directory: str
    candidates: list[str]
    tracked: list[str]
    adopted: list[str]
    state_file_error: str | None
    has_state_file: bool


def _state_file_mtime(
    checkpoint_dir: str, latest_filename: str | None, storage: Storage, state: object
) -> float | None:
    """When the usable state file was last written (None: none, or unknown)."""
    if state is None:
        return None
    try:
        return storage.mtime(state_file_path(checkpoint_dir, latest_filename))
    except OSError:
        return None


def _committed_since(prefix: str, written: float | None, storage: Storage) -> bool:
    """Whether ``prefix`` was committed (its index written) at or after ``written``.

    An unlisted checkpoint committed after the state file's last write is what a crash
    between the commit and the state-file update leaves: adopted. One committed before it was
    left out of the state file on purpose (a hand edit that sends the restart back to an
    older checkpoint): not adopted. Both times come from the same file system or store.
    """
    if written is None:
        return True
    try:
        return storage.mtime(prefix + ".index") >= written
    except OSError:
        return True


def clean_checkpoint_dir(directory: str | os.PathLike, *, storage: Storage = BY_PATH) -> None:
    """Remove what a crash left in ``directory``: temporaries, uncommitted checkpoints, and the
    checkpoints retention was deleting; record in the state file the checkpoints committed
    after its last update.

    An uncommitted checkpoint is one with data files and no index (``find_incomplete_
    checkpoints``); its data files that a committed checkpoint still references (an
    incremental one reading the tensors of a deleted older one) are kept, and such a prefix
    is not reported. A checkpoint the state file names as being deleted
    (``state_file.read_pending_deletions``: the crash came between the state-file update and
    the deletion) is deleted, if the state file does not list it and it is older than the
    state file's newest checkpoint. Each checkpoint whose files are really removed is logged
    at WARNING level with the files' count; failures to remove are logged and ignored.
    Committed checkpoints newer than the state file's newest entry (the crash came between a
    commit and the state-file update) are added to it, the newest as ``model_checkpoint_path``,
    so that ``latest_checkpoint`` names the checkpoint a restart resumes from even before the
    next save (logged at WARNING level; a failure to write is logged and ignored).

    Args:
        directory: The checkpoint directory (a missing one has nothing to clean).
        storage: Where the checkpoints live (tests inject faults here).

    Thread safety: call at start-up, before any save to ``directory`` is in flight.
    Distributed: call on the rank that writes to ``directory`` (the chief) only.

    TF name: none (TF left crash debris in place).
    """
    directory = os.fspath(directory)
    if not storage.is_dir(directory):
        return
    try:
        clean_stale_temporaries(directory, storage=storage)
    except OSError as e:
        logger.warning("Could not remove the temporary files of %s: %s", directory, e)
    _finish_pending_deletions(directory, storage)
    for prefix in find_incomplete_checkpoints(directory, storage=storage):
        _remove(prefix, storage, "incomplete checkpoint", "no index: the save did not finish")
    _record_adopted(directory, storage)


def _record_adopted(directory: str, storage: Storage) -> None:
    """Name in the state file the checkpoints committed after its last update.

    A crash between a checkpoint's commit (its index) and the state-file update leaves a
    state file that names an older checkpoint: a restart resumes from the newer one anyway
    (``plan_restore``), but ``latest_checkpoint`` and every tool that reads the state file
    would name the older one until the next save, and a restarted run with nothing left to do
    makes none. The state file is rewritten as the restarted ``Saver`` will keep it: the
    newest adopted checkpoint first, the tracked list oldest first (relative paths). A
    missing or unusable state file is left alone (see the module docstring).
    """
    state, error = read_checkpoint_state(directory, storage=storage)
    if state is None or error is not None:
        return
    listed = {url_paths.normpath(p) for p in state.all_model_checkpoint_paths}
    listed.add(url_paths.normpath(state.model_checkpoint_path))
    try:
        names = storage.list(directory)
    except OSError:
        return
    unlisted = [
        name
        for name in names
        if name.endswith(".index")
        and url_paths.normpath(os.path.join(directory, name[: -len(".index")])) not in listed
    ]
    if not unlisted:  # The usual start: no crash came between a commit and the state file.
        return
    plan = plan_restore(directory, storage=storage)
    if not plan.adopted:
        return
    newest = plan.adopted[-1]
    try:
        update_checkpoint_state_internal(
            directory,
            newest,
            all_model_checkpoint_paths=plan.tracked,  # Ends with ``newest``.
            save_relative_paths=True,
            storage=storage,
        )
    except (OSError, RuntimeError) as e:
        logger.warning("Could not record %s in the state file of %s: %s", newest, directory, e)
        return
    logger.warning(
        "Recorded %s in the state file of %s: it was committed after the state file's last "
        "update (the last run stopped in between)",
        newest,
        directory,
    )


def _remove(prefix: str, storage: Storage, what: str, why: str) -> None:
    """Delete a checkpoint's files; say so only if files were really deleted."""
    try:
        removed = remove_checkpoint(prefix, storage=storage)
    except OSError as e:
        logger.warning("Could not remove %s %s: %s", what, prefix, e)
        return
    if removed:
        count = f"{len(removed)} file{'' if len(removed) == 1 else 's'}"
        # INFO: what a kill -9 leaves, the normal case of a restart (not a warning).
        logger.info("Removed %s %s (%s; %s)", what, prefix, why, count)


def _finish_pending_deletions(directory: str, storage: Storage) -> None:
    pending = read_pending_deletions(directory, storage=storage)
    if not pending:
        return
    state, _ = read_checkpoint_state(directory, storage=storage)
    if state is None:
        return
    listed = {url_paths.normpath(p) for p in state.all_model_checkpoint_paths}
    listed.add(url_paths.normpath(state.model_checkpoint_path))
    head = _sort_key(state.model_checkpoint_path, storage)
    for prefix in pending:
        if url_paths.normpath(prefix) in listed or not _committed(prefix, storage):
            continue
        if not _sort_key(prefix, storage) < head:
            continue  # Never newer than the state file's head: the list is not trusted.
        _remove(
            prefix, storage, "checkpoint", "retention was deleting it when the last run stopped"
        )


def plan_restore(
    checkpoint_dir: str, latest_filename: str | None = None, *, storage: Storage = BY_PATH
) -> RestorePlan:
    """Read ``checkpoint_dir`` once: the checkpoints to try, and those to keep track of.

    Never raises for what is in the directory: a damaged state file or manifest only
    changes the order (``RestorePlan.state_file_error`` says why the state file was ignored).

    Args:
        checkpoint_dir: The directory holding the checkpoints and the state file.
        latest_filename: The state file's name (default ``"checkpoint"``).
        storage: Where the checkpoints live (tests inject faults here).

    Returns:
        The ``RestorePlan``.

    TF name: none (TF restores ``latest_checkpoint`` and tracks the state file's list).
    """
    state, error = read_checkpoint_state(checkpoint_dir, latest_filename, storage=storage)
    if error is not None:
        logger.warning(
            "Ignoring the state file: %s. A restart uses the newest valid checkpoint of %s",
            error,
            checkpoint_dir,
        )
    scanned = _scan(checkpoint_dir, storage)
    keys = {url_paths.normpath(prefix): key for key, prefix in scanned}
    listed: list[str] = []
    if state is not None:
        for path in [state.model_checkpoint_path, *reversed(state.all_model_checkpoint_paths)]:
            listed.append(_relocate(path, checkpoint_dir, storage))

    newer: list[tuple[_Key, str]] = []
    if state is not None or error is None:
        known = {url_paths.normpath(p) for p in listed}
        head: _Key | None = None
        if listed:
            head = keys.get(url_paths.normpath(listed[0]))
            if head is None:
                head = (
                    _sort_key(listed[0], storage) if _committed(listed[0], storage) else _UNREADABLE
                )
        written = _state_file_mtime(checkpoint_dir, latest_filename, storage, state)
        for key, prefix in scanned:
            if url_paths.normpath(prefix) in known or key == _UNREADABLE:
                continue
            if (head is None or key > head) and _committed_since(prefix, written, storage):
                newer.append((key, prefix))
    if listed:
        for _, prefix in newer:
            logger.warning(
                "Checkpoint %s is newer than the state file's %s (a save that finished "
                "after the last state-file update): trying it first",
                prefix,
                listed[0],
            )

    ordered = [prefix for _, prefix in newer] + listed + [prefix for _, prefix in scanned]
    candidates = _unique(p for p in ordered if _committed(p, storage))

    inside = storage.canonical(checkpoint_dir or os.curdir)
    tracked_listed = []
    if state is not None:
        for path in state.all_model_checkpoint_paths:
            path = _relocate(path, checkpoint_dir, storage)
            if (
                _committed(path, storage)
                and storage.canonical(os.path.dirname(path) or os.curdir) == inside
            ):
                tracked_listed.append(path)
    adopted = [prefix for _, prefix in sorted(newer)]
    tracked = _unique([*tracked_listed, *adopted])
    if adopted and state is not None:
        logger.info("Adopting checkpoints the state file does not list yet: %s", adopted)
    return RestorePlan(
        directory=checkpoint_dir,
        candidates=candidates,
        tracked=tracked,
        adopted=[p for p in adopted if p in tracked],
        state_file_error=error,
        has_state_file=state is not None,
    )


def restore_candidates(
    checkpoint_dir: str, latest_filename: str | None = None, *, storage: Storage = BY_PATH
) -> list[str]:
    """Return the checkpoint prefixes a restart should try, in order, without duplicates.

    Args:
        checkpoint_dir: The directory holding the checkpoints and the state file.
        latest_filename: The state file's name (default ``"checkpoint"``).
        storage: Where the checkpoints live (tests inject faults here).

    Returns:
        Prefixes whose ``.index`` exists; possibly empty (``plan_restore(...).candidates``).

    TF name: none.
    """
    return plan_restore(checkpoint_dir, latest_filename, storage=storage).candidates


def _unique(paths) -> list[str]:
    seen: set[str] = set()
    out = []
    for path in paths:
        key = url_paths.normpath(path)
        if key not in seen:
            seen.add(key)
            out.append(path)
    return out


def _committed(prefix: str, storage: Storage) -> bool:
    return bool(prefix) and storage.exists(prefix + ".index")


def _relocate(path: str, checkpoint_dir: str, storage: Storage) -> str:
    """The checkpoint of ``checkpoint_dir`` a state-file entry stands for.

    An entry in the directory is itself. An entry elsewhere whose base name is a committed
    checkpoint of the directory is that local checkpoint (a copied or moved logdir whose state
    file holds absolute paths). Otherwise the entry as it is (a checkpoint in another
    directory, on purpose, or missing).
    """
    directory = checkpoint_dir or os.curdir
    if url_paths.normpath(os.path.dirname(path) or os.curdir) == url_paths.normpath(directory):
        return path
    local = os.path.join(checkpoint_dir, os.path.basename(path))
    if storage.canonical(os.path.dirname(path) or os.curdir) == storage.canonical(directory):
        return local
    if _committed(local, storage):
        if _committed(path, storage):
            logger.info("Using %s of %s rather than the listed %s", local, checkpoint_dir, path)
        else:
            logger.warning("Checkpoint %s not found; using %s", path, local)
        return local
    return path
