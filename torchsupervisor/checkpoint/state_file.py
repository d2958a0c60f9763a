"""The ``checkpoint`` state file: TF's ``CheckpointState`` text, read tolerantly, saved atomically.

A run directory holds one small text file (``checkpoint`` by default) naming the newest
checkpoint prefix and the prefixes still kept, oldest first::

    model_checkpoint_path: "/data/run/model.ckpt-300"
    all_model_checkpoint_paths: "/data/run/model.ckpt-100"
    all_model_checkpoint_paths: "/data/run/model.ckpt-200"
    all_model_checkpoint_paths: "/data/run/model.ckpt-300"

The text is what TensorFlow writes, made by the same protobuf text printer, so TF reads our
state files and we read TF's. (Recent protobuf releases print non-ASCII characters of a path as
UTF-8 where older ones, and so older TF, used octal escapes; both forms read back the same.)
Writes go to a temporary name in the same directory, are fsynced and renamed over the old file,
so a reader sees either the old or the new state, never a torn one. Reading never executes
anything from the file: the protobuf text parser fills a message of strings and floats.

TF name: ``tf.train.{generate_checkpoint_state_proto, update_checkpoint_state,
get_checkpoint_state, latest_checkpoint}``
(``tensorflow/python/checkpoint/checkpoint_management.py``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import MutableSequence, Sequence
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format

from torchsupervisor.checkpoint.files import first_matching_file
from torchsupervisor.storage import BY_PATH, Storage, storage_for
from torchsupervisor.storage import paths as url_paths

__all__ = [
    "DEFAULT_STATE_FILENAME",
    "CheckpointState",
    "generate_checkpoint_state_proto",
    "get_checkpoint_state",
    "latest_checkpoint",
    "parse_checkpoint_state",
    "read_checkpoint_state",
    "read_pending_deletions",
    "record_newest",
    "state_file_path",
    "update_checkpoint_state",
    "update_checkpoint_state_internal",
]

logger = logging.getLogger("torchsupervisor")

DEFAULT_STATE_FILENAME = "checkpoint"
"""The state file's name inside the checkpoint directory when ``latest_filename`` is None."""

PENDING_DELETION_MARK = "# torchsupervisor deleting: "
"""Starts a comment line of the state file naming a checkpoint being deleted (JSON string)."""

_PathLike = str | os.PathLike


def _build_checkpoint_state_class() -> Any:
    # tensorflow/python/training/checkpoint_state.proto, described field by field. It lives in a
    # private pool so that it can never clash with a TF installation's own copy.
    fdp = descriptor_pb2.FieldDescriptorProto
    file_proto = descriptor_pb2.FileDescriptorProto(
        name="tensorflow/python/training/checkpoint_state.proto",
        package="tensorflow",
        syntax="proto3",
    )
    message = file_proto.message_type.add(name="CheckpointState")
    for name, number, field_type, label in (
        ("model_checkpoint_path", 1, fdp.TYPE_STRING, fdp.LABEL_OPTIONAL),
        ("all_model_checkpoint_paths", 2, fdp.TYPE_STRING, fdp.LABEL_REPEATED),
        ("all_model_checkpoint_timestamps", 3, fdp.TYPE_DOUBLE, fdp.LABEL_REPEATED),
        ("last_preserved_timestamp", 4, fdp.TYPE_DOUBLE, fdp.LABEL_OPTIONAL),
    ):
        message.field.add(name=name, number=number, type=field_type, label=label)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_proto)
    descriptor = pool.FindMessageTypeByName("tensorflow.CheckpointState")
    get_message_class = getattr(message_factory, "GetMessageClass", None)
    if get_message_class is None:  # protobuf < 4.22
        return message_factory.MessageFactory(pool).GetPrototype(descriptor)
    return get_message_class(descriptor)


CheckpointState = _build_checkpoint_state_class()
CheckpointState.__doc__ = """The protobuf message of the ``checkpoint`` state file (proto3).

Fields:
    model_checkpoint_path (str): prefix of the newest checkpoint.
    all_model_checkpoint_paths (repeated str): prefixes still kept, oldest first; the last one
        equals ``model_checkpoint_path``.
    all_model_checkpoint_timestamps (repeated float): wall time in seconds of each of them
        (optional; written by TF2's CheckpointManager).
    last_preserved_timestamp (float): wall time in seconds of the last checkpoint kept by
        ``keep_checkpoint_every_n_hours`` (optional).

TF name: ``tensorflow.CheckpointState`` (``checkpoint_state_pb2.CheckpointState``).
"""


def state_file_path(save_dir: _PathLike, latest_filename: str | None = None) -> str:
    """Return the path of the state file in ``save_dir``.

    Args:
        save_dir: The checkpoint directory.
        latest_filename: The state file's name; None means ``"checkpoint"``.

    Returns:
        ``os.path.join(save_dir, latest_filename or "checkpoint")``.

    TF name: ``checkpoint_management._GetCheckpointFilename`` (private in TF).
    """
    if latest_filename is None:
        latest_filename = DEFAULT_STATE_FILENAME
    return os.path.join(os.fspath(save_dir), latest_filename)


def _as_mutable_list(paths: Sequence[_PathLike] | None, arg_name: str) -> MutableSequence[Any]:
    if paths is None:
        return []
    if isinstance(paths, (str, bytes)):
        raise TypeError(f"{arg_name} must be a list of checkpoint paths, got the string {paths!r}")
    if isinstance(paths, MutableSequence):
        return paths  # Updated in place, like TF.
    return list(paths)  # A tuple or another read-only sequence cannot be updated in place.


def generate_checkpoint_state_proto(
    save_dir: _PathLike,
    model_checkpoint_path: _PathLike,
    all_model_checkpoint_paths: Sequence[_PathLike] | None = None,
    all_model_checkpoint_timestamps: Sequence[float] | None = None,
    last_preserved_timestamp: float | None = None,
) -> Any:
    """Build the ``CheckpointState`` message for a state file in ``save_dir``.

    If ``all_model_checkpoint_paths`` is empty or does not end with ``model_checkpoint_path``,
    the model path is appended (logged at INFO). When ``save_dir`` is relative, every relative
    path is rewritten relative to ``save_dir`` (``url_paths.relpath(p, save_dir)``) so that the
    reader, which joins stored relative paths with the directory, finds the same files;
    absolute paths, and everything when ``save_dir`` is absolute, are stored unchanged.

    Like TF, a list passed as ``all_model_checkpoint_paths`` is updated in place: the model
    path may be appended to it and its relative entries rewritten. A tuple is copied instead.

    Args:
        save_dir: Directory of the state file (str or path-like). ``""`` means the current
            directory.
        model_checkpoint_path: Prefix of the newest checkpoint.
        all_model_checkpoint_paths: Prefixes of all kept checkpoints, oldest first; None means
            none besides the model path.
        all_model_checkpoint_timestamps: Wall time in seconds of each kept checkpoint, in the
            same order; None or empty means not recorded.
        last_preserved_timestamp: Wall time in seconds of the last checkpoint preserved by
            ``keep_checkpoint_every_n_hours``; None means not recorded.

    Returns:
        A new ``CheckpointState``.

    Raises:
        ValueError: ``all_model_checkpoint_timestamps`` is non-empty and its length differs
            from that of the path list (after the model path was appended).
        TypeError: ``all_model_checkpoint_paths`` is a single string instead of a list.

    TF name: ``tf.compat.v1.train.generate_checkpoint_state_proto``.
    """
    save_dir = os.fspath(save_dir)
    model_path = os.fspath(model_checkpoint_path)
    paths = _as_mutable_list(all_model_checkpoint_paths, "all_model_checkpoint_paths")

    if not paths or os.fspath(paths[-1]) != model_path:
        logger.info("%s is not in all_model_checkpoint_paths. Manually adding it.", model_path)
        paths.append(model_path)

    timestamps = None
    if all_model_checkpoint_timestamps is not None:
        timestamps = [float(t) for t in all_model_checkpoint_timestamps]
    if timestamps and len(timestamps) != len(paths):
        raise ValueError(
            "Checkpoint timestamps, if provided, must match checkpoint paths "
            f"(got paths {paths} and timestamps {timestamps})"
        )

    if not url_paths.isabs(save_dir):
        base = save_dir or os.curdir
        if not url_paths.isabs(model_path):
            model_path = url_paths.relpath(model_path, base)
        for i, p in enumerate(paths):
            p = os.fspath(p)
            if not url_paths.isabs(p):
                paths[i] = url_paths.relpath(p, base)

    state = CheckpointState()
    state.model_checkpoint_path = model_path
    state.all_model_checkpoint_paths.extend(os.fspath(p) for p in paths)
    if timestamps:
        state.all_model_checkpoint_timestamps.extend(timestamps)
    if last_preserved_timestamp is not None:
        state.last_preserved_timestamp = float(last_preserved_timestamp)
    return state


def update_checkpoint_state(
    save_dir: _PathLike,
    model_checkpoint_path: _PathLike,
    all_model_checkpoint_paths: Sequence[_PathLike] | None = None,
    latest_filename: str | None = None,
    all_model_checkpoint_timestamps: Sequence[float] | None = None,
    last_preserved_timestamp: float | None = None,
) -> None:
    """Write the state file of ``save_dir`` atomically, storing paths as given.

    Same as ``update_checkpoint_state_internal`` with ``save_relative_paths=False``.

    Args:
        save_dir: Directory of the state file; it must exist.
        model_checkpoint_path: Prefix of the newest checkpoint.
        all_model_checkpoint_paths: Prefixes of all kept checkpoints, oldest first; None means
            none besides the model path. A list is updated in place (see
            ``generate_checkpoint_state_proto``).
        latest_filename: Name of the state file; None means ``"checkpoint"``.
        all_model_checkpoint_timestamps: Wall time in seconds of each kept checkpoint; None
            means not recorded.
        last_preserved_timestamp: Wall time in seconds of the last preserved checkpoint; None
            means not recorded.

    Raises:
        RuntimeError: The model path is the state file's own path.
        ValueError: The timestamps do not match the paths.
        OSError: The file could not be written (the old state file is then unchanged).

    Thread safety: concurrent writers never produce a torn file; the last rename wins.

    TF name: ``tf.compat.v1.train.update_checkpoint_state``.
    """
    update_checkpoint_state_internal(
        save_dir,
        model_checkpoint_path,
        all_model_checkpoint_paths=all_model_checkpoint_paths,
        latest_filename=latest_filename,
        save_relative_paths=False,
        all_model_checkpoint_timestamps=all_model_checkpoint_timestamps,
        last_preserved_timestamp=last_preserved_timestamp,
    )


def update_checkpoint_state_internal(
    save_dir: _PathLike,
    model_checkpoint_path: _PathLike,
    all_model_checkpoint_paths: Sequence[_PathLike] | None = None,
    latest_filename: str | None = None,
    save_relative_paths: bool = False,
    all_model_checkpoint_timestamps: Sequence[float] | None = None,
    last_preserved_timestamp: float | None = None,
    *,
    pending_deletions: Sequence[_PathLike] = (),
    storage: Storage = BY_PATH,
) -> None:
    """Write the state file of ``save_dir`` atomically.

    The text is put whole (``Storage.put``: locally a temporary name, fsync, rename over the
    state file, fsync of the directory). If that fails, the previous state file is left as it
    was (or, when the rename could not be made durable, there is none: a restart then scans
    the directory).

    Args:
        save_dir: Directory of the state file; it must exist.
        model_checkpoint_path: Prefix of the newest checkpoint.
        all_model_checkpoint_paths: Prefixes of all kept checkpoints, oldest first; None means
            none besides the model path. Without ``save_relative_paths`` a list is updated in
            place (see ``generate_checkpoint_state_proto``); with it, it is left alone.
        latest_filename: Name of the state file; None means ``"checkpoint"``.
        save_relative_paths: If True, absolute paths are stored relative to ``save_dir`` so that
            the directory can be moved.
        all_model_checkpoint_timestamps: Wall time in seconds of each kept checkpoint; None
            means not recorded.
        last_preserved_timestamp: Wall time in seconds of the last preserved checkpoint; None
            means not recorded.
        pending_deletions: Checkpoints of ``save_dir`` that the caller deletes right after
            this write (retention), recorded as comment lines (``# torchsupervisor deleting:
            "model.ckpt-100"``) that TF's parser ignores, so that a crash before they are
            gone does not leak them (``read_pending_deletions``).
        storage: Where the state file is written (tests inject faults here).

    Raises:
        RuntimeError: The model path, as a reader would resolve it, is the state file itself:
            ``"Save path '<path>' conflicts with path used for checkpoint state.  Please use a
            different save path."``.
        ValueError: The timestamps do not match the paths.
        OSError: The file could not be written (the old state file is then unchanged).

    Thread safety: concurrent writers never produce a torn file; the last rename wins.

    TF name: ``tf.__internal__.train.update_checkpoint_state``
    (``checkpoint_management.update_checkpoint_state_internal``).
    """
    save_dir = os.fspath(save_dir)
    model_path = os.fspath(model_checkpoint_path)
    state_path = state_file_path(save_dir, latest_filename)

    if save_relative_paths:
        base = save_dir or os.curdir

        def relative(p: _PathLike) -> str:
            p = os.fspath(p)
            return url_paths.relpath(p, base) if url_paths.isabs(p) else p

        state = generate_checkpoint_state_proto(
            save_dir,
            relative(model_path),
            all_model_checkpoint_paths=[relative(p) for p in all_model_checkpoint_paths or ()],
            all_model_checkpoint_timestamps=all_model_checkpoint_timestamps,
            last_preserved_timestamp=last_preserved_timestamp,
        )
    else:
        state = generate_checkpoint_state_proto(
            save_dir,
            model_path,
            all_model_checkpoint_paths=all_model_checkpoint_paths,
            all_model_checkpoint_timestamps=all_model_checkpoint_timestamps,
            last_preserved_timestamp=last_preserved_timestamp,
        )

    stored = state.model_checkpoint_path
    resolved = stored if url_paths.isabs(stored) else os.path.join(save_dir, stored)
    if url_paths.abspath(resolved) == url_paths.abspath(state_path):
        raise RuntimeError(
            f"Save path '{model_path}' conflicts with path used for checkpoint state.  "
            "Please use a different save path."
        )

    text = text_format.MessageToString(state)
    for path in pending_deletions:
        text += f"{PENDING_DELETION_MARK}{json.dumps(os.path.basename(os.fspath(path)))}\n"
    storage.put(state_path, [text.encode("utf-8")])


def record_newest(
    prefix: str, latest_filename: str | None = None, *, storage: Storage = BY_PATH
) -> None:
    """Make ``prefix`` the newest checkpoint of its directory's state file, keeping the rest.

    For a writer without retention (``save_sharded(write_state=True)``): the checkpoints the
    state file lists stay listed (``prefix`` moves to the end); nothing is deleted.

    Args:
        prefix: The committed checkpoint.
        latest_filename: The state file's name; None means ``"checkpoint"``.
        storage: Where the directory lives.

    Raises:
        OSError: The state file could not be written.

    TF name: none.
    """
    save_dir = os.path.dirname(prefix)
    state, _ = read_checkpoint_state(save_dir, latest_filename, storage=storage)
    own = url_paths.normpath(prefix)
    paths = [] if state is None else list(state.all_model_checkpoint_paths)
    paths = [p for p in paths if url_paths.normpath(p) != own] + [prefix]
    update_checkpoint_state_internal(
        save_dir=save_dir,
        model_checkpoint_path=prefix,
        all_model_checkpoint_paths=paths,
        latest_filename=latest_filename,
        storage=storage,
    )


def read_pending_deletions(
    checkpoint_dir: _PathLike, latest_filename: str | None = None, *, storage: Storage = BY_PATH
) -> list[str]:
    """Return the checkpoints the last state-file update was about to delete.

    ``update_checkpoint_state_internal(pending_deletions=...)`` records, in comment lines that
    TF's parser ignores, the checkpoints retention deletes right after the state file is
    written: a crash in between leaves them committed but unlisted, indistinguishable from a
    checkpoint kept on purpose, unless the state file says so. The next start deletes them
    (``management.clean_checkpoint_dir``).

    Args:
        checkpoint_dir: The checkpoint directory.
        latest_filename: The state file's name; None means ``"checkpoint"``.
        storage: Where the directory lives.

    Returns:
        Prefixes in ``checkpoint_dir`` (plain base names joined with it; any other entry is
        ignored); empty if there is no usable state file.

    TF name: none.
    """
    checkpoint_dir = os.fspath(checkpoint_dir)
    try:
        data = _read_state_bytes(state_file_path(checkpoint_dir, latest_filename), storage)
        text = (data or b"").decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    out = []
    for line in text.splitlines():
        if not line.startswith(PENDING_DELETION_MARK):
            continue
        try:
            name = json.loads(line[len(PENDING_DELETION_MARK) :])
        except ValueError:
            continue
        if isinstance(name, str) and name and "/" not in name and name not in (".", ".."):
            out.append(os.path.join(checkpoint_dir, name))
    return out


def parse_checkpoint_state(data: bytes | str) -> Any:
    """Parse the text of a state file.

    The protobuf text format is accepted in all its forms: ``#`` comments, single or double
    quotes, no space after the colon, fields in any order, a repeated field as ``[a, b]``.
    A repeated singular field keeps its last value (TF merges the text). A leading UTF-8 byte
    order mark is ignored. Nothing in the text is ever executed.

    Args:
        data: The file's bytes (decoded as UTF-8) or text.

    Returns:
        A new ``CheckpointState``; paths are returned exactly as stored.

    Raises:
        google.protobuf.text_format.ParseError: The text is not a ``CheckpointState``.
        UnicodeDecodeError: ``data`` is bytes that are not UTF-8.
    """
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    text = text.removeprefix("\ufeff")
    state = CheckpointState()
    text_format.Merge(text, state)
    return state


MAX_STATE_FILE_BYTES = 16 << 20
"""The largest state file read (16 MiB: some 100,000 paths); a larger one is ignored."""


def _warn_ignored(state_path: str, error: BaseException) -> None:
    logger.warning("%s: %s", type(error).__name__, error)
    logger.warning("%s: Checkpoint ignored", state_path)


def _read_state_bytes(state_path: str, storage: Storage) -> bytes | None:
    """The state file's bytes; None if it does not exist.

    Raises:
        OSError: It cannot be read, is not a regular file (a FIFO, a directory), or is larger
            than ``MAX_STATE_FILE_BYTES``.
    """
    try:
        return storage.read_bytes(state_path, max_bytes=MAX_STATE_FILE_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _resolve(state: Any, checkpoint_dir: str) -> Any:
    if not url_paths.isabs(state.model_checkpoint_path):
        state.model_checkpoint_path = os.path.join(checkpoint_dir, state.model_checkpoint_path)
    paths = state.all_model_checkpoint_paths
    for i, p in enumerate(paths):
        if not url_paths.isabs(p):
            paths[i] = os.path.join(checkpoint_dir, p)
    return state


def read_checkpoint_state(
    checkpoint_dir: _PathLike, latest_filename: str | None = None, *, storage: Storage = BY_PATH
) -> tuple[Any, str | None]:
    """Read the state file of ``checkpoint_dir`` without ever raising: for restarts and tools.

    Like ``get_checkpoint_state``, relative paths are joined with ``checkpoint_dir``. A
    restart must not fail because of this small file: the checkpoints themselves are found
    by scanning the directory (``recovery.restore_candidates``).

    Args:
        checkpoint_dir: The checkpoint directory.
        latest_filename: Name of the state file; None means ``"checkpoint"``.
        storage: Where the directory lives.

    Returns:
        ``(state, None)`` for a usable state file; ``(None, None)`` when there is none;
        ``(None, why)`` when it exists but is unusable: unreadable, not a regular file (a
        FIFO is never opened for a blocking read), larger than ``MAX_STATE_FILE_BYTES``, not
        a ``CheckpointState`` text, or naming no model path (empty).

    Thread safety: safe to call while another thread or process rewrites the file.

    TF name: none (TF's ``get_checkpoint_state`` raises on an empty file).
    """
    checkpoint_dir = os.fspath(checkpoint_dir)
    state_path = state_file_path(checkpoint_dir, latest_filename)
    try:
        data = _read_state_bytes(state_path, storage)
    except OSError as e:
        return None, f"{state_path} cannot be read: {e}"
    if data is None:
        return None, None
    try:
        state = parse_checkpoint_state(data)
    except (text_format.ParseError, UnicodeDecodeError) as e:
        return None, f"{state_path} is not a checkpoint state: {type(e).__name__}: {e}"
    if not state.model_checkpoint_path:
        return None, f"{state_path} names no checkpoint (model_checkpoint_path is empty)"
    return _resolve(state, checkpoint_dir), None


def get_checkpoint_state(checkpoint_dir: _PathLike, latest_filename: str | None = None) -> Any:
    """Read the state file of ``checkpoint_dir``.

    Relative paths in the file are joined with ``checkpoint_dir`` without normalisation
    (``"./model.ckpt-687529"`` becomes ``checkpoint_dir + "/./model.ckpt-687529"``), absolute
    ones are returned as stored. A file that cannot be read (I/O error, a directory named
    ``checkpoint``, a FIFO or device, larger than 16 MiB) or parsed (not a
    ``CheckpointState`` text, not UTF-8) is logged as two warnings, ``"<ErrorType>:
    <error>"`` and ``"<state file>: Checkpoint ignored"``, and ignored.

    Args:
        checkpoint_dir: The checkpoint directory.
        latest_filename: Name of the state file; None means ``"checkpoint"``.

    Returns:
        The ``CheckpointState``, or None if there is no state file or it was ignored.

    Raises:
        ValueError: The file parses but names no model path (e.g. it is empty):
            ``"Invalid checkpoint state loaded from <checkpoint_dir>"`` (TF's behaviour; a
            restart does not use this function and restores the newest valid checkpoint
            anyway, see ``read_checkpoint_state``).

    Thread safety: safe to call while another thread or process rewrites the file (the
    writer renames a complete file into place; on an object store, where it is replaced
    whole, a file replaced while it was read is read again).

    TF name: ``tf.train.get_checkpoint_state``.
    """
    checkpoint_dir = os.fspath(checkpoint_dir)
    state_path = state_file_path(checkpoint_dir, latest_filename)
    try:
        data = _read_state_bytes(state_path, storage_for(state_path))
    except OSError as e:
        _warn_ignored(state_path, e)
        return None
    if data is None:
        return None
    try:
        state = parse_checkpoint_state(data)
    except (text_format.ParseError, UnicodeDecodeError) as e:
        _warn_ignored(state_path, e)
        return None
    if not state.model_checkpoint_path:
        raise ValueError("Invalid checkpoint state loaded from " + checkpoint_dir)
    return _resolve(state, checkpoint_dir)


def latest_checkpoint(checkpoint_dir: _PathLike, latest_filename: str | None = None) -> str | None:
    """Return the prefix of the newest checkpoint recorded in ``checkpoint_dir``.

    The prefix comes from the state file and is returned only if its ``<prefix>.index`` exists
    (the index is written last, so the checkpoint is complete); otherwise
    ``"Couldn't match files for checkpoint <prefix>"`` is logged at ERROR level and None is
    returned. The index is looked up literally, then as a glob pattern (as TF does).

    Args:
        checkpoint_dir: The checkpoint directory.
        latest_filename: Name of the state file; None means ``"checkpoint"``.

    Returns:
        The checkpoint prefix (absolute, or joined with ``checkpoint_dir``), or None.

    Raises:
        ValueError: The state file names no model path (see ``get_checkpoint_state``).

    Thread safety: safe to call while another thread or process saves checkpoints.

    TF name: ``tf.train.latest_checkpoint``.
    """
    state = get_checkpoint_state(checkpoint_dir, latest_filename)
    if state is None or not state.model_checkpoint_path:
        return None
    prefix = state.model_checkpoint_path
    if first_matching_file(prefix + ".index") is not None:
        return prefix
    logger.error("Couldn't match files for checkpoint %s", prefix)
    return None
