"""Python's cyclic garbage collector paused while a checkpoint is written in the background.

A save of a state of many tensors allocates tens of thousands of short-lived containers on the
writer thread (write results, manifest entries, their JSON). Each young collection that runs
meanwhile promotes the ones still alive to the oldest generation, and once those exceed a
quarter of the long-lived objects Python collects everything: measured on a 2-rank FSDP2
state of 1,008 tensors (50 MB), a full collection of the process's ~345,000 objects every
other save on the coordinator, 150-170 ms each, freeing nothing; it holds the GIL, so the
training thread stops for as long. The save's objects are acyclic and go when it ends, by
reference counting. So the writer pauses the collector for the length of a job (``paused``),
and nothing it allocates is promoted: afterwards the counts are where they were, and no full
collection follows. Cyclic garbage made meanwhile (by any thread) waits for the next
collection after the job.

A pause lasts ``MAX_PAUSE_SECS`` at most: a save that takes longer (gigabytes to a slow disk
or an object store) gets the collector back after that long, so that a training loop that
makes cyclic garbage cannot grow without bound while it waits.

Nested and concurrent pauses (several savers) are counted; the collector is enabled again
when the last ends (or the time is up), and only if it was enabled when the first began (a
program that disabled it keeps it disabled).

TF name: none.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["MAX_PAUSE_SECS", "paused"]

MAX_PAUSE_SECS = 10.0
"""The longest the collector stays paused, in seconds, however long the pauses last."""

_lock = threading.Lock()
_pausers = 0
_resume = False  # Whether the collector is to be enabled when this pause ends.
_timer: threading.Timer | None = None
_period = 0  # Counts the pauses (from the first pauser to the last): a late timer is ignored.


@contextlib.contextmanager
def paused(max_secs: float | None = None) -> Iterator[None]:
    """Disable the cyclic garbage collector until the block ends (module docstring).

    Args:
        max_secs: Enable it again after this many seconds even if the block (or another
            pause that began before it ended) is still running; None: ``MAX_PAUSE_SECS``.
    """
    global _pausers, _resume, _timer, _period
    with _lock:
        if _pausers == 0:
            _period += 1
            _resume = gc.isenabled()
            gc.disable()
            if _resume:
                secs = MAX_PAUSE_SECS if max_secs is None else max_secs
                _timer = threading.Timer(secs, _time_is_up, args=(_period,))
                _timer.daemon = True
                _timer.start()
        _pausers += 1
    try:
        yield
    finally:
        with _lock:
            _pausers -= 1
            if _pausers == 0:
                if _timer is not None:
                    _timer.cancel()
                    _timer = None
                if _resume:
                    gc.enable()
                    _resume = False


def _time_is_up(period: int) -> None:
    global _resume
    with _lock:
        if period == _period and _pausers > 0 and _resume:
            gc.enable()
            _resume = False  # Not again when the pause ends (the program may disable it).
