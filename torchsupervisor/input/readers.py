"""TF 1's record readers, as input-pipeline ops whose position the checkpoint saves.

A reader takes file names from a queue (``string_input_producer``'s) and gives one record per
evaluation: ``key, value = reader.read(filename_queue)`` returns lazy outputs, evaluated
together by the enqueue op of a batching function, as TF's tensors were. The key is TF's
(``b"<file>:<record number>"``; the byte offset for ``TFRecordReader``; the file name for
``WholeFileReader``), the value the record's bytes; ``decode_raw`` turns bytes into a tensor.

The position is state: the file being read (taken from the queue, so no longer in the
queue's own state), the byte offset and number of the next record in it, and the counts of
records and files done. ``InputPipelineState`` finds the readers of a pipeline through its
ops and saves them with the queues, with the pipeline quiet (``gate.py``): every record a
reader gave is then in a queue or in the hands of a waiting enqueue, which the queue's state
holds. A resumed run reopens the file at the saved offset and continues with the next record:
a reader of many records per file (CIFAR-10's five files of 10,000 images) resumes exactly,
where a file read whole in a ``py_func`` would start its file again.

Files are read through the storage layer: local paths, and ``s3://``, ``gs://``, ``az://``.

TF names: ``tf.compat.v1.ReaderBase``, ``tf.compat.v1.FixedLengthRecordReader``,
``tf.compat.v1.TextLineReader``, ``tf.compat.v1.WholeFileReader``,
``tf.compat.v1.TFRecordReader``, ``tf.io.decode_raw``.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import numpy as np
import torch

from torchsupervisor.core.checks import check_int
from torchsupervisor.errors import DataLossError, OutOfRangeError
from torchsupervisor.input.ops import OpOutput, OutputTuple, evaluate, py_func
from torchsupervisor.storage import storage_for
from torchsupervisor.summary.records import iter_records_with_offsets

__all__ = [
    "FixedLengthRecordReader",
    "ReaderBase",
    "TFRecordReader",
    "TextLineReader",
    "WholeFileReader",
    "decode_raw",
]

_WHOLE_FILE_MAX_BYTES = 1 << 31


class ReaderBase:
    """What every reader shares: the work (file) queue, the position, ``read``/``read_up_to``.

    A subclass reads one record of its format from ``self._file`` (a buffered reader at the
    position ``self._offset`` of the file ``self._work``) in ``_read_record``.

    Thread safety: one evaluation at a time reads (a lock); TF's readers were used by one
    enqueue thread each, and several threads sharing a reader take turns.

    TF name: ``tf.compat.v1.ReaderBase``.
    """

    supports_serialize = True
    """TF's flag: the position can be saved (``state_dict``, ``serialize_state``)."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or type(self).__name__
        self._lock = threading.Lock()
        self._work: str | None = None  # The file being read.
        self._offset = 0  # The byte offset of its next record.
        self._index = 0  # The number of its next record (0 first).
        self._records = 0
        self._work_units = 0
        self._file: io.BufferedReader | None = None
        self._size = 0
        self._later: list[str] = []  # Files taken from the queue, not started yet.

    # -- what a format decides ----------------------------------------------------------

    def _begin(self) -> None:
        """Skip what precedes the first record of a newly opened file, if anything."""

    def _read_record(self) -> tuple[bytes, bytes] | None:
        """Read the record at ``_offset``; return ``(key, value)`` and advance, or None at
        the end of the file."""
        raise NotImplementedError

    # -- the work queue -----------------------------------------------------------------

    def _open(self) -> None:
        assert self._work is not None
        readable = storage_for(self._work).open_read(self._work)
        self._size = readable.size
        self._file = io.BufferedReader(readable.stream(self._offset), 1 << 20)

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _next(self, queue: Any) -> tuple[bytes, bytes]:
        """The next record, taking files from ``queue`` as they end.

        The lock is not held while waiting for a file name: a dequeue that waits gives the
        pipeline gate back, and a snapshot then reads this reader's position.
        """
        while True:
            with self._lock:
                if self._work is None and self._later:
                    self._start(self._later.pop(0))
                if self._work is not None:
                    if self._file is None:  # Restored: reopen where the saved run was.
                        self._open()
                    record = self._read_record()
                    if record is not None:
                        self._records += 1
                        return record
                    self._close()
                    self._work = None
                    self._work_units += 1
                    continue
            work = queue.dequeue()  # OutOfRangeError at the end of the input.
            name = work.decode() if isinstance(work, bytes) else str(work)
            with self._lock:  # Another thread may have taken a file meanwhile: kept in order.
                self._later.append(name)

    def _start(self, work: str) -> None:
        """Open ``work`` at its first record (lock held)."""
        self._work, self._offset, self._index = work, self._first_offset(), 0
        self._open()
        self._begin()

    def _first_offset(self) -> int:
        """The byte offset where a file's records start."""
        return 0

    def _key(self, position: int) -> bytes:
        return f"{self._work}:{position}".encode()

    # -- TF's API -----------------------------------------------------------------------

    def read(self, queue: Any, name: str | None = None) -> OutputTuple:
        """Return the lazy ``(key, value)`` of the next record (one record per evaluation).

        Args:
            queue: The queue of file names (``string_input_producer``'s; str or bytes).
            name: Accepted for TF's signature.

        Returns:
            Two outputs evaluated together: ``key`` (bytes) and ``value`` (the record's bytes).
            Evaluating them raises ``OutOfRangeError`` once ``queue`` is closed and every file
            is read (the end of the input).

        Raises:
            DataLossError: At evaluation, for a damaged record (``TFRecordReader``).

        TF name: ``tf.compat.v1.ReaderBase.read``.
        """
        del name
        op = _ReadOp(self, queue, None)
        return OutputTuple((OpOutput(op, 0), OpOutput(op, 1)))

    def read_up_to(self, queue: Any, num_records: int, name: str | None = None) -> OutputTuple:
        """Return the lazy ``(keys, values)`` of up to ``num_records`` records.

        Fewer only at the end of the input (never none: then ``OutOfRangeError``).

        TF name: ``tf.compat.v1.ReaderBase.read_up_to``.
        """
        del name
        op = _ReadOp(self, queue, check_int("num_records", num_records, minimum=1))
        return OutputTuple((OpOutput(op, 0), OpOutput(op, 1)))

    def num_records_produced(self) -> int:
        """The records read so far (an int, restored with the position).

        TF name: ``tf.compat.v1.ReaderBase.num_records_produced``.
        """
        with self._lock:
            return self._records

    def num_work_units_completed(self) -> int:
        """The files read to their end so far.

        TF name: ``tf.compat.v1.ReaderBase.num_work_units_completed``.
        """
        with self._lock:
            return self._work_units

    def reset(self) -> None:
        """Forget the position: the next read takes a new file from the queue.

        TF name: ``tf.compat.v1.ReaderBase.reset``.
        """
        with self._lock:
            self._close()
            self._work, self._offset, self._index, self._later = None, 0, 0, []
            self._records = self._work_units = 0

    def state_dict(self) -> dict[str, Any]:
        """Return the position: ``{"work", "offset", "index", "records", "work_units",
        "later"}`` (``later``: file names taken from the queue and not started).

        TF name: ``tf.compat.v1.ReaderBase.serialize_state`` (a dict, not TF's bytes).
        """
        with self._lock:
            return {
                "work": self._work or "",
                "offset": self._offset,
                "index": self._index,
                "records": self._records,
                "work_units": self._work_units,
                "later": list(self._later),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (the file is reopened at the next read).

        TF name: ``tf.compat.v1.ReaderBase.restore_state``.
        """
        with self._lock:
            self._close()
            self._work = str(state["work"]) or None
            self._offset = int(state["offset"])
            self._index = int(state["index"])
            self._records = int(state["records"])
            self._work_units = int(state["work_units"])
            self._later = [str(w) for w in state.get("later", [])]

    serialize_state = state_dict
    restore_state = load_state_dict


class _ReadOp:
    """The op of ``read`` (``count`` None) or ``read_up_to``; saves its reader's position."""

    def __init__(self, reader: ReaderBase, queue: Any, count: int | None) -> None:
        self._reader = reader
        self._queue = queue
        self._count = count
        self.name = f"{reader.name}_read"

    def __call__(self) -> tuple[Any, Any]:
        reader = self._reader
        if self._count is None:
            return reader._next(self._queue)
        keys: list[bytes] = []
        values: list[bytes] = []
        try:
            while len(keys) < self._count:
                key, value = reader._next(self._queue)
                keys.append(key)
                values.append(value)
        except OutOfRangeError:
            if not keys:
                raise
        return keys, values

    def state_dict(self) -> dict[str, Any]:
        """The reader's position (``InputPipelineState`` saves it with the pipeline)."""
        return self._reader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the reader's position."""
        self._reader.load_state_dict(state)


class FixedLengthRecordReader(ReaderBase):
    """Records of a fixed number of bytes, after a header and before a footer.

    A file holds ``header_bytes``, then records of ``record_bytes`` each, starting every
    ``hop_bytes`` (0: one after the other), then ``footer_bytes``; an incomplete record at the
    end is not read. Keys are ``b"<file>:<record number>"`` (0 first).

    Args:
        record_bytes: The bytes of a record (> 0).
        header_bytes, footer_bytes: Bytes to skip at the start and the end of every file.
        hop_bytes: The distance between two records' starts (0: ``record_bytes``).
        name: A name for messages.
        encoding: ``None``, ``"ZLIB"`` or ``"GZIP"`` in TF; only None here.

    Raises:
        ValueError: For a ``record_bytes`` below 1, a negative size, or an ``encoding``.

    TF name: ``tf.compat.v1.FixedLengthRecordReader``.
    """

    def __init__(
        self,
        record_bytes: int,
        header_bytes: int | None = None,
        footer_bytes: int | None = None,
        hop_bytes: int | None = None,
        name: str | None = None,
        encoding: str | None = None,
    ) -> None:
        super().__init__(name)
        self._record_bytes = check_int("record_bytes", record_bytes, minimum=1)
        self._header_bytes = check_int("header_bytes", header_bytes or 0)
        self._footer_bytes = check_int("footer_bytes", footer_bytes or 0)
        self._hop_bytes = check_int("hop_bytes", hop_bytes or 0) or self._record_bytes
        if encoding:
            raise ValueError(f"encoding {encoding!r} is not supported: store the records raw")

    def _first_offset(self) -> int:
        return self._header_bytes

    def _read_record(self) -> tuple[bytes, bytes] | None:
        assert self._file is not None
        if self._offset + self._record_bytes > self._size - self._footer_bytes:
            return None
        value = self._file.read(self._record_bytes)
        if len(value) < self._record_bytes:
            raise DataLossError(f"{self._work} ended inside record {self._index}")
        skip = self._hop_bytes - self._record_bytes
        if skip > 0:
            self._file.read(skip)
        elif skip < 0:  # Overlapping records: read the next one from its own start.
            self._close()
        key = self._key(self._index)
        self._offset += self._hop_bytes
        self._index += 1
        if self._file is None:
            self._open()
        return key, value


class TextLineReader(ReaderBase):
    """The lines of text files, without their line break.

    Keys are ``b"<file>:<line number>"`` (1 first, counting skipped lines).

    Args:
        skip_header_lines: Lines to skip at the start of every file.
        name: A name for messages.

    TF name: ``tf.compat.v1.TextLineReader``.
    """

    def __init__(self, skip_header_lines: int | None = None, name: str | None = None) -> None:
        super().__init__(name)
        self._skip = check_int("skip_header_lines", skip_header_lines or 0)

    def _line(self) -> bytes | None:
        assert self._file is not None
        line = self._file.readline()
        if not line:
            return None
        self._offset += len(line)
        self._index += 1
        return line.rstrip(b"\n").rstrip(b"\r")

    def _begin(self) -> None:
        for _ in range(self._skip):
            if self._line() is None:
                return

    def _read_record(self) -> tuple[bytes, bytes] | None:
        value = self._line()
        return None if value is None else (self._key(self._index), value)


class WholeFileReader(ReaderBase):
    """Each file whole: the key is its name, the value its bytes.

    TF name: ``tf.compat.v1.WholeFileReader``.
    """

    def _read_record(self) -> tuple[bytes, bytes] | None:
        assert self._file is not None
        if self._index:
            return None
        if self._size > _WHOLE_FILE_MAX_BYTES:
            raise DataLossError(f"{self._work} is larger than {_WHOLE_FILE_MAX_BYTES} bytes")
        value = self._file.read()
        self._offset += len(value)
        self._index = 1
        return str(self._work).encode(), value


class TFRecordReader(ReaderBase):
    """The records of TFRecord files (length, masked CRC-32C of it, data, masked CRC-32C).

    Every record's checksums are verified. Keys are ``b"<file>:<byte offset>"``.

    Args:
        name: A name for messages.
        options: TF's compression options; only None (uncompressed) here.

    Raises:
        ValueError: For compression options.

    TF name: ``tf.compat.v1.TFRecordReader``.
    """

    def __init__(self, name: str | None = None, options: object = None) -> None:
        super().__init__(name)
        if options not in (None, "", 0):
            raise ValueError(f"options {options!r} are not supported: store the records raw")
        self._records_of: Any = None

    def _open(self) -> None:
        super()._open()
        assert self._file is not None and self._work is not None
        base = self._offset
        records = iter_records_with_offsets(self._file, self._work, self._size - base)
        self._records_of = ((base + offset, data) for offset, data in records)

    def _close(self) -> None:
        self._records_of = None
        super()._close()

    def _read_record(self) -> tuple[bytes, bytes] | None:
        offset, data = next(self._records_of, (None, None))
        if offset is None:
            return None
        self._offset = offset + 16 + len(data)
        self._index += 1
        return self._key(offset), data


def _decode(value: object, out_type: torch.dtype, little_endian: bool) -> torch.Tensor:
    if isinstance(value, (list, tuple)):
        parts = [_decode(v, out_type, little_endian) for v in value]
        return torch.stack(parts) if parts else torch.empty(0, dtype=out_type)
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode_raw takes bytes, got {type(value).__name__}")
    itemsize = torch.empty((), dtype=out_type).element_size()
    if len(value) % itemsize:
        raise ValueError(
            f"Input to DecodeRaw has length {len(value)} that is not a multiple of "
            f"{itemsize}, the size of {out_type}"
        )
    if out_type == torch.bfloat16 or itemsize == 1 or little_endian == (np.little_endian):
        return torch.frombuffer(bytearray(value), dtype=out_type)
    swapped = torch.frombuffer(bytearray(value), dtype=torch.uint8).view(-1, itemsize).flip(1)
    return swapped.contiguous().view(out_type).view(-1)


def decode_raw(
    input_bytes: Any,
    out_type: torch.dtype,
    little_endian: bool = True,
    fixed_length: int | None = None,
    name: str | None = None,
) -> Any:
    """Reinterpret bytes as a 1-D tensor of ``out_type`` (a list of equal-length records: 2-D).

    Args:
        input_bytes: ``bytes`` (a reader's value as a ``py_func`` receives it), a list of
            them, or a lazy value of a pipeline (a reader's output): the result is then lazy
            too, decoded at each evaluation.
        out_type: The element type (``torch.uint8``, ``torch.float32``, ...).
        little_endian: The byte order of ``input_bytes``.
        fixed_length: TF's; a record's bytes past it are dropped.
        name: A name for messages.

    Returns:
        A tensor of ``len(input_bytes) / itemsize`` elements (own memory), or a lazy output.

    Raises:
        ValueError: If the byte count is not a multiple of the type's size (TF's text).
        TypeError: For input that is not bytes.

    TF name: ``tf.io.decode_raw`` (``tf.compat.v1.decode_raw``).
    """

    def decode(value: object) -> torch.Tensor:
        if fixed_length is not None:
            value = (
                [v[:fixed_length] for v in value]
                if isinstance(value, (list, tuple))
                else value[:fixed_length]
            )
        return _decode(value, out_type, little_endian)

    if callable(input_bytes):  # A reader's output (an OpOutput) or another lazy value.
        return py_func(decode, [input_bytes], out_type, name=name or "decode_raw")
    return decode(evaluate(input_bytes))
