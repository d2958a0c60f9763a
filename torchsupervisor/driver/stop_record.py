"""How the last session of a log directory ended: a small record a batch script can read.

A scheduler stops a job with a signal, and a requeue script must tell a clean preemption (the
final checkpoint committed: requeue) from a crash. The exit status cannot tell it under
``torchrun``: the agent, signalled too, exits 1 with a traceback even when every worker
stopped cleanly. So the chief writes ``<logdir>/last_stop.json`` when a session ends, and
removes it when the next one starts: a session killed (``kill -9``, a lost node) leaves none.
``torchsupervisor preempted LOGDIR`` reads it (exit status 0: a clean preemption).

The record is JSON: ``{"reason": "preemption" | "end" | "error", "signal": "SIGTERM" | null,
"step": int | null, "checkpoint": "model.ckpt-120" | null, "final_checkpoint": bool,
"error": str | null, "wall_time": float, "host": str, "pid": int}``. ``checkpoint`` is the
newest committed checkpoint (a prefix relative to the log directory); ``final_checkpoint``
tells whether it is at ``step``, the step the session stopped at.

TF name: none.
"""

from __future__ import annotations

import json
import os
import posixpath
import socket
from dataclasses import asdict, dataclass
from typing import Any

from torchsupervisor import errors
from torchsupervisor.storage import Storage, is_url

__all__ = [
    "END",
    "ERROR",
    "PREEMPTION",
    "STOP_RECORD",
    "StopRecord",
    "clear_stop_record",
    "read_stop_record",
    "write_stop_record",
]

STOP_RECORD = "last_stop.json"
"""The record's file name in the log directory."""

PREEMPTION = "preemption"
"""``reason``: a preemption signal stopped the session."""
END = "end"
"""``reason``: the session ended cleanly otherwise (its loop ended, end of input)."""
ERROR = "error"
"""``reason``: the session ended with an error."""

_MAX_RECORD_BYTES = 64 << 10


@dataclass(frozen=True)
class StopRecord:
    """How a session ended (see the module docstring for the fields).

    TF name: none.
    """

    reason: str
    signal: str | None
    step: int | None
    checkpoint: str | None
    final_checkpoint: bool
    error: str | None
    wall_time: float
    host: str = ""
    pid: int = 0

    @property
    def requeue(self) -> bool:
        """True for a preemption whose final checkpoint committed: nothing is lost."""
        return self.reason == PREEMPTION and self.final_checkpoint

    def describe(self) -> str:
        """One line saying how the session ended."""
        where = f" at step {self.step}" if self.step is not None else ""
        if self.reason == PREEMPTION:
            head = f"stopped by {self.signal}{where}"
        elif self.reason == END:
            head = f"ended cleanly{where}"
        else:
            head = f"failed{where}: {self.error}"
        if self.checkpoint is None:
            tail = "no checkpoint committed"
        elif self.final_checkpoint:
            tail = f"its final checkpoint {self.checkpoint} committed"
        else:
            tail = f"the newest committed checkpoint is {self.checkpoint}"
        return f"The last session {head}; {tail}"


def _path(logdir: str) -> str:
    join = posixpath.join if is_url(logdir) else os.path.join
    return join(logdir, STOP_RECORD)


def write_stop_record(
    storage: Storage,
    logdir: str,
    *,
    reason: str,
    signal: str | None,
    step: int | None,
    checkpoint: str | None,
    error: str | None,
    wall_time: float,
) -> StopRecord:
    """Write the record of a session that ended (atomically: one put).

    Args:
        storage: The storage of ``logdir``.
        logdir: The log directory.
        reason: ``PREEMPTION``, ``END`` or ``ERROR``.
        signal: The preemption signal's name, or None.
        step: The step the session stopped at, or None.
        checkpoint: The prefix of the newest committed checkpoint (made relative to
            ``logdir`` here), or None.
        error: ``"<ErrorType>: <message>"`` of an ``ERROR``, or None.
        wall_time: Seconds since the epoch.

    Returns:
        The record written.

    Raises:
        OSError: If it cannot be written.
    """
    name = None
    if checkpoint is not None:
        name = (
            posixpath.basename(checkpoint) if is_url(checkpoint) else os.path.basename(checkpoint)
        )
    final = name is not None and step is not None and name.endswith(f"-{step}")
    record = StopRecord(
        reason=reason,
        signal=signal,
        step=step,
        checkpoint=name,
        final_checkpoint=final,
        error=error,
        wall_time=wall_time,
        host=socket.gethostname(),
        pid=os.getpid(),
    )
    data = json.dumps(asdict(record), indent=1).encode("utf-8") + b"\n"
    storage.put(_path(logdir), [data])
    return record


def clear_stop_record(storage: Storage, logdir: str) -> None:
    """Remove the record (a session starts: until it ends, there is none).

    Raises:
        OSError: If it exists and cannot be removed.
    """
    path = _path(logdir)
    if storage.exists(path):
        storage.delete(path)


def read_stop_record(storage: Storage, logdir: str) -> StopRecord | None:
    """Return the record of the log directory's last session, or None if there is none.

    Raises:
        DataLossError: The record is damaged (not the JSON above), naming the file.
        OSError: If it cannot be read.
    """
    path = _path(logdir)
    if not storage.exists(path):
        return None
    data = storage.read_bytes(path, max_bytes=_MAX_RECORD_BYTES)
    try:
        fields: dict[str, Any] = json.loads(data.decode("utf-8"))
        return StopRecord(**fields)
    except (ValueError, TypeError) as e:
        raise errors.DataLossError(None, None, f"Damaged stop record {path}: {e}") from None
