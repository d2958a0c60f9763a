"""The background thread that owns one events file: queue, batches, naming, flushes, errors.

A ``SummaryWriter`` has one ``EventFileWriter`` per open (``reopen()`` starts a new one, hence
a new file). Callers append items to its queue (a ``collections.deque``: no lock on the fast
path); its thread takes everything pending as one batch, has the writer's ``BatchEncoder`` turn
it into framed records (``queue_items.py``, ``records.py``) and writes the batch with one write
call::

    caller: put(item) -> (room? append; thread asleep? wake it) -> return
    thread: take all pending -> encode + frame -> write -> fsync every flush_secs

The queue is bounded: at most ``max_queue`` items wait for the thread (plus, at most, one per
producer thread racing for the last slot). When it is full the policy decides: ``"block"``
(TF's behaviour) makes the caller wait until the thread has taken the pending items;
``"drop"`` discards the new item. Both are counted (``WriterCounters``) and reported (a
warning for drops at once and then at most every ``DROP_REPORT_SECS``; a summary at close).

Files are named ``<logdir>/events.out.tfevents.<10-digit seconds>.<hostname><suffix>`` (created
exclusively, at the first event; a taken name moves to the next second) and start with an
``Event(file_version="brain.Event:2")`` record, written with the first batch and flushed at
once. Then the file is fsynced when ``flush_secs`` have passed since the last flush, when
``flush()`` or ``request_flush()`` asks (markers in the queue, so they cover exactly the items
added before them), and at close. Where the storage advises it (``Appendable.roll_bytes``: an
object store, which uploads a file whole at each flush), a file that reached that size is
flushed and closed, and the next batch starts a new file. A failed create, write or fsync is
logged; the batch is lost and the next batch opens a new file (TF's re-initialization).
Writers still open at interpreter exit are drained and closed.

Every file operation goes through the storage seam (``Storage.open_append``; ``Appendable.write``,
``sync``, ``close``), where tests inject faults (``torchsupervisor.testing.FaultyStorage``).

TF names: ``EventFileWriter`` (and its logger thread), C++ ``EventsWriter``.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from torchsupervisor.core import thread_registry
from torchsupervisor.core import threads as priority
from torchsupervisor.core.clock import Clock
from torchsupervisor.errors import OpError
from torchsupervisor.storage import Appendable, Storage, storage_for
from torchsupervisor.summary.counters import WriterCounters
from torchsupervisor.summary.events_file import create_events_file

__all__ = [
    "BLOCK",
    "DROP",
    "DROP_REPORT_SECS",
    "WRITE_BATCH",
    "WRITE_DELAY_SECS",
    "BatchEncoder",
    "EventFileWriter",
    "live_workers",
]

logger = logging.getLogger("torchsupervisor")

BLOCK = "block"
"""Full-queue policy: the caller waits until the writer thread takes the pending events."""

DROP = "drop"
"""Full-queue policy: the new event is discarded (counted, and reported in the log)."""

DROP_REPORT_SECS = 60.0
"""After the first warning about dropped events, at most one more per this many seconds."""

WRITE_DELAY_SECS = 0.25
"""How long pending events may wait for more to share their write (a new file's first batch
and anything a flush, close or ``write_batch`` pending events ask for are written at once)."""

WRITE_BATCH = 4096
"""Pending events that make the thread write at once (or half of ``max_queue`` if smaller)."""

_UNBOUNDED = sys.maxsize


# --------------------------------------------------------------------------------------------
# The writer thread and its queue.


class BatchEncoder(Protocol):
    """What an ``EventFileWriter`` needs to turn its queued items into records."""

    errors: int

    def queued_bytes(self, item: object) -> int:
        """Return the ``nbytes`` that ``put`` counted for ``item``."""
        ...

    def encode_batch(self, batch: Sequence[Any]) -> tuple[list[Any], int]:
        """Return the framed records of ``batch`` (bytes-like chunks) and how many events."""
        ...

    def forget_batch(self) -> None:
        """Note that the events of the last batch were lost."""
        ...


class _Flush:
    """A queue marker: flush the file once everything before it is written."""

    __slots__ = ("done",)

    def __init__(self, wait: bool) -> None:
        self.done = threading.Event() if wait else None


class EventFileWriter:
    """The queue and the thread writing one events file (one per open/reopen of a writer).

    Args:
        logdir: The directory of the file (created again if it disappeared).
        suffix: Appended to the file name.
        max_queue: The number of items that may wait for the thread; 0 or less means
            unbounded.
        flush_secs: Seconds between two flushes (fsync) of the file.
        clock: For the file name's seconds, the first record's wall time and the flush timer.
        encoder: Turns batches of items into framed records.
        on_full: ``BLOCK`` or ``DROP`` (see the module docstring).
        max_bytes: The bytes of tensor copies and protos (``put``'s ``nbytes``) that may wait
            for the thread; the queue is full when one more item would exceed it (one item is
            always accepted into an empty queue). 0 or less means no byte bound.
        niceness: CPU priority of the thread as a ``nice`` value (Linux; 0: the caller's).
        write_delay_secs: How long pending items may wait for more before they are written.

    Attributes:
        queue: The pending items (callers append; only the thread takes).
        batch_at: Pending items that make the thread write without waiting for more:
            ``min(max_queue // 2, WRITE_BATCH)``, at least 1.
        wake_at: ``len(queue)`` below which a caller may append without further checks:
            ``batch_at``; once ``put`` has told the thread to write, ``max_queue`` (until the
            thread takes the items); -1 once closed. From there on, ``put`` applies the
            full-queue policy.
        idle: True while the thread sleeps with nothing pending; a caller that appended an
            item then calls ``wake()``.

    Thread safety: ``put``, ``flush``, ``request_flush``, ``request_close`` and ``counters``
    may be called from any thread; ``SummaryWriter.add_scalar`` inlines ``put``'s fast path.

    TF name: ``EventFileWriter`` with its ``EventsWriter``.
    """

    def __init__(
        self,
        logdir: str,
        suffix: str,
        max_queue: int,
        flush_secs: float,
        clock: Clock,
        encoder: BatchEncoder,
        *,
        on_full: str = BLOCK,
        max_bytes: int = 0,
        niceness: int = 0,
        write_delay_secs: float = WRITE_DELAY_SECS,
        storage: Storage | None = None,
    ) -> None:
        self.logdir = logdir
        self.storage = storage_for(logdir, storage)
        self.suffix = suffix
        self.max_queue = max_queue if max_queue > 0 else _UNBOUNDED
        self.flush_secs = flush_secs
        self.clock = clock
        self.encoder = encoder
        self.on_full = on_full
        self.max_bytes = max(0, max_bytes)
        self.niceness = niceness
        self.write_delay_secs = write_delay_secs
        self.queue: collections.deque[Any] = collections.deque()
        self.batch_at = max(1, min(self.max_queue // 2, WRITE_BATCH))
        self.wake_at = self.batch_at
        self.idle = False
        self.urgent = False  # write what is pending without waiting for more
        self.lock = threading.Lock()
        self.not_full = threading.Condition(self.lock)
        self.wake_event = threading.Event()
        # Guarded by ``lock``.
        self.closed = False  # no more items accepted
        self.exited = False  # the thread has finished (normally or not)
        self.blocked_producers = 0
        self.pending_bytes = 0  # the ``nbytes`` of the queued items
        self.dropped = 0
        self.blocked_calls = 0
        self.blocked_secs = 0.0
        self._next_drop_report = float("-inf")
        # Written by the thread only.
        self.written = 0
        self.lost = 0
        self.bytes_written = 0
        self.file_bytes = 0  # written to the current file
        self.batches = 0
        self.flushes = 0
        self.file: Appendable | None = None
        self.path: str | None = None
        self.header = b""  # the file_version record, until it is written
        self._batch: list[Any] = []  # the items being written
        # A restart to settle once the session logs past its step (``summary/restarts.py``);
        # set by the caller before it enqueues the START that opens the file.
        self.restart: object = None
        # A ``close`` that timed out gave up on this thread: the exit does not wait for it.
        self.abandoned = False
        self.unflushed = False
        self.next_flush = float("-inf")
        self.thread = threading.Thread(
            target=self._run, name=f"torchsupervisor-summary-writer:{logdir}", daemon=True
        )

    def start(self) -> None:
        """Start the thread; from then on, it is closed at interpreter exit if still open."""
        _track(self)
        self.thread.start()

    # -- caller side -------------------------------------------------------------------------

    def wake(self) -> None:
        """Wake the thread if it sleeps (after an append that found it ``idle``)."""
        self.idle = False
        self.wake_event.set()

    def put(self, item: object, nbytes: int = 0) -> bool:
        """Enqueue ``item``, applying the full-queue policy. False if closed.

        Args:
            item: The item.
            nbytes: The memory it holds (tensor copies, protos), counted against
                ``max_bytes``; 0 for a scalar.

        ``SummaryWriter.add_scalar`` inlines the case where the queue has room; keep the two
        in step.
        """
        queue = self.queue
        if not nbytes and len(queue) < self.wake_at:
            queue.append(item)
            if self.idle:
                self.wake()
            return True
        with self.lock:
            if self.closed:
                return False
            if self._full(nbytes) and threading.get_ident() != self.thread.ident:
                if self.on_full == DROP:
                    self._drop()
                    return True
                self._wait_for_room(nbytes)
                if self.closed:
                    return False
            queue.append(item)
            self.pending_bytes += nbytes
            write_now = len(queue) >= self.batch_at or (
                self.max_bytes and 2 * self.pending_bytes >= self.max_bytes
            )
            if write_now:
                # The thread is told once; callers append on the fast path until it is full.
                self.wake_at = self.max_queue
        if write_now:
            self.urgent = True
            self.wake()
        elif self.idle:
            self.wake()
        return True

    def _full(self, nbytes: int) -> bool:
        """Whether an item of ``nbytes`` must wait (caller holds ``lock``)."""
        if len(self.queue) >= self.max_queue:
            return True
        return bool(
            self.max_bytes and self.pending_bytes and self.pending_bytes + nbytes > self.max_bytes
        )

    def _drop(self) -> None:
        """Count a dropped item and report it (caller holds ``lock``)."""
        self.dropped += 1
        now = self.clock.monotonic()
        if now >= self._next_drop_report:
            self._next_drop_report = now + DROP_REPORT_SECS
            logger.warning(
                "The summary queue of %s is full (max_queue=%d, max_queue_bytes=%d): dropping "
                "events (on_full='drop'); %d dropped so far",
                self.logdir,
                self.max_queue if self.max_queue != _UNBOUNDED else 0,
                self.max_bytes,
                self.dropped,
            )

    def _wait_for_room(self, nbytes: int) -> None:
        """Block until the thread takes the pending items (caller holds ``lock``)."""
        start = self.clock.monotonic()
        self.blocked_calls += 1
        self.blocked_producers += 1  # before checking the length: the thread reads it after
        try:
            while self._full(nbytes) and not self.closed:
                self.urgent = True
                self.wake()
                self.not_full.wait()
        finally:
            self.blocked_producers -= 1
            self.blocked_secs += self.clock.monotonic() - start

    def flush(self) -> None:
        """Wait until every item added so far is written and the file flushed."""
        if threading.get_ident() == self.thread.ident:
            return
        marker = _Flush(wait=True)
        with self.lock:
            if self.exited:
                return
            self.queue.append(marker)  # markers do not count against max_queue
        self.urgent = True
        self.wake()
        assert marker.done is not None
        marker.done.wait()

    def request_flush(self) -> threading.Event:
        """Ask for a flush once every item added so far is written; do not wait for it.

        Returns:
            An event set once those items are written and the file flushed (or the thread
            has ended).
        """
        marker = _Flush(wait=True)
        assert marker.done is not None
        with self.lock:
            if self.exited:
                marker.done.set()
                return marker.done
            self.queue.append(marker)
        self.urgent = True
        self.wake()
        return marker.done

    def request_close(self) -> bool:
        """Stop accepting items and tell the thread to finish; False if already closed."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            self.wake_at = -1
            self.not_full.notify_all()
        self.wake()
        return True

    def counters(self) -> WriterCounters:
        """Return the counters of this file's thread (a consistent-enough snapshot)."""
        with self.lock:
            return WriterCounters(
                events_written=self.written,
                events_pending=sum(1 for item in list(self.queue) if type(item) is not _Flush),
                events_dropped=self.dropped,
                events_lost=self.lost + self.encoder.errors,
                blocked_calls=self.blocked_calls,
                blocked_secs=self.blocked_secs,
                bytes_written=self.bytes_written,
                batches=self.batches,
                flushes=self.flushes,
            )

    # -- writer thread -----------------------------------------------------------------------

    def _run(self) -> None:
        priority.lower(self.niceness)
        try:
            try:  # Before any restart looks at the directory's older events files.
                self.storage.recover_spooled(self.logdir)
            except (OSError, OpError, ValueError) as e:
                logger.warning("Could not upload the spooled events of %s: %s", self.logdir, e)
            self._loop()
        except BaseException:  # a bug: never leave callers blocked behind a dead thread
            logger.exception("The summary writer thread for %s failed", self.logdir)
        finally:
            self._close_file()
            with self.lock:
                self.closed = True
                self.exited = True
                self.wake_at = -1
                leftover = self._batch + list(self.queue)  # the batch a failure interrupted
                self.queue.clear()
                self.not_full.notify_all()
            for item in leftover:
                if type(item) is _Flush and item.done is not None:
                    item.done.set()

    def _loop(self) -> None:
        queue = self.queue
        while True:
            if not queue:
                if self.closed:
                    if self.restart is not None:
                        self._write_batch(self._settle_restart())
                    return
                self._sleep_until_woken()
                continue
            if self.file is not None and not self._write_now():
                self._collect()
            self.urgent = False
            with self.lock:
                if not self.closed:
                    self.wake_at = self.batch_at
            n = len(queue)
            popleft = queue.popleft
            self._batch = batch = [popleft() for _ in range(n)]
            if self.pending_bytes:
                freed = sum(self.encoder.queued_bytes(item) for item in batch)
                with self.lock:
                    self.pending_bytes -= freed
                    self.not_full.notify_all()
            elif self.blocked_producers:
                with self.lock:
                    self.not_full.notify_all()
            self._process(batch)
            self._batch = []
            if self._flush_due():
                self._flush_file()

    def _write_now(self) -> bool:
        return self.urgent or self.closed or len(self.queue) >= self.batch_at

    def _sleep_until_woken(self) -> None:
        """Nothing pending: sleep until an item arrives (or the flush timer fires)."""
        self.wake_event.clear()
        self.idle = True
        if self.queue or self.closed:  # appended before ``idle`` was visible
            self.idle = False
            return
        timeout = None
        if self.unflushed:
            timeout = max(0.0, self.next_flush - self.clock.monotonic())
        self.clock.wait(self.wake_event, timeout)
        self.idle = False
        if self._flush_due():
            self._flush_file()

    def _collect(self) -> None:
        """Let items accumulate for up to ``write_delay_secs`` (one write for many events).

        Returns early when ``batch_at`` items are pending, when a flush or close is asked for,
        and when the flush timer is due.
        """
        now = self.clock.monotonic()
        deadline = now + self.write_delay_secs
        if self.unflushed:
            deadline = min(deadline, self.next_flush)
        while True:
            self.wake_event.clear()
            if self._write_now():
                return
            remaining = deadline - self.clock.monotonic()
            if remaining <= 0:
                return
            self.clock.wait(self.wake_event, remaining)

    def _process(self, batch: list[Any]) -> None:
        """Write the items of ``batch``; at each flush marker, flush what came before it."""
        if self.restart is not None:
            try:
                recorded = self.restart.observe(batch)
            except Exception:  # a bug: the restart is not settled, the events are written
                logger.exception("Could not settle the restart in %s", self.logdir)
                self.restart, recorded = None, None
            if recorded is not None:
                self.restart = None
                batch = batch + recorded
        start = 0
        for index in [i for i, item in enumerate(batch) if type(item) is _Flush]:
            if index > start:
                self._write_batch(batch[start:index])
            start = index + 1
            self._flush_file()
            marker = batch[index]
            if marker.done is not None:
                marker.done.set()
        if start < len(batch):
            self._write_batch(batch[start:] if start else batch)

    def _settle_restart(self) -> list[Any]:
        """Settle the pending restart (at close); return the items recording it."""
        restart, self.restart = self.restart, None
        try:
            return restart.settle()
        except Exception:
            logger.exception("Could not settle the restart in %s", self.logdir)
            return []

    def open_paths(self) -> set[str]:
        """The events files that writers of this process still write to (this one's too)."""
        paths = {w.path for w in live_workers() if w.path and not w.exited}
        if self.path:
            paths.add(self.path)
        return paths

    def _flush_due(self) -> bool:
        return self.unflushed and self.clock.monotonic() >= self.next_flush

    def _write_batch(self, batch: list[Any]) -> None:
        chunks, count = self.encoder.encode_batch(batch)
        if not chunks:
            return
        if self.file is None and not self._open_file():
            logger.error("%d events for %s are lost", count, self.logdir)
            self.lost += count
            self.encoder.forget_batch()
            return
        if self.header:
            # A new file: its first record goes out in the same write as the first batch.
            chunks.insert(0, self.header)
        data = b"".join(chunks)
        try:
            self.file.write(data)
        except (OSError, OpError) as e:
            logger.error(
                "Failed to write %d events to %s: %s. The next event opens a new file.",
                count,
                self.path,
                e,
            )
            self.lost += count
            self._abandon_file()
            self.encoder.forget_batch()
            return
        self.written += count
        self.bytes_written += len(data)
        self.file_bytes += len(data)
        self.batches += 1
        self.header = b""
        self.unflushed = True  # a new file's next_flush is -inf: its first batch is flushed
        roll_bytes = self.file.roll_bytes
        if roll_bytes is not None and self.file_bytes >= roll_bytes:
            self._close_file()  # Flushed and closed: the next batch starts a new file.

    def _open_file(self) -> bool:
        """Create a new events file; True on success (failures are logged)."""
        try:
            self.file, self.path, self.header = create_events_file(
                self.storage, self.logdir, self.suffix, self.clock
            )
        except (OSError, OpError) as e:
            logger.error("Failed to create an events file in %s: %s", self.logdir, e)
            return False
        self.next_flush = float("-inf")
        self.file_bytes = 0
        logger.debug("Writing summaries to %s", self.path)
        return True

    def _flush_file(self) -> None:
        if self.file is None or not self.unflushed:
            return
        try:
            self.file.sync()
        except (OSError, OpError) as e:
            logger.error("Failed to flush %s: %s. The next event opens a new file.", self.path, e)
            self._abandon_file()
            return
        self.flushes += 1
        self.unflushed = False
        self.next_flush = self.clock.monotonic() + self.flush_secs

    def _abandon_file(self) -> None:
        file, self.file = self.file, None
        self.header = b""
        self.unflushed = False
        self.next_flush = float("-inf")
        if file is not None:
            try:
                file.close()
            except (OSError, OpError):
                pass

    def _close_file(self) -> None:
        if self.file is None:
            return
        self._flush_file()
        file, self.file = self.file, None
        if file is None:
            return
        try:
            file.close()
        except (OSError, OpError) as e:
            logger.error("Failed to close %s: %s", self.path, e)


_live_workers: weakref.WeakSet[EventFileWriter] = weakref.WeakSet()


def live_workers() -> list[EventFileWriter]:
    """The writer threads of this process that have not been closed.

    TF name: none.
    """
    return list(_live_workers)


_track_lock = threading.Lock()
_registered = False
_EXIT_JOIN_SECS = 10.0


def _close_workers_at_exit() -> None:
    """Drain and close every open writer when the interpreter exits."""
    workers = list(_live_workers)
    for worker in workers:
        worker.request_close()
    for worker in workers:
        if worker.thread.is_alive() and not worker.abandoned:
            worker.thread.join(_EXIT_JOIN_SECS)


def _track(worker: EventFileWriter) -> None:
    global _registered
    with _track_lock:
        _live_workers.add(worker)
        if not _registered:
            _registered = True
            thread_registry.register(
                "events writers", order=thread_registry.DRAIN_EVENTS, drain=_close_workers_at_exit
            )
