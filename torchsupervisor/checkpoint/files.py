"""Find, date and delete checkpoints on disk by prefix; clean up after a crash.

A checkpoint with prefix ``P`` is the files ``P.index`` (the manifest, written last: its
presence means the checkpoint is complete) and ``P.data-00000-of-0000N`` (the shards). TF's V1
checkpoints were a single file named ``P`` (or ``P-00000-of-0000N`` when sharded); the TF
functions here still recognise them where TF does.

Prefixes are literal paths (``glob.escape`` is applied before a pattern is appended), except in
``checkpoint_exists`` and ``get_checkpoint_mtimes``, which, like TF, also accept a glob pattern
(TF's sharded V1 prefixes look like ``model.ckpt-?????-of-00002``); they try the literal path
first, so a directory whose name contains ``[`` or ``*`` still works.

TF name: the module ``tensorflow/python/checkpoint/checkpoint_management.py``.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Iterable

from torchsupervisor.checkpoint.references import referenced_data_files
from torchsupervisor.checkpoint.storage import LOCAL_FS, FileSystem, is_temporary_name

__all__ = [
    "checkpoint_exists",
    "clean_stale_temporaries",
    "find_incomplete_checkpoints",
    "get_checkpoint_mtimes",
    "list_checkpoint_files",
    "meta_graph_filename",
    "remove_checkpoint",
]

logger = logging.getLogger("torchsupervisor")

_V2 = 2  # SaverDef.V2; any other value means TF's V1 layout (a single file named like the prefix).
_DATA_GLOB_SUFFIX = ".data-?????-of-?????"
# The same names as _DATA_GLOB_SUFFIX matches ("?" is any character but "/").
_DATA_NAME_RE = re.compile(r"(?P<base>.+)\.data-[^/]{5}-of-[^/]{5}", re.DOTALL)
_SHARD_SUFFIX_RE = re.compile(r"-[\d\?]+-of-\d+$")


def _matching_files(path_or_pattern: str) -> list[str]:
    """Return ``[path]`` if it is an existing file, else the files matching it as a glob."""
    if os.path.isfile(path_or_pattern):
        return [path_or_pattern]
    if not glob.has_magic(path_or_pattern):
        return []
    return sorted(p for p in glob.glob(path_or_pattern) if os.path.isfile(p))


def _first_matching_file(path_or_pattern: str) -> str | None:
    matches = _matching_files(path_or_pattern)
    return matches[0] if matches else None


def _checkpoint_file(prefix: str) -> str | None:
    """Return the file identifying checkpoint ``prefix``: ``P.index`` (V2), else ``P`` (V1)."""
    found = _first_matching_file(prefix + ".index")
    if found is None:
        found = _first_matching_file(prefix)
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
    return _checkpoint_file(os.fspath(checkpoint_prefix)) is not None


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
        found = _checkpoint_file(os.fspath(prefix))
        if found is None:
            continue
        try:
            mtimes.append(os.stat(found).st_mtime_ns / 1e9)
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


def _data_files(prefix: str) -> list[str]:
    pattern = glob.escape(prefix) + _DATA_GLOB_SUFFIX
    return sorted(p for p in glob.glob(pattern) if os.path.isfile(p))


def list_checkpoint_files(prefix: str | os.PathLike) -> list[str]:
    """Return the existing files of the checkpoint with this prefix: index first, then shards.

    Args:
        prefix: The checkpoint prefix, a literal path (not a pattern).

    Returns:
        ``<prefix>.index`` if it exists, followed by the existing
        ``<prefix>.data-?????-of-?????`` files in name order. Empty if there are none.
    """
    prefix = os.fspath(prefix)
    index = prefix + ".index"
    files = [index] if os.path.isfile(index) else []
    return files + _data_files(prefix)


def _remove_file(path: str, fs: FileSystem) -> bool:
    try:
        fs.remove(path)
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
    fs: FileSystem = LOCAL_FS,
) -> list[str]:
    """Delete the files of a checkpoint.

    The index goes first and its removal is made durable (directory fsync) before any shard is
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
        fs: File-system seam used for every deletion (tests inject faults through it).

    Returns:
        The files deleted (TF's function returns nothing).

    Raises:
        OSError: A deletion failed for another reason than the file being absent (e.g.
            permission denied). Files deleted before the failure stay deleted.

    Thread safety: safe to call concurrently for the same prefix (the loser only warns).

    TF name: ``tf.compat.v1.train.remove_checkpoint`` (deprecated in TF).
    """
    prefix = os.fspath(checkpoint_prefix)
    removed: list[str] = []

    def remove(path: str) -> bool:
        if _remove_file(path, fs):
            removed.append(path)
            return True
        return False

    if checkpoint_format_version == _V2:
        index = prefix + ".index"
        if os.path.lexists(index) and remove(index):
            fs.fsync_dir(os.path.dirname(index))
        for path in _unreferenced_data_files(prefix, fs, log=True):
            remove(path)
    elif os.path.isfile(prefix):
        remove(prefix)
    meta = meta_graph_filename(prefix, meta_graph_suffix)
    if os.path.isfile(meta):
        remove(meta)
    return removed


def _unreferenced_data_files(prefix: str, fs: FileSystem, *, log: bool = False) -> list[str]:
    """The data files of ``prefix`` that no other committed checkpoint of its directory
    references (an incremental checkpoint may read the tensors of an older one)."""
    data = _data_files(prefix)
    if not data:
        return []
    needed = referenced_data_files(os.path.dirname(prefix), exclude=[prefix], fs=fs)
    out = []
    for path in data:
        if os.path.basename(path) in needed:
            if log:
                logger.info("Keeping %s: a newer checkpoint still uses its tensors", path)
        else:
            out.append(path)
    return out


def clean_stale_temporaries(
    directory: str | os.PathLike, *, fs: FileSystem = LOCAL_FS
) -> list[str]:
    """Delete the temporary files an interrupted write left in ``directory``.

    Temporary files are those named by ``storage.temporary_name`` (``<name>.tmp`` + 32 hex
    digits); they are never a committed checkpoint or state file. Each deletion is logged at
    WARNING level. Sub-directories are left alone; a missing directory has nothing to clean.

    Args:
        directory: The checkpoint directory (not searched recursively).
        fs: File-system seam used to list and delete (tests inject faults through it).

    Returns:
        The paths deleted, in name order.

    Raises:
        OSError: The directory could not be listed or a file could not be deleted.

    Thread safety: deletes the temporaries of writes in progress too; call it only when no
    checkpoint or state-file write to ``directory`` is in flight (at start-up, before the
    background writer starts).
    Distributed: call on the rank that writes to ``directory`` (the chief) only.
    """
    directory = os.fspath(directory)
    try:
        names = fs.listdir(directory)
    except FileNotFoundError:
        return []
    removed = []
    for name in sorted(names):
        if not is_temporary_name(name):
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            continue
        try:
            fs.remove(path)
        except FileNotFoundError:
            continue
        logger.warning("Removed stale temporary file %s (left by an interrupted write)", path)
        removed.append(path)
    if removed:
        fs.fsync_dir(directory)
    return removed


def find_incomplete_checkpoints(directory: str | os.PathLike) -> list[str]:
    """Return the prefixes in ``directory`` that have shards but no index.

    Such a checkpoint was interrupted between writing its shards and committing its index (or
    between deleting its index and its shards), or it was deleted while a newer incremental
    checkpoint still references some of its shards. It is not restorable; ``remove_checkpoint``
    deletes what no committed checkpoint references. Prefixes are matched literally.

    Args:
        directory: The checkpoint directory (not searched recursively).

    Returns:
        The prefixes, ``os.path.join(directory, <base name>)``, sorted. Empty if the directory
        does not exist.

    Raises:
        OSError: The directory could not be listed.

    Thread safety: a checkpoint being written at the time of the call is reported too.
    """
    directory = os.fspath(directory)
    try:
        names = os.listdir(directory or os.curdir)
    except FileNotFoundError:
        return []
    bases = set()
    for name in names:
        match = _DATA_NAME_RE.fullmatch(name)
        if match is not None:
            bases.add(match.group("base"))
    prefixes = (os.path.join(directory, base) for base in bases)
    return sorted(p for p in prefixes if not os.path.isfile(p + ".index"))
