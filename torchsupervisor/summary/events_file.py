"""An events file: its name, its first record, its creation through the storage seam.

Files are named ``<logdir>/events.out.tfevents.<10-digit seconds>.<hostname><suffix>`` and
created exclusively; a taken name moves to the next second, so names stay in time order (as
TensorBoard reads a run's files). The first record is ``Event(file_version="brain.Event:2")``.

TF name: the C++ ``EventsWriter``'s file naming.
"""

from __future__ import annotations

import errno
import os
import socket

from tensorboard.compat.proto import event_pb2

from torchsupervisor.core.clock import Clock
from torchsupervisor.storage import Appendable, Storage
from torchsupervisor.summary import records

__all__ = ["FILE_VERSION", "create_events_file"]

FILE_VERSION = "brain.Event:2"
"""The ``file_version`` of the first record of every events file."""

_HOSTNAME: str | None = None
_MAX_NAME_PROBES = 100_000


def _hostname() -> str:
    global _HOSTNAME
    if _HOSTNAME is None:
        _HOSTNAME = socket.gethostname()
    return _HOSTNAME


def create_events_file(
    storage: Storage, logdir: str, suffix: str, clock: Clock
) -> tuple[Appendable, str, bytes]:
    """Create a new events file in ``logdir`` (created if missing).

    Returns:
        The file (to append to), its path, and its first record (framed; to be written
        before the first batch).

    Raises:
        OSError: It could not be created (``FileExistsError`` after 100,000 taken names).
    """
    host = _hostname()
    storage.makedirs(logdir)
    seconds = int(clock.time())
    for _ in range(_MAX_NAME_PROBES):
        path = os.path.join(logdir, f"events.out.tfevents.{seconds:010d}.{host}{suffix}")
        try:
            file = storage.open_append(path)
            break
        except FileExistsError:
            seconds += 1  # same second as another file: keep names in time order
    else:
        raise FileExistsError(
            errno.EEXIST, f"{_MAX_NAME_PROBES} consecutive event file names exist", path
        )
    first = event_pb2.Event(wall_time=float(seconds), file_version=FILE_VERSION)
    return file, path, records.encode_record(first.SerializeToString())
