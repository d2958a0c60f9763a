"""``SummaryWriter``: TF's ``FileWriter`` API; callers only enqueue, a thread writes the file.

``add_scalar`` and friends check their arguments, snapshot the value (a float, or a copy of a
tensor that stays on its device: ``snapshot.py``) with the wall time and step, and append one
item (``queue_items.py``) to the queue of the current ``EventFileWriter`` (``event_file.py``),
whose thread encodes the items, writes them to the events file and flushes it::

    caller: add_*() -> check, snapshot -> EventFileWriter.put -> return
    thread: ItemEncoder (encoders/, scalar_event.py) -> records.py -> events file

``close()`` drains and stops that thread; ``reopen()`` starts a new one, with a new file.

TF names: ``tf.compat.v1.summary.FileWriter``, ``tf.summary.FileWriter`` (TF 1.x); plus the
``add_scalar``/``add_histogram``/... methods of ``torch.utils.tensorboard.SummaryWriter``.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2, summary_pb2

from torchsupervisor import errors
from torchsupervisor.core.checks import check_int, check_number, check_path, check_str
from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.registry import USE_DEFAULT
from torchsupervisor.storage import Storage, storage_for
from torchsupervisor.summary.counters import WriterCounters
from torchsupervisor.summary.event_file import (
    BLOCK,
    DROP,
    WRITE_DELAY_SECS,
    EventFileWriter,
)
from torchsupervisor.summary.media import MediaMethods, check_tag
from torchsupervisor.summary.queue_items import (
    RAW_EVENT,
    SUMMARY_EVENT,
    Item,
    ItemEncoder,
    queued_bytes,
)
from torchsupervisor.summary.restarts import PendingRestart
from torchsupervisor.summary.snapshot import (
    INT64_MAX,
    INT64_MIN,
    snapshot_scalar,
    snapshot_step,
)

__all__ = [
    "DEFAULT_MAX_QUEUE_BYTES",
    "SERVICE_MAX_QUEUE",
    "FileWriter",
    "SummaryWriter",
    "write_start",
]

DEFAULT_MAX_QUEUE_BYTES = 64 << 20
"""The default bound on the memory that queued histograms, images, ... may hold (64 MiB)."""

DEFAULT_MAX_QUEUE = 16384
"""``max_queue`` when it is left to its default (``USE_DEFAULT``), and of the writers
torchsupervisor creates itself (the Supervisor's, the ``SummaryWriterCache``'s, the hooks'):
TF's default of 10 makes a loop that adds several values per step wait for the writer thread
at almost every call, 7-9 us instead of about 1 (``docs/performance.md``). Scalars queued up
to this bound hold about 2 MB; ``max_queue_bytes`` bounds everything else."""

SERVICE_MAX_QUEUE = DEFAULT_MAX_QUEUE
"""The same bound under its earlier name."""

logger = logging.getLogger("torchsupervisor")

_CLOSED_WARNING = (
    "Attempting to use a closed FileWriter. The operation will be a noop unless the "
    "FileWriter is explicitly reopened."
)

if TYPE_CHECKING:
    from torchsupervisor.core.global_step import GlobalStepLike
    from torchsupervisor.core.session import SessionLike


def _stop_current(holder: list[EventFileWriter]) -> None:
    """Finalizer of a collected writer: let its thread finish and close the file."""
    holder[0].request_close()


class SummaryWriter(MediaMethods):
    """Write summaries and session logs to an events file in ``logdir``, in the background.

    The events file ``events.out.tfevents.<seconds>.<hostname><filename_suffix>`` is created at
    the first event. If a file of that name already exists (two writers started in the same
    second), the next second whose name is free is used, so that the lexicographic order of the
    files (which TensorBoard reads them in) stays their creation order; the first record
    (``file_version="brain.Event:2"``) carries the same whole second as the name.

    Every ``add_*`` method only enqueues: it checks its arguments, copies the value without
    synchronizing with its device (a Python float, or a tensor copy that the writer thread
    reads later) and appends it to a queue. A writer thread takes everything pending at once,
    converts tensors to numbers, encodes the events (runs of scalars with numpy, see
    ``scalar_batch.py``), frames them with a C CRC-32C and writes the batch with one write
    call, in the order the events were added. The file is fsync'ed at its first batch, then
    when ``flush_secs`` have passed since the last flush, at ``flush()`` and
    ``request_flush()`` (asked for at every checkpoint snapshot) and at ``close()``.
    Events are handed to the operating system within ``write_delay_secs`` (0.25 s) of being
    added, so TensorBoard sees them at its next reload, and a killed process (even by
    ``SIGKILL``) loses only the events still in the queue.

    The queue is bounded: at most ``max_queue`` events wait for the writer thread, holding at
    most ``max_queue_bytes`` of tensor copies and protos. When it is full, ``on_full``
    decides: ``"block"`` (TF's behaviour, the default) makes the caller wait until the writer
    thread has taken the pending events; ``"drop"`` discards the new event.
    Both are counted (``counters()``: ``blocked_calls``, ``blocked_secs``, ``events_dropped``)
    and reported in the log: a warning at the first drop and then at most once a minute, and a
    summary when the file is closed.

    Unlike TF, ``max_queue`` left to its default allows ``DEFAULT_MAX_QUEUE`` (16384) events,
    about 2 MB of scalars (``max_queue_bytes`` bounds the rest): with TF's 10, a loop adding
    several values per step waits for the writer thread at almost every call (7-9 us a call
    instead of about 1). An explicit ``max_queue`` means what TF documents: ``max_queue=10``
    gives TF's behaviour.

    A write error is logged with the file name; the events of that batch are lost and the next
    event opens a new file (as TF's re-initialization). Encoding errors (e.g. a NaN in a
    histogram) are logged and the event is dropped, since they are found on the writer thread.

    After ``close()``, ``add_*`` calls are no-ops that log TF's warning; ``reopen()`` starts
    again with a new file. ``with SummaryWriter(...) as w:`` closes on exit. Writers still open
    at interpreter exit are drained and closed.

    Args:
        logdir: The directory for the events file; created if missing.
        graph: Ignored. Accepted so that TF code (``FileWriter(logdir, sess.graph)``) runs;
            eager PyTorch has no graph, so no graph or meta-graph event is written. Likewise
            ``add_graph``, ``add_meta_graph`` and ``add_run_metadata`` have no counterpart.
        max_queue: The number of events that may wait for the writer thread (one more per
            producer thread racing for the last place); 0 means unbounded; ``USE_DEFAULT``
            (the default): ``DEFAULT_MAX_QUEUE`` (16384; TF's default is 10).
        flush_secs: Seconds between two flushes (fsync) of the file (>= 0).
        graph_def: Ignored, as ``graph`` (TF's deprecated argument).
        filename_suffix: Appended to the file name (``None`` means nothing).
        session: Ignored (TF's ``tf.summary.FileWriter`` could wrap a session's writer).
        on_full: What an ``add_*`` call does when the queue is full: ``"block"`` (wait for
            room) or ``"drop"`` (discard the event).
        max_queue_bytes: The memory that pending histograms, images, audio, text and protos
            may hold (their tensor copies: device memory for a tensor left on its device);
            the queue is also full when an event would exceed it (an event larger than it is
            accepted alone). Scalars are bounded by ``max_queue`` only. 0: no bound.
        clock: The clock for wall times, file names, the flush timer and the blocked-time
            counter; ``None`` means the real clock.
        storage: Where the events files go (tests inject faults here); ``None``: chosen by
            ``logdir``.

    Raises:
        ValueError: ``on_full`` is neither ``"block"`` nor ``"drop"``; ``max_queue``,
            ``max_queue_bytes`` or ``flush_secs`` is negative (naming it and the value).
        TypeError: ``logdir`` is not a path, ``max_queue`` not an integer, ``flush_secs``
            not a number (naming it and the value).

    Thread safety: every method may be called from any thread. Events added by one thread are
    written in the order they were added. Events added while another thread runs ``close()``
    may be written or lost (as in TF).

    Distributed: not rank-aware; create it on one process (the Supervisor does so on the chief
    only). Writers of several processes may share a log directory: file names never collide
    (exclusive create), and TensorBoard reads the files as one run, in name order.

    TF name: ``tf.compat.v1.summary.FileWriter`` (alias ``FileWriter``); the ``add_scalar`` ...
    ``add_text`` methods follow ``torch.utils.tensorboard.SummaryWriter``.
    """

    close_timeout_secs: float = 120.0
    """How long ``close()`` waits for the writer thread to finish writing."""

    write_delay_secs: float = WRITE_DELAY_SECS
    """How long pending events may wait for more before the writer thread writes them together
    (at most; ``max_queue // 2`` or 4096 pending events, a flush and a close write at once, and a
    new file's first events are written and flushed at once)."""

    thread_niceness: int = 0
    """CPU priority (``nice``) of the writer thread, on Linux; 0: the same as the caller's.
    Measured in ``benchmarks/summaries.py`` (``docs/performance.md``): with heavy summaries
    (100 scalars and a histogram every 10 steps) nice 19 gave more steps/s and a lower p99 step
    time than 0 on the 2-core machine, at a higher cost per ``add_*`` call (the queue fills
    while the writer waits for a core); with light summaries the default is as good. Set it
    on a subclass (``class W(SummaryWriter): thread_niceness = 19``)."""

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        graph: Any = None,
        max_queue: Any = USE_DEFAULT,
        flush_secs: float = 120,
        graph_def: Any = None,
        filename_suffix: str | None = None,
        session: SessionLike | None = None,
        *,
        on_full: str = BLOCK,
        max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
        clock: Clock | None = None,
        storage: Storage | None = None,
    ) -> None:
        del graph, graph_def, session  # no graphs in eager PyTorch (see the class docstring)
        if on_full not in (BLOCK, DROP):
            raise ValueError(f"on_full must be 'block' or 'drop', got {on_full!r}")
        logdir = check_path("logdir", logdir, allow_none=False)
        if max_queue is USE_DEFAULT:
            max_queue = DEFAULT_MAX_QUEUE
        max_queue = check_int("max_queue", max_queue)
        flush_secs = check_number("flush_secs", flush_secs)
        check_str("filename_suffix", filename_suffix, allow_none=True)
        max_queue_bytes = check_int("max_queue_bytes", max_queue_bytes)
        self._logdir = os.fspath(logdir)
        self._storage = storage_for(self._logdir, storage)
        self._storage.makedirs(self._logdir)
        self._max_queue = int(max_queue)
        self._flush_secs = float(flush_secs)
        self._suffix = filename_suffix or ""
        self._on_full = on_full
        self._max_queue_bytes = int(max_queue_bytes)
        self._clock = REAL_CLOCK if clock is None else clock
        self._now = self._clock.time
        self._seen_tags: set[str] = set()
        self._state_lock = threading.Lock()
        self._past = WriterCounters()  # counters of the files closed before a reopen()
        self._holder = [self._new_worker()]  # the finalizer's reference (not to self)
        self._worker = self._holder[0]  # the same, one lookup less for add_scalar
        self._finalizer = weakref.finalize(self, _stop_current, self._holder)

    def _new_worker(self) -> EventFileWriter:
        worker = EventFileWriter(
            self._logdir,
            self._suffix,
            self._max_queue,
            self._flush_secs,
            self._clock,
            ItemEncoder(self._logdir, self._seen_tags),
            on_full=self._on_full,
            max_bytes=self._max_queue_bytes,
            niceness=self.thread_niceness,
            write_delay_secs=self.write_delay_secs,
            storage=self._storage,
        )
        worker.start()
        return worker

    def __repr__(self) -> str:
        state = "closed" if self._holder[0].closed else "open"
        return f"SummaryWriter(logdir={self._logdir!r}, {state})"

    # -- TF API ------------------------------------------------------------------------------

    def get_logdir(self) -> str:
        """Return the directory the events files are written to.

        TF name: ``FileWriter.get_logdir``.
        """
        return self._logdir

    def _put(self, item: object) -> None:
        if not self._holder[0].put(item, queued_bytes(item)):
            logger.warning(_CLOSED_WARNING)

    def _wall_time(self, walltime: float | None) -> float:
        return self._clock.time() if walltime is None else float(walltime)

    def add_event(self, event: event_pb2.Event) -> None:
        """Enqueue an ``Event`` exactly as given (a copy; wall time and step untouched).

        Args:
            event: An ``event_pb2.Event``.

        Raises:
            TypeError: ``event`` is not an ``Event``.

        Thread safety: may be called from any thread.

        TF name: ``FileWriter.add_event``.
        """
        if not isinstance(event, event_pb2.Event):
            raise TypeError(f"event must be an event_pb2.Event, got {type(event).__name__}")
        copy = event_pb2.Event()
        copy.CopyFrom(event)
        self._put(Item((RAW_EVENT, copy, None)))

    def add_summary(
        self, summary: summary_pb2.Summary | bytes, global_step: GlobalStepLike | None = None
    ) -> None:
        """Enqueue a ``Summary`` as an event with the current wall time.

        For each value carrying ``metadata``, only the first occurrence of its tag in this
        writer keeps the metadata (TensorBoard needs it once per tag).

        Args:
            summary: A ``Summary`` proto (copied) or its serialized bytes.
            global_step: The step (an int, a one-element tensor or anything ``int()`` accepts);
                ``None`` leaves the event's step unset.

        Raises:
            TypeError: ``summary`` is neither a ``Summary`` nor bytes.
            InvalidArgumentError: ``summary`` bytes do not parse as a ``Summary``.

        Thread safety: may be called from any thread.

        TF name: ``FileWriter.add_summary``.
        """
        if isinstance(summary, (bytes, bytearray, memoryview)):
            try:
                parsed = summary_pb2.Summary.FromString(bytes(summary))
            except DecodeError as e:
                raise errors.InvalidArgumentError(
                    f"summary: could not parse {len(summary)} bytes as a Summary proto: {e}"
                ) from e
        elif isinstance(summary, summary_pb2.Summary):
            parsed = summary
        else:
            raise TypeError(
                f"summary must be a Summary proto or its serialized bytes, got "
                f"{type(summary).__name__}"
            )
        event = event_pb2.Event(wall_time=self._clock.time(), summary=parsed)
        self._put(Item((SUMMARY_EVENT, event, snapshot_step(global_step))))

    def add_session_log(
        self,
        session_log: event_pb2.SessionLog,
        global_step: GlobalStepLike | None = None,
        *,
        restored_step: int | None = None,
    ) -> None:
        """Enqueue a ``SessionLog`` (START, STOP, CHECKPOINT) as an event.

        A ``START`` that is the first thing this writer writes marks a restart: the session
        resumed at ``restored_step``. TensorBoard's legacy loader purges the points at and
        after a START's step, its default loader does not; so the writer removes from the
        directory's other events files (not those of this process's writers) what the
        earlier sessions logged after the restored step, and the earlier points at the
        restored step of the tags this session logs there again. That happens on the writer
        thread once this session logs a summary past the restored step (or at ``close()``);
        then the restart is recorded at the restored step: a text summary
        ``torchsupervisor/restart`` and a scalar ``torchsupervisor/steps_lost`` (the steps
        logged but not checkpointed). See ``summary/restarts.py`` for the rule.

        Args:
            session_log: A ``SessionLog`` proto (copied).
            global_step: The step; ``None`` leaves it unset. The Supervisor and
                ``SummarySaverHook`` write START at the first step the session produces
                (``restored_step + 1``), so that the legacy loader's purge keeps the points
                the restored checkpoint stands behind.
            restored_step: For a START, the step the session resumed at; None: the START's
                own step (TF's placement).

        Raises:
            TypeError: ``session_log`` is not a ``SessionLog``.

        Thread safety: may be called from any thread.

        TF name: ``FileWriter.add_session_log``.
        """
        if not isinstance(session_log, event_pb2.SessionLog):
            raise TypeError(
                f"session_log must be an event_pb2.SessionLog, got {type(session_log).__name__}"
            )
        event = event_pb2.Event(wall_time=self._clock.time(), session_log=session_log)
        step = snapshot_step(global_step)
        worker = self._holder[0]
        # A restart is a START before this writer wrote anything (a START in the middle of a
        # writer's own stream is not); files of this process's writers are never touched.
        fresh = worker.path is None and worker.file is None and not worker.queue
        if session_log.status == event_pb2.SessionLog.START and isinstance(step, int) and fresh:
            restored = (
                step
                if restored_step is None
                else check_int("restored_step", restored_step, minimum=None)
            )
            worker.restart = PendingRestart(
                self._storage, self._logdir, restored, worker.open_paths, self._clock.time
            )
        self._put(Item((RAW_EVENT, event, step)))

    def flush(self) -> None:
        """Block until every event added before this call is written and flushed to disk.

        A no-op on a closed writer (``close()`` already flushed).

        Thread safety: may be called from any thread.

        TF name: ``FileWriter.flush``.
        """
        self._holder[0].flush()

    def request_flush(self) -> threading.Event:
        """Ask for the events added so far to be written and flushed to disk; do not wait.

        The writer thread writes and fsyncs the file as soon as it has written every event
        added before this call. The ``CheckpointDriver`` calls it when it takes a snapshot
        and has the checkpoint wait for it before it commits, so that the summaries of the
        steps up to a checkpoint are on disk before the checkpoint is (a run killed then
        resumes with every point it stands behind). On a closed writer the returned event is
        set at once.

        Returns:
            A ``threading.Event`` set once those events are written and flushed.

        Thread safety: may be called from any thread (it never blocks, not even on a full
        queue).

        TF name: none.
        """
        return self._holder[0].request_flush()

    def counters(self) -> WriterCounters:
        """Return what this writer has done so far (since it was created, over reopens).

        Returns:
            A ``WriterCounters``: events written, pending, dropped (``on_full="drop"``) and
            lost (encoding or write errors), calls that blocked on a full queue and for how
            long, bytes written, write calls and fsyncs.

        Thread safety: may be called from any thread; the values are read without stopping
            the writer thread, so they may be a few events apart from each other.

        TF name: none.
        """
        with self._state_lock:
            return self._past + self._holder[0].counters()

    def close(self, timeout_secs: float | None = None) -> None:
        """Write every pending event, flush and close the file, and stop the writer thread.

        Idempotent. Waits at most ``close_timeout_secs`` for the thread, or ``timeout_secs``
        if shorter (a stop within a preemption's grace period), then logs a warning naming
        what is left: on an object store the events file is kept in the local spool, and the
        next writer of the log directory (the next run) uploads it. Logs a warning if events
        were dropped for a full queue, and (at INFO) how often callers waited for room in it.

        Args:
            timeout_secs: The longest wait in seconds; None: ``close_timeout_secs``.

        Thread safety: may be called from any thread.

        TF name: ``FileWriter.close`` (without ``timeout_secs``).
        """
        with self._state_lock:
            worker = self._holder[0]
            first = worker.request_close()
        if worker.thread is threading.current_thread():
            return
        wait = self.close_timeout_secs
        if timeout_secs is not None:
            wait = min(wait, max(0.0, timeout_secs))
        worker.thread.join(wait)
        if worker.thread.is_alive():
            worker.abandoned = True  # Not waited for again at exit.
            kept = getattr(worker.file, "spool_path", None)
            if kept:
                tail = f"its file is kept in {kept} and the next run on {self._logdir} uploads it"
            else:
                tail = "events still pending may be lost"
            logger.warning(
                "The summary writer for %s did not finish within %.1f s (%s): %s",
                self._logdir,
                wait,
                worker.path,
                tail,
            )
        elif first:
            self._report(worker.counters())

    def _report(self, counters: WriterCounters) -> None:
        if counters.events_dropped:
            logger.warning(
                "%d summary events for %s were dropped because the queue was full "
                "(max_queue=%d, on_full='drop')",
                counters.events_dropped,
                self._logdir,
                self._max_queue,
            )
        if counters.blocked_calls:
            logger.info(
                "Summary calls for %s waited %d times (%.3f s in total) for room in the full "
                "queue (max_queue=%d)",
                self._logdir,
                counters.blocked_calls,
                counters.blocked_secs,
                self._max_queue,
            )

    def reopen(self) -> None:
        """Accept events again after ``close()``; the next event goes to a new file.

        A no-op if the writer is open.

        Thread safety: may be called from any thread.

        TF name: ``FileWriter.reopen``.
        """
        with self._state_lock:
            if self._holder[0].closed:
                self._past = self._past + self._holder[0].counters()
                self._holder[0] = self._worker = self._new_worker()

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- torch.utils.tensorboard API (enqueue only) ------------------------------------------

    def add_scalar(
        self,
        tag: str,
        scalar_value: object,
        global_step: GlobalStepLike | None = None,
        walltime: float | None = None,
    ) -> None:
        """Enqueue one scalar; no host/device synchronisation on the calling thread.

        This is the hot path (0.5 to 1.1 microseconds with a float and an int step on the
        2-core benchmark machine, 1.6 with a 0-d CPU tensor, when the queue has room: see
        ``docs/performance.md``): no proto is built here, the value is appended to the queue
        as a tuple.

        Args:
            tag: The tag (used as is).
            scalar_value: A Python number, a numpy scalar, or a one-element tensor. A CPU tensor
                is read now; a tensor on another device is copied there (asynchronously) and
                read on the writer thread.
            global_step: The step; ``None`` leaves it unset.
            walltime: The event's wall time in seconds since the epoch; ``None`` means now.

        Raises:
            TypeError: ``tag`` is not a str; ``global_step`` is not an integer.
            ValueError: ``global_step`` is outside the int64 range.
            InvalidArgumentError: ``scalar_value`` has more or fewer than one element, or is
                not a real number (a string, None, a complex number).

        Thread safety: may be called from any thread.

        TF name: none (``torch.utils.tensorboard.SummaryWriter.add_scalar``).
        """
        if type(tag) is not str:
            check_tag(tag)
        if type(scalar_value) is not float:
            scalar_value = snapshot_scalar(tag, scalar_value)
        if global_step is None:
            global_step = 0  # the proto omits step 0: the same bytes as no step
        elif type(global_step) is not int or not INT64_MIN <= global_step <= INT64_MAX:
            global_step = snapshot_step(global_step)
        item = (
            self._now() if walltime is None else float(walltime),
            global_step,
            tag,
            scalar_value,
        )
        # Inlined fast path of EventFileWriter.put (called on every training step).
        worker = self._worker
        queue = worker.queue
        if len(queue) < worker.wake_at:
            queue.append(item)
            if worker.idle:
                worker.wake()
        elif not worker.put(item):
            logger.warning(_CLOSED_WARNING)


FileWriter = SummaryWriter
"""TF 1's name for ``SummaryWriter``."""


def write_start(writer: Any, restored_step: int | None, step: int | None = None) -> None:
    """Write the ``SessionLog.START`` of a session that resumed at ``restored_step``.

    Args:
        writer: A ``SummaryWriter``, or a writer of the user's with TF's
            ``add_session_log(session_log, global_step)``.
        restored_step: The step the session resumed at (0 for a fresh start).
        step: The START's step; None: ``restored_step + 1``, the first step the session
            produces (``summary/restarts.py``: the legacy loader's purge at START then keeps
            every point the restored checkpoint stands behind).

    TF name: none (TF's Supervisor wrote START at the current step, ``SummarySaverHook``
    after the first step).
    """
    if step is None:
        step = None if restored_step is None else restored_step + 1
    start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
    if isinstance(writer, SummaryWriter):
        writer.add_session_log(start, step, restored_step=restored_step)
    else:
        writer.add_session_log(start, step)
