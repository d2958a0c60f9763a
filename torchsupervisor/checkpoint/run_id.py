"""The run's identity: a random id kept in its log directory, the same across every restart.

A log directory holds one run, however often it is restarted or requeued. The chief writes
``<logdir>/run_id`` (32 hex digits and a newline) when it first prepares a session there and
reads it back at every restart. What lives outside the log directory and belongs to the run
(the memory tier's snapshots on a tmpfs) is tagged with it: a log directory removed and made
again is a new run, and the snapshots of the old one are never restored into it.

TF name: none.
"""

from __future__ import annotations

import os
import posixpath
import re
import uuid

from torchsupervisor.storage import BY_PATH, Storage, is_url, storage_for

__all__ = ["RUN_ID_FILENAME", "ensure_run_id", "read_run_id"]

RUN_ID_FILENAME = "run_id"
"""The file of the log directory that holds the run id."""

_RUN_ID = re.compile(r"[0-9a-f]{32}\Z")
_MAX_BYTES = 256


def read_run_id(logdir: str, *, storage: Storage = BY_PATH) -> str | None:
    """The run id kept in ``logdir``; None if there is none or it is not a run id.

    Raises:
        OSError: The file exists but cannot be read.
    """
    store = storage_for(logdir, storage)
    try:
        text = (
            store.read_bytes(_path(logdir), max_bytes=_MAX_BYTES).decode("ascii", "replace").strip()
        )
    except FileNotFoundError:
        return None
    return text if _RUN_ID.match(text) else None


def ensure_run_id(logdir: str, *, storage: Storage = BY_PATH) -> str:
    """The run id kept in ``logdir``, written first if there is none (the chief's call).

    A file that holds something else than a run id is replaced, with a new id.

    Raises:
        OSError: It cannot be read or written.
    """
    found = read_run_id(logdir, storage=storage)
    if found is not None:
        return found
    run_id = uuid.uuid4().hex
    storage_for(logdir, storage).put(_path(logdir), [f"{run_id}\n".encode("ascii")])
    return run_id


def _path(logdir: str) -> str:
    join = posixpath.join if is_url(logdir) else os.path.join
    return join(logdir, RUN_ID_FILENAME)
