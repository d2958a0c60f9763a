"""A restart in the events files: the lost segment removed, the restart recorded.

A run killed at step 230 whose newest checkpoint is step 200 resumes at 200: the events it
logged for steps 201-230 describe a state that no longer exists, and the resumed run logs
those steps again. TensorBoard is meant to drop them when it reads ``SessionLog.START`` at
step 200, but its default loader ignores START (the legacy loader ignores the first one),
and its out-of-order purge works per tag, when the tag is logged again: a rarely logged tag
(an evaluation every 1000 steps) keeps the lost segment's points for good.

So at a restart the writer removes them itself: every events file of the log directory that
no writer of this process has open is read, and one holding events of the lost segment
is replaced (one atomic put) by a copy without the events of later steps and, in a file that
went past the restored step, the summaries of that step (the resumed run logs them again;
TensorBoard's purge at START removes the same). A file that ended at or before the restored
step (a clean stop) is left as it is. Events without a step (the file version, ``STOP``)
stay. Then the restart is written at the restored step: a text summary
(``torchsupervisor/restart``) and a scalar (``torchsupervisor/steps_lost``) saying how many
logged steps were lost, so each restart shows in TensorBoard.

Files that another *process* is appending to (an evaluator sharing the directory) cannot be
told apart from a dead run's: write such summaries to a directory of their own (TF's
``logdir/eval``), as TF programs do.

TF name: none (TF relied on TensorBoard's purge).
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field

from tensorboard.compat.proto import event_pb2

from torchsupervisor import errors
from torchsupervisor.storage import Storage, is_url
from torchsupervisor.summary.records import encode_record, iter_records_with_offsets

__all__ = ["LostSegment", "drop_lost_segment"]

logger = logging.getLogger("torchsupervisor")

_COPY_CHUNK_BYTES = 8 << 20


@dataclass
class LostSegment:
    """What earlier sessions logged beyond the restored step, and what was done about it.

    Attributes:
        restored_step: The step training resumes at.
        last_step: The highest step the earlier sessions logged; None: no earlier events
            (a fresh log directory).
        events_dropped: Events removed: those of later steps, and, from a file that went
            past it, the summaries of ``restored_step`` itself (the resumed run logs them
            again).
        files: The events files rewritten.
        first_step: The step whose events were removed on (the resumed run's START); None:
            ``restored_step`` (a START written before the first step, as the Supervisor's;
            TF's ``SummarySaverHook`` writes it after, at ``restored_step + 1``).

    TF name: none.
    """

    restored_step: int
    last_step: int | None = None
    events_dropped: int = 0
    files: list[str] = field(default_factory=list)
    first_step: int | None = None

    @property
    def steps_lost(self) -> int:
        """Logged steps that were not checkpointed (``last_step - restored_step``, >= 0)."""
        if self.last_step is None:
            return 0
        return max(0, self.last_step - self.restored_step)

    def describe(self) -> str:
        """The restart as one sentence (the text summary)."""
        if self.steps_lost == 0:
            return f"Resumed at step {self.restored_step}; no logged step was lost."
        return (
            f"Resumed at step {self.restored_step} after a stop at step {self.last_step}: "
            f"{self.steps_lost} steps were not checkpointed and are trained again "
            f"({self.events_dropped} events from step {self.first_step or self.restored_step} "
            "on removed)."
        )


def _join(directory: str, name: str) -> str:
    return posixpath.join(directory, name) if is_url(directory) else os.path.join(directory, name)


def drop_lost_segment(
    storage: Storage, logdir: str, restored_step: int, open_paths: set[str]
) -> LostSegment:
    """Remove the events from ``restored_step`` on from the events files of ``logdir``.

    Args:
        storage: The storage of ``logdir``.
        logdir: The log directory (its own files only, not subdirectories).
        restored_step: The step training resumes at.
        open_paths: Events files that writers of this process have open (left alone).

    Returns:
        A ``LostSegment``.

    A file that cannot be read or rewritten is logged and left as it is (the restart goes on:
    TensorBoard may then show its stale points). A damaged record ends the reading of its
    file; the rewritten copy keeps what came before it.

    TF name: none.
    """
    found = LostSegment(restored_step)
    try:
        names = sorted(n for n in storage.list(logdir) if ".tfevents." in n)
    except (OSError, errors.OpError):
        return found
    for name in names:
        path = _join(logdir, name)
        if path in open_paths:
            continue
        try:
            _prune(storage, path, restored_step, found)
        except (OSError, errors.OpError) as e:
            logger.warning("Could not remove the lost segment from %s: %s", path, e)
    return found


def _prune(storage: Storage, path: str, restored_step: int, found: LostSegment) -> None:
    """Scan ``path``; replace it by a copy without its lost segment, if it has one."""
    first_candidate: int | None = None  # Offset of the first record that may be dropped.
    tail: list[tuple[int, bytes | None]] = []  # From there: (offset, data if kept else None)
    past = False  # The file holds events of steps after the restored one.
    readable = storage.open_read(path)
    try:
        raw = readable.stream()  # Kept: closing (or collecting) it closes ``readable``.
        f = io.BufferedReader(raw)
        try:
            for offset, data in iter_records_with_offsets(f, path):
                event = event_pb2.Event.FromString(data)
                if found.last_step is None or event.step > found.last_step:
                    found.last_step = event.step
                kind = _kind(event, restored_step)
                past = past or kind == _AFTER
                if first_candidate is None and kind is None:
                    continue
                if first_candidate is None:
                    first_candidate = offset
                tail.append((offset, data if kind is None else None))
        except errors.DataLossError:
            pass  # A torn last record (a killed writer): keep what came before it.
        finally:
            f.detach()  # The file stays open: the copy is read from it below.
        if not past:  # Ended at or before the restored step (a clean stop): nothing lost.
            return
        dropped = sum(1 for _, data in tail if data is None)
        first_lost = next(offset for offset, data in tail if data is None)
        kept_after = [data for offset, data in tail if data is not None and offset > first_lost]
        # Streamed: the copy is read from the old file while it is written (one atomic put).
        storage.put(
            path,
            itertools.chain(
                _prefix_chunks(readable, first_lost), (encode_record(d) for d in kept_after)
            ),
        )
    finally:
        readable.close()
    found.events_dropped += dropped
    found.files.append(path)


_AFTER = "after"  # An event of a later step.
_AT = "at"  # A summary of the restored step.


def _kind(event: event_pb2.Event, restored_step: int) -> str | None:
    """``_AFTER`` for an event about a later step (a summary, a log message, START,
    CHECKPOINT; not the file version, nor STOP, which has no step); ``_AT`` for a summary of
    the restored step, which the resumed run logs again (dropped only from a file that went
    past it, as TensorBoard's purge at START drops it); None for the rest."""
    if event.step > restored_step:
        if event.HasField("summary") or event.HasField("log_message"):
            return _AFTER
        if event.HasField("session_log") and event.session_log.status in (
            event_pb2.SessionLog.START,
            event_pb2.SessionLog.CHECKPOINT,
        ):
            return _AFTER
        return None
    if event.step == restored_step and event.HasField("summary"):
        return _AT
    return None


def _prefix_chunks(readable: object, size: int) -> Iterator[bytes]:
    offset = 0
    while offset < size:
        view = memoryview(bytearray(min(_COPY_CHUNK_BYTES, size - offset)))
        n = readable.readinto(view, offset)  # type: ignore[attr-defined]
        if n <= 0:
            raise OSError(f"unexpected end of file after {offset} bytes")
        yield bytes(view[:n])
        offset += n
