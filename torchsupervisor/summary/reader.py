"""Read the events of one events file back as ``Event`` protos.

TF name: ``tf.compat.v1.train.summary_iterator``.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator

from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2

from torchsupervisor import errors
from torchsupervisor.storage import storage_for
from torchsupervisor.summary import records

__all__ = ["summary_iterator"]


def summary_iterator(path: str | os.PathLike[str]) -> Iterator[event_pb2.Event]:
    """Yield every record of one events file as an ``Event``, in file order.

    The first event is the ``file_version`` record. Reading is lazy: the file is opened at the
    first ``next()`` and closed when the iterator is exhausted or closed.

    Args:
        path: The events file.

    Yields:
        ``event_pb2.Event`` protos.

    Raises:
        DataLossError: A record is truncated, fails its checksum, or is not an ``Event``; the
            message names the file and the byte offset of the record.
        OSError: The file cannot be opened, or is not a regular file (a FIFO, a device:
            ``storage.NotRegularFileError``, raised before anything is read).

    TF name: ``tf.compat.v1.train.summary_iterator``.
    """
    name = os.fspath(path)
    readable = storage_for(name).open_read(name)  # Never a FIFO.
    with io.BufferedReader(readable.stream()) as f:
        for offset, payload in records.iter_records_with_offsets(f, name, readable.size):
            try:
                event = event_pb2.Event.FromString(payload)
            except DecodeError as e:
                raise errors.DataLossError(
                    f"record at byte offset {offset} in {name} is not a valid Event proto: {e}"
                ) from e
            yield event
