"""The goodput recorder: what one process writes to the run's ledger (``summary/ledger.py``).

The Supervisor (every rank) and a MonitoredSession (its chief) hold one per process and tell
it where the time went::

    open_recorder(logdir)                  # the start record, as preparing the session begins
    session_ready(started, sess, ...)      # the restore (or init) interval, resume
      ... training: a thread appends a progress record every ``progress_secs`` ...
    interval("eval")                       # a user's marked interval (context manager)
    finish(step, reason, stopping_since)   # the final interval, a last progress, end

On the chief, each progress record also writes the run's goodput so far to TensorBoard
(``goodput/goodput``, ``badput/<cause>``: shares of the wall time, at the current step), from
the earlier processes' ledgers (read once) and this one's records.

The training thread pays nothing per step for it but one store: the session's ``GlobalStep``
mirrors its value into a mapped file (``<logdir>/goodput/heartbeat.r<rank>``, a local logdir
only), so that the next process knows exactly the step a killed one reached (``start``'s
``before``) and the steps lost are exact; the recorder's thread writes beside it, every
``ALIVE_SECS``, the time and the badput counted piecewise so far (``before_alive``, when a
killed process was last alive, and ``before_acc``: what it counted after its last progress
record is not lost with it). The seconds the training thread spent at step boundaries (the
snapshots of checkpoints and of the memory tier: ``StepBoundary.busy_secs``) are its
``checkpoint`` badput; its waits for batches of a ``ResumableDataLoader`` (``core/waits.py``),
its ``data`` badput. A ledger that cannot be
written is logged once and given up: it never stops training.

TF name: none (TF 1 had no goodput ledger).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

from torchsupervisor.checkpoint.run_id import read_run_id
from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.waits import INPUT_WAITS
from torchsupervisor.storage import LocalStorage, is_url, storage_for
from torchsupervisor.summary.ledger import LedgerWriter, ledger_dir

__all__ = [
    "DEFAULT_PROGRESS_SECS",
    "GoodputRecorder",
    "badput_interval",
    "open_recorder",
    "process_start_time",
]

logger = logging.getLogger("torchsupervisor")

DEFAULT_PROGRESS_SECS = 10.0
"""How often a process appends a progress record (and syncs its ledger)."""

_process_start_taken = False  # The first recorder of a process starts at its creation.
_rendezvous_taken = False  # The process group's rendezvous is in a ledger already.
# The step (the GlobalStep's mirror), the time alive, the checkpoint and data badput so far.
_HEARTBEAT = struct.Struct("<qddd")
_ALIVE = struct.Struct("<ddd")
ALIVE_SECS = 0.25
"""How often the recorder's thread writes the time into the heartbeat."""
IMPORTED_AT = time.time()  # When this module (imported with the package) was loaded.


def process_start_time() -> float:
    """When this process was created, in seconds since the epoch.

    On Linux from ``/proc/self/stat``'s start time (clock ticks since boot, 10 ms) against
    ``CLOCK_BOOTTIME``: psutil's ``create_time`` adds the boot time in whole seconds, up to a
    second off. Elsewhere psutil's; without it, the package's import.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # Field 22 of stat(5); the split starts at field 3.
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, IndexError, ValueError, AttributeError):
        pass
    try:
        import psutil

        return float(psutil.Process(os.getpid()).create_time())
    except Exception:  # psutil missing, or its answer unreadable: the import is the best known.
        return IMPORTED_AT


def _heartbeat(logdir: str, rank: int) -> tuple[LocalStorage, str] | None:
    """Where the heartbeat of ``rank`` lives, and its storage: a local logdir's only."""
    storage = None if is_url(logdir) else storage_for(logdir)
    if not isinstance(storage, LocalStorage):
        return None
    return storage, os.path.join(ledger_dir(logdir), f"heartbeat.r{rank}")


def read_heartbeat(logdir: str, rank: int) -> tuple[int, float, dict[str, float]] | None:
    """The step the previous process of ``rank`` reached, when it was last alive (wall
    seconds) and the badput it had counted piecewise, from its heartbeat; None: none."""
    where = _heartbeat(logdir, rank)
    if where is None:
        return None
    storage, path = where
    try:
        data = storage.read_bytes(path, max_bytes=_HEARTBEAT.size)
    except OSError:  # None yet; not a regular file (never read from a FIFO).
        return None
    if len(data) != _HEARTBEAT.size:
        return None
    step, alive, checkpoint, data_secs = _HEARTBEAT.unpack(data)
    return step, alive, {"checkpoint": checkpoint, "data": data_secs}


class GoodputRecorder:
    """Writes this process's ledger (module docstring).

    Args:
        logdir: The run's log directory.
        rank: This process's rank; world: the number of ranks.
        clock: Wall time (``time``) and the progress thread's waits.
        progress_secs: Seconds between two progress records.

    Thread safety: ``interval``, ``add`` and the progress thread may run together; the
    others from the training thread.

    TF name: none.
    """

    def __init__(
        self,
        logdir: str,
        rank: int,
        world: int,
        *,
        clock: Clock | None = None,
        progress_secs: float = DEFAULT_PROGRESS_SECS,
    ) -> None:
        self.logdir = logdir
        self.rank = rank
        self.world = world
        self._clock = clock or REAL_CLOCK
        self._progress_secs = progress_secs
        global _process_start_taken
        # The first recorder of a process counts from the process's creation; another one
        # (a second Supervisor in the same process) from its own.
        self.launched = self._clock.time() if _process_start_taken else process_start_time()
        _process_start_taken = True
        self._writer = LedgerWriter(logdir, rank, self.launched)
        self.path = self._writer.path
        """This process's ledger file."""
        self._lock = threading.Lock()
        self._acc: dict[str, float] = {}
        self._failed = False
        self._started = False
        self._global_step: Any = None
        self._boundary: Any = None
        self._heartbeat: tuple[mmap.mmap, memoryview] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # This process's records, for the scalars: the report needs the last progress record
        # only, so each new one replaces the one before (a days-long run keeps a few).
        self._records: list[dict[str, Any]] = []
        self._earlier: list[Any] | None = None  # The other ledgers of the run (read once).
        self.summary_writer: Any = None
        """Where the chief writes the ``goodput/*`` and ``badput/*`` scalars; None: nowhere."""

    # -------------------------------------------------------------------------- writing

    def _append(self, kind: str, **fields: Any) -> None:
        if self._failed:
            return
        if kind == "progress" and self._records and self._records[-1]["k"] == "progress":
            self._records.pop()
        self._records.append({"k": kind, **fields})
        try:
            self._writer.append(kind, **fields)
        except Exception as e:  # Never stops training: an OSError, a store's error.
            self._failed = True
            logger.warning("The goodput ledger %s cannot be written: %s", self._writer.path, e)

    def _sync(self) -> None:
        if self._failed:
            return
        try:
            self._writer.sync()
        except Exception as e:  # Never stops training: an OSError, a store's error.
            self._failed = True
            logger.warning("The goodput ledger %s cannot be written: %s", self._writer.path, e)

    # -------------------------------------------------------------------------- the session

    def begin(self, attempt: int = 0, job: str | None = None) -> None:
        """The start record (once): this process, its creation and import, and the step the
        process before it of this rank reached (its heartbeat)."""
        if self._started:
            return
        self._started = True
        before = read_heartbeat(self.logdir, self.rank)
        self._append(
            "start",
            t=self._clock.time(),
            rank=self.rank,
            world=self.world,
            host=socket.gethostname(),
            pid=os.getpid(),
            attempt=attempt,
            job=job,
            launched=self.launched,
            imported=IMPORTED_AT,
            before=before[0] if before else None,
            before_alive=before[1] if before else None,
            before_acc=before[2] if before else None,
        )
        self._sync()

    def session_ready(
        self,
        started: float,
        sess: Any,
        step: int | None,
        global_step: Any,
    ) -> None:
        """A session is ready: its restore (or init) interval and the resume record (with the
        run id of the log directory); then the heartbeat and the progress thread.

        Args:
            started: When preparing the session began (wall seconds); it ends now.
            sess: The session (its ``restored_checkpoint``, ``restored_tier``, ``boundary``).
            step: The step it is ready at (None: no global step).
            global_step: The session's ``GlobalStep`` (mirrored into the heartbeat), if any.
        """
        ready = self._clock.time()
        restored = getattr(sess, "restored_checkpoint", None)
        boundary = getattr(sess, "boundary", None)
        try:
            run_id = read_run_id(self.logdir)
        except Exception:  # Not readable now: the ledger says nothing of it.
            run_id = None
        self.begin()
        cause = "restore" if restored is not None else "init"
        tier = getattr(sess, "restored_tier", None) if restored is not None else None
        self._record_rendezvous()
        self._append("interval", c=cause, s=started, e=ready)
        self._append("resume", t=ready, step=step, tier=tier, run=run_id)
        self._sync()
        self._global_step = global_step
        self._boundary = boundary
        self._busy_at_ready = getattr(boundary, "busy_secs", 0.0)
        self._data_at_ready = INPUT_WAITS.secs
        self._attach_heartbeat(global_step)
        if self._thread is None and self._progress_secs > 0:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="torchsupervisor-goodput", daemon=True
            )
            self._thread.start()

    def _record_rendezvous(self) -> None:
        """The interval ``distributed.connect`` formed the process group in, once per process
        (before or while preparing the session: the report takes it out of either)."""
        global _rendezvous_taken
        from torchsupervisor.distributed.env import joined_at

        joined = joined_at()
        if _rendezvous_taken or joined is None or joined[0] < self.launched:
            return
        _rendezvous_taken = True
        self._append("interval", c="rendezvous", s=joined[0], e=joined[1])

    def _attach_heartbeat(self, global_step: Any) -> None:
        where = _heartbeat(self.logdir, self.rank)
        if where is None or not callable(getattr(global_step, "mirror_to", None)):
            return
        storage, path = where
        try:
            mapped = storage.open_mapped(path, _HEARTBEAT.size)
        except OSError as e:
            logger.debug("No goodput heartbeat at %s: %s", path, e)
            return
        view = memoryview(mapped)[:8].cast("q")
        _HEARTBEAT.pack_into(mapped, 0, 0, self._clock.time(), 0.0, 0.0)
        self._heartbeat = (mapped, view)
        global_step.mirror_to(view)

    def _detach_heartbeat(self) -> None:
        with self._lock:
            heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is None:
            return
        mapped, view = heartbeat
        if self._global_step is not None:
            self._global_step.mirror_to(None)
        view.release()
        mapped.close()

    # -------------------------------------------------------------------------- while training

    def add(self, cause: str, secs: float) -> None:
        """Count ``secs`` more of badput ``cause`` (``"data"``, ...) in the progress records."""
        with self._lock:
            self._acc[cause] = self._acc.get(cause, 0.0) + secs

    @contextlib.contextmanager
    def interval(self, cause: str) -> Iterator[None]:
        """Record the time the block takes as badput ``cause`` (``"eval"``, anything)."""
        started = self._clock.time()
        try:
            yield
        finally:
            self._append("interval", c=cause, s=started, e=self._clock.time())

    def _step(self) -> int | None:
        value = getattr(self._global_step, "value", None)
        return value if isinstance(value, int) else None

    def _accumulated(self) -> dict[str, float]:
        """The badput counted piecewise since the session was ready, by cause."""
        with self._lock:
            acc = dict(self._acc)
        if self._boundary is not None:
            acc["checkpoint"] = self._boundary.busy_secs - self._busy_at_ready
            acc["data"] = INPUT_WAITS.secs - self._data_at_ready
        return acc

    def progress(self) -> None:
        """Append a progress record now (the step, the accumulated badput) and sync."""
        acc = self._accumulated()
        step = self._step()
        self._append("progress", t=self._clock.time(), step=step, acc=acc)
        self._sync()
        if self.summary_writer is not None:
            self._write_scalars(step)

    def _write_scalars(self, step: int | None) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        from torchsupervisor.summary.goodput_report import goodput_report
        from torchsupervisor.summary.ledger import LedgerFile, read_ledgers

        try:
            if self._earlier is None:
                self._earlier = [
                    ledger for ledger in read_ledgers(self.logdir) if ledger.path != self.path
                ]
            own = LedgerFile(self.path, list(self._records))
            report = goodput_report([*self._earlier, own], rank=self.rank)
        except Exception as e:  # A ledger it cannot read: no scalars, training goes on.
            logger.debug("No goodput scalars: %s", e)
            return
        if report.wall <= 0:
            return
        values = [Summary.Value(tag="goodput/goodput", simple_value=report.goodput)]
        values += [  # The causes that took time (not a dozen flat lines of zeros).
            Summary.Value(tag=f"badput/{cause}", simple_value=report.badput(cause))
            for cause, secs in report.causes.items()
            if secs > 0
        ]
        self.summary_writer.add_summary(Summary(value=values), step)

    def _alive(self) -> None:
        acc = self._accumulated()
        with self._lock:  # Not while the heartbeat is being unmapped.
            heartbeat = self._heartbeat
            if heartbeat is not None:
                _ALIVE.pack_into(
                    heartbeat[0],
                    8,
                    self._clock.time(),
                    acc.get("checkpoint", 0.0),
                    acc.get("data", 0.0),
                )

    def _run(self) -> None:
        next_progress = self._clock.monotonic() + self._progress_secs
        while not self._clock.wait(self._stop, ALIVE_SECS):
            self._alive()
            if self._clock.monotonic() >= next_progress:
                next_progress += self._progress_secs
                self.progress()

    # -------------------------------------------------------------------------- the end

    def stop_progress(self, timeout_secs: float = 10.0) -> None:
        """Stop the progress thread; wait up to ``timeout_secs`` for it (a sync in progress)."""
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None:
            thread.join(timeout_secs)

    def abandon(self) -> None:
        """No time is left for the last records: stop the thread and the heartbeat, write
        nothing more (the file reads as a killed process's would)."""
        self._failed = True
        self.stop_progress(0.0)
        self._detach_heartbeat()

    def finish(self, step: int | None, reason: str, stopping_since: float | None) -> None:
        """The session ended: its final interval (``preemption`` after one, else ``final``)
        from ``stopping_since``, a last progress record, the end record; then close."""
        self.stop_progress()
        now = self._clock.time()
        if stopping_since is not None:
            cause = "preemption" if reason == "preemption" else "final"
            self._append("interval", c=cause, s=stopping_since, e=now)
        if self._started:
            self.progress()
            self._append("end", t=now, step=step, reason=reason)
        self._detach_heartbeat()
        self.close()

    def close(self) -> None:
        """Stop the progress thread and close the ledger (no end record: see ``finish``)."""
        self.stop_progress()
        self._detach_heartbeat()
        try:
            self._writer.close()
        except Exception as e:  # Never stops training: an OSError, a store's error.
            if not self._failed:
                logger.warning("The goodput ledger %s cannot be written: %s", self._writer.path, e)


def open_recorder(logdir: str, *, clock: Clock | None = None) -> GoodputRecorder:
    """This process's recorder of ``logdir``'s ledger, its start record written: its rank and
    the world's size from the process group or the launcher, and the launcher's restart count
    and job id.

    TF name: none.
    """
    from torchsupervisor.distributed import env as distributed
    from torchsupervisor.distributed.launcher import current_launcher

    launcher = current_launcher()
    recorder = GoodputRecorder(logdir, distributed.rank(), distributed.world_size(), clock=clock)
    recorder.begin(launcher.restart_count, launcher.job_id)
    return recorder


@contextlib.contextmanager
def badput_interval(recorder: GoodputRecorder | None, cause: str) -> Iterator[None]:
    """The block's time as badput ``cause`` in ``recorder``'s ledger; without a recorder,
    only the block (``Supervisor.badput``, ``MonitoredSession.badput``).

    Raises:
        TypeError: ``cause`` is not a non-empty string.

    TF name: none.
    """
    from torchsupervisor.core.checks import check_str

    check_str("cause", cause, allow_empty=False)
    if recorder is None:
        yield
        return
    with recorder.interval(cause):
        yield
