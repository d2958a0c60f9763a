"""The goodput ledger's files: append-only, CRC-checked records of where a run's time went.

Every process of a run (every rank, every restart, every requeue) appends to a file of its own
in ``<logdir>/goodput/``, named ``ledger.<10-digit start seconds>.<host>.<pid>.<n>.r<rank>``
(``n`` counts the ledgers this process opened: a second Supervisor on the same logdir). A
record is a small JSON object in TFRecord framing (``records.py``: length, masked CRC-32C of
the length, payload, masked CRC-32C of the payload), the container TensorBoard's events files
use, so a torn or damaged record is detected: a file is read up to its first bad record, and
what follows is never trusted (a process killed while appending leaves a torn last record).

The records (``"k"``: kind; wall times ``"t"``, ``"s"``, ``"e"`` are seconds since the epoch):

* ``start``: the process's identity and its start-up: ``rank``, ``world``, ``host``, ``pid``,
  ``run`` (the run id), ``attempt`` (the launcher's restart count), ``job``, ``launched``
  (when the process was created), ``imported`` (when ``torchsupervisor`` finished importing).
* ``interval``: time the run spent on one thing, ``c`` (cause) from ``s`` to ``e``:
  ``rendezvous``, ``restore`` (or ``init``: a fresh start), ``final`` (the final checkpoint
  and the close, after a stop), ``preemption`` (the same after a preemption), and those a user
  marks (``eval``, anything).
* ``resume``: the session is ready at ``step`` (restored from tier ``tier``; None: a fresh
  start).
* ``progress`` (every few seconds, and at the end): ``step`` then, and ``acc``, the seconds
  accumulated in this process by the causes counted piecewise (``checkpoint``: the training
  thread's snapshots at step boundaries; ``data``: waits for input).
* ``end``: a clean end at ``step``, with ``reason`` (``end``, ``preemption``, ``error``).

TF name: none (TF 1 had no goodput ledger).
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import posixpath
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torchsupervisor import errors
from torchsupervisor.storage import Appendable, is_url, storage_for
from torchsupervisor.summary.records import encode_record, iter_records_with_offsets

__all__ = [
    "LEDGER_DIR",
    "LedgerFile",
    "LedgerWriter",
    "ledger_dir",
    "read_ledgers",
]

logger = logging.getLogger("torchsupervisor")

LEDGER_DIR = "goodput"
"""The subdirectory of the log directory that holds the ledger files."""

_PREFIX = "ledger."
_opened = itertools.count()  # Ledgers this process opened (in their names).
_MAX_LEDGER_BYTES = 64 << 20  # A ledger takes kilobytes a day; more than this is not one.


def ledger_dir(logdir: str) -> str:
    """``<logdir>/goodput`` (a URL's with ``/``)."""
    join = posixpath.join if is_url(logdir) else os.path.join
    return join(logdir, LEDGER_DIR)


class LedgerWriter:
    """Appends records to this process's ledger file (created at the first record).

    Args:
        logdir: The run's log directory (a path or a URL).
        rank: This process's rank.
        start_secs: This process's start, seconds since the epoch (in the file's name).

    Thread safety: ``append`` and ``sync`` from any thread (a lock orders them).

    TF name: none.
    """

    def __init__(self, logdir: str, rank: int, start_secs: float) -> None:
        import threading

        directory = ledger_dir(logdir)
        host = socket.gethostname().split(".")[0] or "host"
        seq = next(_opened)
        name = f"{_PREFIX}{int(start_secs):010d}.{host}.{os.getpid()}.{seq}.r{rank}"
        self.path = (
            posixpath.join(directory, name) if is_url(logdir) else os.path.join(directory, name)
        )
        self._directory = directory
        self._file: Appendable | None = None
        self._lock = threading.Lock()
        self._closed = False

    def append(self, kind: str, **fields: Any) -> None:
        """Append one record ``{"k": kind, **fields}`` (written to the OS at once).

        Raises:
            OSError: The file could not be created or written.
        """
        payload = json.dumps({"k": kind, **fields}, separators=(",", ":")).encode()
        with self._lock:
            if self._closed:
                return
            if self._file is None:
                storage = storage_for(self.path)
                storage.makedirs(self._directory)
                self._file = storage.open_append(self.path)
            self._file.write(encode_record(payload))

    def sync(self) -> None:
        """Make what was appended durable (an fsync; on an object store, an upload).

        Raises:
            OSError: It could not be.
        """
        with self._lock:
            if self._file is not None and not self._closed:
                self._file.sync()

    def close(self) -> None:
        """Sync and close (further appends do nothing).

        Raises:
            OSError: The last sync failed.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            file, self._file = self._file, None
        if file is not None:
            try:
                file.sync()
            finally:
                file.close()


@dataclass
class LedgerFile:
    """One process's ledger, as read back.

    Attributes:
        path: The file.
        records: Its records in order, up to the first damaged one.
        damaged: Why reading stopped early (a torn last record: the process was killed while
            appending), or None.
    """

    path: str
    records: list[dict[str, Any]] = field(default_factory=list)
    damaged: str | None = None

    def first(self, kind: str) -> dict[str, Any] | None:
        return next((r for r in self.records if r.get("k") == kind), None)

    def last(self, kind: str) -> dict[str, Any] | None:
        return next((r for r in reversed(self.records) if r.get("k") == kind), None)

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("k") == kind]


def _read(path: str) -> LedgerFile:
    ledger = LedgerFile(path)
    storage = storage_for(path)
    readable = storage.open_read(path)
    if readable.size is not None and readable.size > _MAX_LEDGER_BYTES:
        ledger.damaged = f"{readable.size} bytes: more than a ledger holds"
        readable.close()
        return ledger
    with io.BufferedReader(readable.stream()) as f:
        try:
            for _offset, payload in iter_records_with_offsets(f, path, readable.size):
                record = json.loads(payload)
                if not isinstance(record, dict) or not isinstance(record.get("k"), str):
                    raise ValueError("not a ledger record")
                ledger.records.append(record)
        except (errors.DataLossError, ValueError) as e:
            ledger.damaged = str(e)
    return ledger


def read_ledgers(logdir: str) -> list[LedgerFile]:
    """Every ledger file of ``logdir`` (none: an empty list), each read up to its first
    damaged record (a torn last record is ignored, with a DEBUG line; damage before the end,
    with a WARNING).

    Raises:
        OSError: The directory could not be listed.
    """
    directory = ledger_dir(logdir)
    storage = storage_for(directory)
    try:
        names = storage.list(directory)
    except FileNotFoundError:
        return []
    ledgers = []
    join = posixpath.join if is_url(directory) else os.path.join
    for name in sorted(n for n in names if n.startswith(_PREFIX)):
        try:
            ledger = _read(join(directory, name))
        except FileNotFoundError:
            continue
        if ledger.damaged is not None:
            logger.debug("Ledger %s read up to a damaged record: %s", ledger.path, ledger.damaged)
        ledgers.append(ledger)
    return ledgers


def iter_kinds(ledger: LedgerFile, *kinds: str) -> Iterator[dict[str, Any]]:
    """The records of ``ledger`` of the given kinds, in order."""
    return (r for r in ledger.records if r.get("k") in kinds)
