"""Errors raised by torchsupervisor: TF's ``OpError`` family plus the checkpoint errors.

The TF classes keep TF's names, error codes and constructor
(``OutOfRangeError(node_def, op, message)``); a single string argument is also accepted as the
message, which is the natural call in eager code (``OutOfRangeError("queue closed")``).
Where a builtin exception has the same meaning, the class also derives from it
(``InvalidArgumentError`` is a ``ValueError``, ``NotFoundError`` a ``LookupError``, ...) so that
plain-Python ``except`` clauses keep working.

TF name: ``tf.errors``.
"""

from __future__ import annotations

import errno
from typing import Any

__all__ = [
    "ABORTED",
    "ALREADY_EXISTS",
    "CANCELLED",
    "DATA_LOSS",
    "DEADLINE_EXCEEDED",
    "FAILED_PRECONDITION",
    "INTERNAL",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "OK",
    "OUT_OF_RANGE",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "UNAUTHENTICATED",
    "UNAVAILABLE",
    "UNIMPLEMENTED",
    "UNKNOWN",
    "AbortedError",
    "AlreadyExistsError",
    "CancelledError",
    "CheckpointError",
    "CheckpointSaveError",
    "CorruptCheckpointError",
    "DataLossError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "LogdirLockedError",
    "ManifestError",
    "MemoryTierFullError",
    "NanLossDuringTrainingError",
    "NotFoundError",
    "NotRegularFileError",
    "OpError",
    "OutOfRangeError",
    "OutsideDirectoryError",
    "PermissionDeniedError",
    "ReplicaAbort",
    "ReplicaGoneError",
    "ResourceExhaustedError",
    "ShardedStateError",
    "StaleReferenceError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "UnknownError",
    "WorldError",
    "WriteCancelled",
    "error_code_from_exception_type",
    "exception_type_from_error_code",
]

# Canonical error codes (tensorflow/core/protobuf/error_codes.proto).
OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
ALREADY_EXISTS = 6
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
FAILED_PRECONDITION = 9
ABORTED = 10
OUT_OF_RANGE = 11
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
DATA_LOSS = 15
UNAUTHENTICATED = 16


class OpError(Exception):
    """The base class of the errors that TF raises when an operation fails.

    Args:
        node_def: Kept for TF compatibility (``None`` in eager code). A lone string passed here
            with no ``op`` and no ``message`` is taken as the message.
        op: The failed operation or callable, if known.
        message: The error message.
        error_code: One of the canonical codes of this module (``UNKNOWN`` when ``None``).

    TF name: ``tf.errors.OpError``.
    """

    _default_code = UNKNOWN

    def __init__(
        self,
        node_def: object = None,
        op: object = None,
        message: str | None = None,
        error_code: int | None = None,
        *args: object,
    ) -> None:
        if message is None and op is None and isinstance(node_def, str):
            node_def, message = None, node_def
        self._node_def = node_def
        self._op = op
        self._message = "" if message is None else str(message)
        self._error_code = self._default_code if error_code is None else int(error_code)
        super().__init__(self._message, *args)

    @property
    def message(self) -> str:
        """The error message (str)."""
        return self._message

    @property
    def op(self) -> Any:
        """The operation that failed, or ``None``."""
        return self._op

    @property
    def node_def(self) -> Any:
        """TF's NodeDef of the failed op; always ``None`` unless given."""
        return self._node_def

    @property
    def error_code(self) -> int:
        """The canonical integer error code."""
        return self._error_code

    def __str__(self) -> str:
        return self._message

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self._node_def, self._op, self._message, self._error_code))


def _rebuild(cls: type[OpError], node_def: object, op: object, message: str, code: int) -> OpError:
    err = cls.__new__(cls)
    OpError.__init__(err, node_def, op, message, code)
    return err


_CODE_TO_TYPE: dict[int, type[OpError]] = {}


class _CodedError(OpError):
    """An ``OpError`` with a fixed code: TF's constructor ``(node_def, op, message)``.

    A subclass names its code in the class statement, ``class X(_CodedError, code=N)``;
    that registers it for ``exception_type_from_error_code`` and ends its docstring
    with its TF name. Subclasses of those (ours, not TF's) keep their parent's code.
    """

    def __init_subclass__(cls, code: int | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if code is None:  # a subclass of a coded error keeps its parent's code
            return
        cls._default_code = code
        _CODE_TO_TYPE[code] = cls
        cls.__doc__ = f"{cls.__doc__}\n\nTF name: ``tf.errors.{cls.__name__}`` (error code {code})."

    def __init__(
        self,
        node_def: object = None,
        op: object = None,
        message: str | None = None,
        *args: object,
    ):
        OpError.__init__(self, node_def, op, message, self._default_code, *args)


class CancelledError(_CodedError, code=CANCELLED):
    """An operation or step was cancelled."""


class UnknownError(_CodedError, code=UNKNOWN):
    """An unknown error."""


class InvalidArgumentError(_CodedError, ValueError, code=INVALID_ARGUMENT):
    """An operation received an invalid argument."""


class DeadlineExceededError(_CodedError, code=DEADLINE_EXCEEDED):
    """A deadline expired before the operation finished."""


class NotFoundError(_CodedError, LookupError, code=NOT_FOUND):
    """A requested entity (a file, a key) was not found."""


class AlreadyExistsError(_CodedError, code=ALREADY_EXISTS):
    """An entity that we attempted to create already exists."""


class PermissionDeniedError(_CodedError, code=PERMISSION_DENIED):
    """The caller lacks permission for the operation."""


class ResourceExhaustedError(_CodedError, code=RESOURCE_EXHAUSTED):
    """Some resource (memory, disk) is exhausted."""


class FailedPreconditionError(_CodedError, code=FAILED_PRECONDITION):
    """The system is not in a state to execute the operation (e.g. an uninitialized variable)."""


class AbortedError(_CodedError, code=ABORTED):
    """The operation was aborted; recoverable by creating a new session."""


class OutOfRangeError(_CodedError, code=OUT_OF_RANGE):
    """An input was exhausted (end of a queue or of a dataset)."""


class UnimplementedError(_CodedError, NotImplementedError, code=UNIMPLEMENTED):
    """The operation is not implemented."""


class InternalError(_CodedError, code=INTERNAL):
    """An internal invariant was broken."""


class UnavailableError(_CodedError, code=UNAVAILABLE):
    """The service is unavailable; recoverable by retrying."""


class DataLossError(_CodedError, code=DATA_LOSS):
    """Unrecoverable data loss or corruption (e.g. a bad checksum)."""


class UnauthenticatedError(_CodedError, code=UNAUTHENTICATED):
    """The request lacks valid authentication."""


def exception_type_from_error_code(error_code: int) -> type[OpError]:
    """Return the ``OpError`` subclass for a canonical error code.

    Raises:
        KeyError: If ``error_code`` is not a known code.

    TF name: ``tf.errors.exception_type_from_error_code``.
    """
    return _CODE_TO_TYPE[error_code]


def error_code_from_exception_type(cls: type[OpError]) -> int:
    """Return the canonical error code of an ``OpError`` subclass.

    TF name: ``tf.errors.error_code_from_exception_type``.
    """
    return cls._default_code


class CheckpointError(OpError):
    """Base class of the checkpoint errors; ``path`` names the file or prefix concerned."""

    def __init__(self, message: str, *, path: str | None = None, code: int = UNKNOWN) -> None:
        OpError.__init__(self, None, None, message, code)
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self)._from_parts, (self._message, self.path))

    @classmethod
    def _from_parts(cls, message: str, path: str | None) -> CheckpointError:
        return cls(message, path=path)


class CorruptCheckpointError(CheckpointError, DataLossError):
    """A checkpoint is corrupt, truncated or incomplete.

    Attributes:
        path: The file found bad (a shard, the index) or the checkpoint prefix.
        reason: What is wrong, e.g. ``"checksum mismatch"`` or ``"missing file"``.
    """

    def __init__(self, message: str, *, path: str | None = None, reason: str = "") -> None:
        CheckpointError.__init__(self, message, path=path, code=DATA_LOSS)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_corrupt, (self._message, self.path, self.reason))


def _rebuild_corrupt(message: str, path: str | None, reason: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(message, path=path, reason=reason)


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (disk full, permission denied, ...).

    The original ``OSError`` is chained as ``__cause__``. Older checkpoints are untouched and the
    temporary files of the failed save have been removed when this is raised.
    """


class LogdirLockedError(CheckpointError, FailedPreconditionError):
    """Another process is writing to this log directory: one writer per logdir.

    Raised at once when a ``Supervisor``, a chief ``MonitoredTrainingSession`` or a ``Saver``
    starts writing to a directory whose writer lock another process holds. The lock is an
    advisory record lock (``lockf``) that the operating system releases when its process
    ends, even by ``kill -9``: a crashed run never blocks its restart. Readers (``ls``, ``verify``,
    TensorBoard, ``CheckpointReader``) never take it.

    Attributes:
        path: The lock file (``<logdir>/.torchsupervisor-writer.lock``).
        directory: The log directory.
        owner: What the holder wrote in the lock file: ``pid``, ``host``, ``since`` (ISO 8601
            time), ``command``; empty if it could not be read.

    TF name: none (TF let two writers corrupt each other's state file).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        directory: str | None = None,
        owner: dict[str, Any] | None = None,
    ) -> None:
        CheckpointError.__init__(self, message, path=path, code=FAILED_PRECONDITION)
        self.directory = directory
        self.owner = dict(owner or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_locked, (self._message, self.path, self.directory, self.owner))


def _rebuild_locked(
    message: str, path: str | None, directory: str | None, owner: dict[str, Any]
) -> LogdirLockedError:
    return LogdirLockedError(message, path=path, directory=directory, owner=owner)


class MemoryTierFullError(CheckpointError, ResourceExhaustedError):
    """The memory tier's file system (a tmpfs) has no room for its snapshots.

    Raised by the memory tier's room check (``MemoryTierStorage.check_room``), naming the
    size needed.

    Attributes:
        path: The memory tier's directory.
        needed_bytes: The bytes its snapshots need (slots x the state's size).
        free_bytes: The bytes free for them (what the directory holds already included).

    TF name: none.
    """

    def __init__(
        self, message: str, *, path: str | None = None, needed_bytes: int = 0, free_bytes: int = 0
    ) -> None:
        CheckpointError.__init__(self, message, path=path, code=RESOURCE_EXHAUSTED)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_full, (self._message, self.path, self.needed_bytes, self.free_bytes))


def _rebuild_full(
    message: str, path: str | None, needed_bytes: int, free_bytes: int
) -> MemoryTierFullError:
    return MemoryTierFullError(message, path=path, needed_bytes=needed_bytes, free_bytes=free_bytes)


# ---------------------------------------------------------------------------------------------
# The other errors of the library: TF's NaN loss, and the errors of its layers (storage,
# checkpoint format, state, replicas, test helpers), each a subclass of the closest builtin.


class NanLossDuringTrainingError(RuntimeError):
    """The loss became NaN (raised by ``NanTensorHook`` with ``fail_on_nan_loss=True``).

    ``str()`` is ``"NaN loss during training."``.

    TF name: ``tf.compat.v1.train.NanLossDuringTrainingError``.
    """

    def __str__(self) -> str:
        return "NaN loss during training."


class NotRegularFileError(OSError):
    """A checkpoint or events file is a FIFO, a device, a socket or a directory.

    Such a file is damage, never data: reading a FIFO blocks forever and a device such as
    ``/dev/zero`` never ends. ``Storage.open_read`` raises it before reading a byte.

    Attributes:
        filename: The path.
        kind: What it is instead (``"a FIFO"``, ``"a directory"``, ...).
    """

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(errno.EINVAL, f"not a regular file ({kind})", path)
        self.kind = kind


class OutsideDirectoryError(PermissionError):
    """An object opened with ``inside=DIR`` lies elsewhere (a symbolic link out of ``DIR``).

    Attributes:
        filename: The path.
        directory: The directory it had to lie in.
    """

    def __init__(self, path: str, directory: str, actual: str) -> None:
        super().__init__(errno.EACCES, f"a link out of {directory} (to {actual})", path)
        self.directory = directory


class WriteCancelled(Exception):
    """Raised by ``Storage.put`` when its ``cancel`` event is set between two chunks."""


class ReplicaAbort(FailedPreconditionError):
    """A replica gave up on an agreement (its session failed): the others stop waiting.

    Attributes:
        reason: The text of the rank that gave up (``"rank 1: <why>"``).
    """

    def __init__(self, reason: str) -> None:
        super().__init__(None, None, f"A replica gave up: {reason}")
        self.reason = reason


class ReplicaGoneError(DeadlineExceededError):
    """A rank waited for is gone (its process no longer exists on this machine:
    ``distributed/liveness``): the wait ends at once, as it would have at its deadline.

    Attributes:
        ranks: The ranks found gone.
    """

    def __init__(self, ranks: list[int], message: str) -> None:
        super().__init__(None, None, message)
        self.ranks = ranks


class StaleReferenceError(CheckpointSaveError):
    """Tensors changed without their version counter changing; the save was not committed.

    The writer found that reused (referenced) CPU tensors no longer hold their committed
    bytes although their version counter did not move (a write through ``.data`` or numpy).
    Their value at the snapshot's step is lost, so the save cannot be completed.

    Attributes:
        names: The tensors concerned; the saver copies them at every later save.
    """

    def __init__(self, message: str, *, path: str | None = None, names: frozenset[str]):
        super().__init__(message, path=path)
        self.names = names


class ManifestError(ValueError):
    """A manifest or shard header does not follow the format (the reader names the file)."""


class ShardedStateError(ValueError):
    """``flatten_state`` met a ``DTensor``: the state is sharded between ranks.

    Such a state is saved with ``checkpoint.sharded.save_sharded``, every rank writing its
    part (``Saver`` chooses that writer for a state of DTensors).

    Attributes:
        path: The state path of the first DTensor met.
    """

    def __init__(self, path: str) -> None:
        super().__init__(
            f"Cannot save {path!r} as an unsharded tensor: it is a DTensor (a sharded state); "
            "save it with save_sharded on every rank"
        )
        self.path = path


class WorldError(RuntimeError):
    """A rank of ``run_world`` failed or did not finish in time.

    Attributes:
        failures: ``{rank: traceback text}`` of the ranks that raised or timed out.
    """

    def __init__(self, failures: dict[int, str]) -> None:
        listed = "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{listed}")
        self.failures = failures
