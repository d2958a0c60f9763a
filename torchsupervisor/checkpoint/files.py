"""Find, date and delete checkpoints on disk by prefix; clean up after a crash.

A checkpoint with prefix ``P`` is the files ``P.index`` (the manifest, written last: its
presence means the checkpoint is complete) and ``P.data-00000-of-0000N`` (the shards). TF's V1
checkpoints were a single file named ``P`` (or ``P-00000-of-0000N`` when sharded); the TF
functions here still recognise them where TF does.

Prefixes are literal paths, except in ``checkpoint_exists`` and ``get_checkpoint_mtimes``,
which, like TF, also accept a glob pattern in the file name (TF's sharded V1 prefixes look like
``model.ckpt-?????-of-00002``); they try the literal path first, so a name that contains ``[``
or ``*`` still works. Every file is found, dated and deleted through the storage seam.

TF name: the module ``tensorflow/python/checkpoint/checkpoint_management.py``.
"""

from __future__ import annotations

import fnmatch
import glob
import logging
import os
import re
from collections.abc import Iterable

from torchsupervisor.checkpoint.references import referenced_data_files
from torchsupervisor.storage import BY_PATH, Storage, storage_for

__all__ = [
    "checkpoint_exists",
    "checkpoint_step",
    "clean_stale_temporaries",
    "find_incomplete_checkpoints",
    "first_matching_file",
    "get_checkpoint_mtimes",
    "list_checkpoint_files",
    "meta_graph_filename",
    "remove_checkpoint",
]

logger = logging.getLogger("torchsupervisor")

_STEP_SUFFIX = re.compile(r"-(\d+)\Z")


def checkpoint_step(prefix: str) -> int | None:
    """The global step a checkpoint prefix names (``model.ckpt-120``: 120), or None.

    TF name: none.
    """
    found = _STEP_SUFFIX.search(prefix)
    return None if found is None else int(found.group(1))


_V2 = 2  # SaverDef.V2; any other value means TF's V1 layout (a single file named like the prefix).
_DATA_SUFFIX_RE = re.compile(r"\.data-[^/]{5}-of-[^/]{5}", re.DOTALL)
# Data files "<base>.data-?????-of-?????" ("?" is any character but "/").
_DATA_NAME_RE = re.compile(r"(?P<base>.+)\.data-[^/]{5}-of-[^/]{5}", re.DOTALL)
_SHARD_SUFFIX_RE = re.compile(r"-[\d\?]+-of-\d+$")


def _matching_files(path_or_pattern: str, storage: Storage) -> list[str]:
    """Return ``[path]`` if it is an existing file, else the files whose name matches it.

    The pattern is a glob in its file name only (its directory is literal).
    """
    if storage.is_file(path_or_pattern):
        return [path_or_pattern]
    directory, pattern = os.path.split(path_or_pattern)
    if not glob.has_magic(pattern):
        return []
    try:
        names = storage.list(directory)
    except OSError:
        return []
    matches = (os.path.join(directory, n) for n in fnmatch.filter(names, pattern))
    return sorted(p for p in matches if storage.is_file(p))


def first_matching_file(path_or_pattern: str, storage: Storage | None = None) -> str | None:
    """Return ``path_or_pattern`` if it is a file, else the first file matching it, or None."""
    matches = _matching_files(path_or_pattern, storage_for(path_or_pattern, storage))
    return matches[0] if matches else None


def _checkpoint_file(prefix: str, storage: Storage) -> str | None:
    """Return the file identifying checkpoint ``prefix``: ``P.index`` (V2), else ``P`` (V1)."""
    found = first_matching_file(prefix + ".index", storage)
    if found is None:
        found = first_matching_file(prefix, storage)
    return found


def checkpoint_exists(checkpoint_prefix: str | os.PathLike) -> bool:
    """Return True if a complete checkpoint with this prefix exists.

    A checkpoint exists if ``<prefix>.index`` exists, or else (TF's V1 layout) if ``<prefix>``
    itself is an existing file. Each is tried as a literal path and then, as TF does, as a glob
    pattern. Directories never count. A prefix with data files but no index is not a
    checkpoint (see ``find_incomplete_checkpoints``).

    Args:
        checkpoint_prefix: A checkpoint prefix, e.g. the result of ``Saver.save()`` or
            ``latest_checkpoint()``; it may be a glob pattern.

    Returns:
        Whether the checkpoint exists.

    TF name: ``tf.compat.v1.train.checkpoint_exists`` (deprecated in TF).
    """
    prefix = os.fspath(checkpoint_prefix)
    return _checkpoint_file(prefix, storage_for(prefix)) is not None


def get_checkpoint_mtimes(checkpoint_prefixes: Iterable[str | os.PathLike]) -> list[float]:
    """Return the modification times of the checkpoints with these prefixes.

    For each prefix the file found as in ``checkpoint_exists`` (``<prefix>.index``, else the
    V1 file ``<prefix>``) gives the time. Prefixes with no checkpoint are skipped, so the result
    may be shorter than the input and cannot then be matched to it position by position.

    Args:
        checkpoint_prefixes: Checkpoint prefixes (literal paths or glob patterns).

    Returns:
        One modification time per existing checkpoint, in seconds since the epoch
        (``st_mtime_ns / 1e9``), in input order.

    TF name: ``tf.compat.v1.train.get_checkpoint_mtimes`` (deprecated in TF).
    """
    mtimes = []
    for prefix in checkpoint_prefixes:
        prefix = os.fspath(prefix)
        storage = storage_for(prefix)
        found = _checkpoint_file(prefix, storage)
        if found is None:
            continue
        try:
            mtimes.append(storage.mtime(found))
        except FileNotFoundError:
            continue  # Deleted since it was found.
    return mtimes


def meta_graph_filename(
    checkpoint_filename: str | os.PathLike, meta_graph_suffix: str = "meta"
) -> str:
    """Return the name of the meta-graph file TF wrote next to a checkpoint.

    A TF sharded suffix (``-00001-of-00002`` or ``-?????-of-00002``) is removed first. We never
    write meta graphs; the name is used only to delete TF's files with the checkpoint.

    Args:
        checkpoint_filename: The checkpoint prefix.
        meta_graph_suffix: The extension, without the dot.

    Returns:
        ``<prefix without shard suffix>.<meta_graph_suffix>``.

    TF name: ``checkpoint_management.meta_graph_filename``.
    """
    base = _SHARD_SUFFIX_RE.sub("", os.fspath(checkpoint_filename))
    return f"{base}.{meta_graph_suffix}"


def _data_files(prefix: str, storage: Storage) -> list[str]:
    directory, base = os.path.split(prefix)
    try:
        names = storage.list(directory)
    except OSError:
        return []
    return sorted(
        os.path.join(directory, name)
        for name in names
        if name.startswith(base)
        and _DATA_SUFFIX_RE.fullmatch(name[len(base) :])
        and storage.is_file(os.path.join(directory, name))
    )


def list_checkpoint_files(prefix: str | os.PathLike, storage: Storage | None = None) -> list[str]:
    """Return the existing files of the checkpoint with this prefix: index first, then shards.

    Args:
        prefix: The checkpoint prefix, a literal path (not a pattern).
        storage: Where it lives; None: chosen by the path.

    Returns:
        ``<prefix>.index`` if it exists, followed by the existing
        ``<prefix>.data-?????-of-?????`` files in name order. Empty if there are none.
    """
    prefix = os.fspath(prefix)
    storage = storage_for(prefix, storage)
    index = prefix + ".index"
    files = [index] if storage.is_file(index) else []
    return files + _data_files(prefix, storage)


def _remove_file(path: str, storage: Storage) -> bool:
    try:
        storage.delete(path)
    except FileNotFoundError:
        logger.warning(
            "Hit NotFoundError when deleting '%s', possibly because another process/thread is "
            "also deleting/moving the same file",
            path,
        )
        return False
    return True


def remove_checkpoint(
    checkpoint_prefix: str | os.PathLike,
    checkpoint_format_version: int = _V2,
    meta_graph_suffix: str = "meta",
    *,
    storage: Storage | None = None,
) -> list[str]:
    """Delete the files of a checkpoint.

    The index goes first (deletions are durable: ``Storage.delete``) before any shard is
    touched, so that a crash or an error part-way never leaves a checkpoint that looks complete
    but is missing data; what remains is reported by ``find_incomplete_checkpoints``. Then the
    shards ``<prefix>.data-?????-of-?????`` and TF's meta graph ``<prefix>.meta``, if present,
    are deleted, except shards that another committed checkpoint of the same directory still
    references (incremental checkpoints): those stay until their last referrer is deleted.
    Files that are absent are skipped silently; a file that disappears between listing and
    deletion (another process deleting it) is logged as a warning. The prefix is a literal
    path.

    Args:
        checkpoint_prefix: The checkpoint prefix.
        checkpoint_format_version: 2 (TF's V2 and our format: index + shards). Any other value
            means TF's V1 layout: the single file ``<prefix>`` is deleted instead.
        meta_graph_suffix: Extension of TF's meta-graph file, without the dot.
        storage: Where the checkpoint lives (tests inject faults here); None: chosen by the
            path.

    Returns:
        The files deleted (TF's function returns nothing).

    Raises:
        OSError: A deletion failed for another reason than the file being absent (e.g.
            permission denied). Files deleted before the failure stay deleted.

    Thread safety: safe to call concurrently for the same prefix (the loser only warns).

    TF name: ``tf.compat.v1.train.remove_checkpoint`` (deprecated in TF).
    """
    prefix = os.fspath(checkpoint_prefix)
    storage = storage_for(prefix, storage)
    removed: list[str] = []

    def remove(path: str) -> bool:
        if _remove_file(path, storage):
            removed.append(path)
            return True
        return False

    if checkpoint_format_version == _V2:
        index = prefix + ".index"
        if storage.exists(index):
            remove(index)
        for path in _unreferenced_data_files(prefix, storage, log=True):
            remove(path)
    elif storage.is_file(prefix):
        remove(prefix)
    meta = meta_graph_filename(prefix, meta_graph_suffix)
    if storage.is_file(meta):
        remove(meta)
    return removed


def _unreferenced_data_files(prefix: str, storage: Storage, *, log: bool = False) -> list[str]:
    """The data files of ``prefix`` that no other committed checkpoint of its directory
    references (an incremental checkpoint may read the tensors of an older one)."""
    data = _data_files(prefix, storage)
    if not data:
        return []
    needed = referenced_data_files(os.path.dirname(prefix), exclude=[prefix], storage=storage)
    out = []
    for path in data:
        if os.path.basename(path) in needed:
            if log:
                logger.info("Keeping %s: a newer checkpoint still uses its tensors", path)
        else:
            out.append(path)
    return out


def clean_stale_temporaries(
    directory: str | os.PathLike, *, storage: Storage = BY_PATH
) -> list[str]:
    """Delete what interrupted writes left in ``directory`` (``Storage.clean_leftovers``).

    Locally these are temporary files (``<name>.tmp`` + 32 hex digits), never a committed
    checkpoint or state file. Each deletion is logged at WARNING level. Sub-directories are
    left alone; a missing directory has nothing to clean.

    Args:
        directory: The checkpoint directory (not searched recursively).
        storage: Where it lives (tests inject faults here).

    Returns:
        The paths deleted, in name order.

    Raises:
        OSError: The directory could not be listed or a file could not be deleted.

    Thread safety: deletes the temporaries of writes in progress too; call it only when no
    checkpoint or state-file write to ``directory`` is in flight (at start-up, before the
    background writer starts).
    Distributed: call on the rank that writes to ``directory`` (the chief) only.
    """
    removed = storage.clean_leftovers(os.fspath(directory))
    for path in removed:
        # INFO: what a kill -9 leaves, the normal case of a restart (not a warning).
        logger.info("Removed temporary file %s (left by an interrupted write)", path)
    return removed


def find_incomplete_checkpoints(
    directory: str | os.PathLike, *, storage: Storage = BY_PATH
) -> list[str]:
    """Return the prefixes in ``directory`` that have shards but no index.

    Such a checkpoint was interrupted between writing its shards and committing its index (or
    between deleting its index and its shards), or it was deleted while a newer incremental
    checkpoint still references some of its shards. It is not restorable; ``remove_checkpoint``
    deletes what no committed checkpoint references. Prefixes are matched literally.

    Args:
        directory: The checkpoint directory (not searched recursively).
        storage: Where it lives.

    Returns:
        The prefixes, ``os.path.join(directory, <base name>)``, sorted. Empty if the directory
        does not exist.

    Raises:
        OSError: The directory could not be listed.

    Thread safety: a checkpoint being written at the time of the call is reported too.
    """
    directory = os.fspath(directory)
    try:
        names = storage.list(directory)
    except FileNotFoundError:
        return []
    bases = set()
    for name in names:
        match = _DATA_NAME_RE.fullmatch(name)
        if match is not None:
            bases.add(match.group("base"))
    prefixes = (os.path.join(directory, base) for base in bases)
    return sorted(p for p in prefixes if not storage.is_file(p + ".index"))
