"""A restart in the events files: the lost segment removed, the restart recorded.

**Which step a summary belongs to.** A summary logged at step ``s`` describes the run after
``s`` training steps: the loss of the ``s``-th step, logged right after ``optimizer.step()``
with ``step.value`` (a ``GlobalStep`` bound to the optimizer has counted it already), or an
evaluation of the state a checkpoint at ``s`` holds. So a checkpoint at step ``N`` stands
behind every summary at steps ``<= N``, and the resumed session's first step logs ``N + 1``.

A run killed at step 230 whose newest checkpoint is step 200 resumes at 200: the events it
logged for steps 201-230 describe a state that no longer exists, and the resumed run logs
those steps again. TensorBoard is meant to drop them when it reads ``SessionLog.START``, but
its default loader ignores START, and its out-of-order purge works per tag, when the tag is
logged again: a rarely logged tag (an evaluation every 1000 steps) would keep the lost
segment's points for good. So a restart removes them itself:

* every events file of the log directory that no writer of this process has open loses its
  events of later steps (summaries, log messages, ``START``, ``CHECKPOINT``); events without
  a step (the file version, ``STOP``) and everything up to the restored step stay;
* a tag that the resumed session logs again *at the restored step* replaces the earlier
  sessions' point there (a loop that labels a step's loss with the step count *before* it, or
  the Supervisor's summary service, whose first run summarizes the restored state): every
  step shows once under either labelling.

The second rule needs to know what the resumed session logs at the restored step, so the
removal is settled on the writer thread (``PendingRestart``) once the session has logged a
summary past the restored step, or when its writer closes. Then the restart is recorded at the
restored step: a text summary (``torchsupervisor/restart``) and a scalar
(``torchsupervisor/steps_lost``: logged steps that were not checkpointed, 0 after a clean
stop), so each restart shows in TensorBoard. A process killed before that leaves the older
files as they were; the next restart removes what they hold past its own restored step.

A file is replaced by one atomic put of its filtered copy, and only when something is
removed; one that cannot be read or rewritten is logged and left as it is. Files that another
*process* is appending to (an evaluator sharing the directory) cannot be told apart from a
dead run's: write such summaries to a directory of their own (TF's ``logdir/eval``), as TF
programs do.

TF name: none (TF relied on TensorBoard's purge at ``START``).
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import posixpath
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2

from torchsupervisor import errors
from torchsupervisor.storage import Storage, is_url
from torchsupervisor.summary.queue_items import RAW_EVENT, SUMMARY_EVENT, TEXT, Item
from torchsupervisor.summary.records import encode_record, iter_records_with_offsets
from torchsupervisor.summary.snapshot import resolve_step

__all__ = ["RESTART_TAG", "STEPS_LOST_TAG", "LostSegment", "PendingRestart", "drop_lost_segment"]

logger = logging.getLogger("torchsupervisor")

RESTART_TAG = "torchsupervisor/restart"
"""The text summary that records a restart, at the restored step."""

STEPS_LOST_TAG = "torchsupervisor/steps_lost"
"""The scalar that records how many logged steps a restart lost, at the restored step."""

_COPY_CHUNK_BYTES = 8 << 20


@dataclass
class LostSegment:
    """What earlier sessions logged beyond the restored step, and what was done about it.

    Attributes:
        restored_step: The step training resumes at.
        earlier: The log directory held events of earlier sessions (a restart, not a fresh
            start; an events file holding only its file version does not count).
        last_step: The highest step the earlier sessions logged a summary at; None: no
            earlier summaries.
        events_dropped: Events removed (those of later steps); an event at the restored step
            that lost only some of its values counts too.
        points_replaced: Summary values at the restored step removed because the resumed
            session logged their tags there again.
        files: The events files rewritten.

    TF name: none.
    """

    restored_step: int
    earlier: bool = False
    last_step: int | None = None
    events_dropped: int = 0
    points_replaced: int = 0
    files: list[str] = field(default_factory=list)

    @property
    def steps_lost(self) -> int:
        """Logged steps that were not checkpointed (``last_step - restored_step``, >= 0)."""
        if self.last_step is None:
            return 0
        return max(0, self.last_step - self.restored_step)

    def describe(self) -> str:
        """The restart as one sentence (the text summary)."""
        if self.steps_lost == 0:
            text = f"Resumed at step {self.restored_step}; no logged step was lost."
        else:
            text = (
                f"Resumed at step {self.restored_step} after a stop at step {self.last_step}: "
                f"{self.steps_lost} logged steps were not checkpointed and are trained again "
                f"({self.events_dropped} events after step {self.restored_step} removed)."
            )
        if self.points_replaced == 1:
            text += f" 1 point at step {self.restored_step} was logged again and replaced."
        elif self.points_replaced:
            text += (
                f" {self.points_replaced} points at step {self.restored_step} were logged "
                "again and replaced."
            )
        return text


def _join(directory: str, name: str) -> str:
    return posixpath.join(directory, name) if is_url(directory) else os.path.join(directory, name)


def drop_lost_segment(
    storage: Storage,
    logdir: str,
    restored_step: int,
    open_paths: set[str],
    relogged: Iterable[str] = (),
) -> LostSegment:
    """Remove the events after ``restored_step`` from the events files of ``logdir``.

    Args:
        storage: The storage of ``logdir``.
        logdir: The log directory (its own files only, not subdirectories).
        restored_step: The step training resumes at.
        open_paths: Events files that writers of this process have open (left alone).
        relogged: Tags the resumed session logged at ``restored_step``: their earlier points
            at that step are removed too.

    Returns:
        A ``LostSegment``.

    A file that cannot be read or rewritten is logged and left as it is (the restart goes on:
    TensorBoard may then show its stale points). A damaged record ends the reading of its
    file; the rewritten copy keeps what came before it.

    TF name: none.
    """
    found = LostSegment(restored_step)
    relogged = frozenset(relogged)
    try:
        names = sorted(n for n in storage.list(logdir) if ".tfevents." in n)
    except (OSError, errors.OpError):
        return found
    for name in names:
        path = _join(logdir, name)
        if path in open_paths:
            continue
        try:
            _prune(storage, path, restored_step, relogged, found)
        except (OSError, errors.OpError) as e:
            logger.warning("Could not remove the lost segment from %s: %s", path, e)
    return found


def _prune(
    storage: Storage, path: str, restored_step: int, relogged: frozenset[str], found: LostSegment
) -> None:
    """Scan ``path``; replace it by a filtered copy if anything is to be removed."""
    first_change: int | None = None  # Offset of the first record removed or changed.
    tail: list[bytes] = []  # From there: the records to keep, as they are to be written.
    dropped = replaced = 0
    readable = storage.open_read(path)
    try:
        raw = readable.stream()  # Kept: closing (or collecting) it closes ``readable``.
        f = io.BufferedReader(raw)
        try:
            for offset, data in iter_records_with_offsets(f, path, readable.size):
                event = event_pb2.Event.FromString(data)
                found.earlier = found.earlier or not event.HasField("file_version")
                if event.HasField("summary") and (
                    found.last_step is None or event.step > found.last_step
                ):
                    found.last_step = event.step
                kept, removed = _filtered(event, data, restored_step, relogged)
                if kept is data and first_change is None:
                    continue
                if first_change is None:
                    first_change = offset
                if kept is None and not removed:
                    dropped += 1  # An event after the restored step.
                replaced += removed
                if kept is not None:
                    tail.append(kept)
        except (errors.DataLossError, DecodeError):
            pass  # A torn or damaged last record (a killed writer): keep what came before.
        finally:
            f.detach()  # The file stays open: the copy is read from it below.
        if first_change is None:  # Nothing to remove (a clean stop, or a fresh directory).
            return
        # Streamed: the copy is read from the old file while it is written (one atomic put).
        storage.put(
            path,
            itertools.chain(
                _prefix_chunks(readable, first_change), (encode_record(d) for d in tail)
            ),
        )
    finally:
        readable.close()
    found.events_dropped += dropped
    found.points_replaced += replaced
    found.files.append(path)


def _filtered(
    event: event_pb2.Event, data: bytes, restored_step: int, relogged: frozenset[str]
) -> tuple[bytes | None, int]:
    """Return ``(kept, points removed)``: ``data`` itself if the event stays as it is, None if
    it goes, or its re-encoding without the values of ``relogged`` tags."""
    if event.step > restored_step:
        if event.HasField("summary") or event.HasField("log_message"):
            return None, 0
        if event.HasField("session_log") and event.session_log.status in (
            event_pb2.SessionLog.START,
            event_pb2.SessionLog.CHECKPOINT,
        ):
            return None, 0
        return data, 0  # STOP and the file version carry no step worth removing.
    if event.step != restored_step or not relogged or not event.HasField("summary"):
        return data, 0
    values = event.summary.value
    keep = [v for v in values if v.tag not in relogged]
    removed = len(values) - len(keep)
    if not removed:
        return data, 0
    if not keep:
        return None, removed
    del values[:]
    values.extend(keep)
    return event.SerializeToString(), removed


def _prefix_chunks(readable: object, size: int) -> Iterator[bytes]:
    offset = 0
    while offset < size:
        view = memoryview(bytearray(min(_COPY_CHUNK_BYTES, size - offset)))
        n = readable.readinto(view, offset)  # type: ignore[attr-defined]
        if n <= 0:
            raise OSError(f"unexpected end of file after {offset} bytes")
        yield bytes(view[:n])
        offset += n


class PendingRestart:
    """A restart whose removal waits for the resumed session to pass the restored step.

    Created by ``SummaryWriter.add_session_log`` for a ``START`` that opens a writer; owned by
    that writer's thread, which shows it every batch before writing it (``observe``) and
    settles it at close (``settle``). Settling removes the lost segment from the other events
    files (``drop_lost_segment``, with the tags the session logged at the restored step) and
    returns the items that record the restart.

    Args:
        storage: The storage of ``logdir``.
        logdir: The log directory.
        restored_step: The step the session resumed at.
        open_paths: Returns the events files that writers of this process have open, at the
            time of settling (this writer's own file among them).
        clock_time: Returns the wall time for the restart's events (seconds since the epoch).

    Thread safety: used by one writer thread only.

    TF name: none.
    """

    def __init__(
        self,
        storage: Storage,
        logdir: str,
        restored_step: int,
        open_paths: Callable[[], set[str]],
        clock_time: Callable[[], float],
    ) -> None:
        self.storage = storage
        self.logdir = logdir
        self.restored_step = restored_step
        self._open_paths = open_paths
        self._time = clock_time
        self.relogged: set[str] = set()
        self.result: LostSegment | None = None

    def observe(self, batch: Sequence[Any]) -> list[Any] | None:
        """Note the tags ``batch`` logs at the restored step; settle once it logs past it.

        Returns:
            The items recording the restart, to be written after ``batch``, once settled;
            None while the session has not logged a summary past the restored step.
        """
        restored = self.restored_step
        past = False
        for item in batch:
            for step, tags in _summaries(item):
                if step == restored:
                    self.relogged.update(tags)
                elif step > restored:
                    past = True
        return self.settle() if past else None

    def settle(self) -> list[Any]:
        """Remove the lost segment now; return the items recording the restart.

        Returns:
            A text and a scalar at the restored step, or nothing when the log directory held
            no events of earlier sessions (a fresh start).
        """
        lost = drop_lost_segment(
            self.storage, self.logdir, self.restored_step, self._open_paths(), self.relogged
        )
        self.result = lost
        if not lost.earlier:  # A fresh start, not a restart.
            return []
        logger.info("%s", lost.describe())
        wall = self._time()
        step = self.restored_step
        return [
            Item((TEXT, wall, step, RESTART_TAG, lost.describe(), None)),
            (wall, step, STEPS_LOST_TAG, float(lost.steps_lost)),
        ]


def _summaries(item: object) -> Iterator[tuple[int, Sequence[str]]]:
    """Yield ``(step, tags)`` for the summary a queued item carries (nothing for others)."""
    if type(item) is tuple:  # A scalar: (wall, step, tag, value).
        step = _step(item[1])
        if step is not None:
            yield step, (item[2],)
        return
    if type(item) is not Item:
        return  # A queue marker.
    kind = item[0]
    if kind in (SUMMARY_EVENT, RAW_EVENT):
        _, event, step = item
        if not event.HasField("summary"):
            return
        step = event.step if step is None else _step(step)
        if step is not None:
            yield step, [v.tag for v in event.summary.value]
        return
    step = _step(item[2])
    if step is not None:
        yield step, (item[3],)


def _step(step: Any) -> int | None:
    try:
        return resolve_step(step)
    except Exception:  # A device step that cannot be read: the encoder reports it.
        return None
