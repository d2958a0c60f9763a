"""``WriterCounters``: what a summary writer has done so far."""

from __future__ import annotations

import dataclasses

__all__ = ["WriterCounters"]


@dataclasses.dataclass(frozen=True)
class WriterCounters:
    """What a summary writer has done so far (cumulative over ``reopen()``).

    Attributes:
        events_written: Events written to an events file.
        events_pending: Events waiting for the writer thread.
        events_dropped: Events discarded because the queue was full (``on_full="drop"``).
        events_lost: Events that could not be encoded or written (each failure is logged).
        blocked_calls: ``add_*`` calls that waited for room in a full queue (``"block"``).
        blocked_secs: Seconds those calls waited in total.
        bytes_written: Bytes written to events files, first records included.
        batches: Write calls (one per batch of events).
        flushes: fsyncs of an events file.

    Thread safety: immutable.

    TF name: none (TF's writers count nothing).
    """

    events_written: int = 0
    events_pending: int = 0
    events_dropped: int = 0
    events_lost: int = 0
    blocked_calls: int = 0
    blocked_secs: float = 0.0
    bytes_written: int = 0
    batches: int = 0
    flushes: int = 0

    def __add__(self, other: WriterCounters) -> WriterCounters:
        return WriterCounters(
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self))
        )
