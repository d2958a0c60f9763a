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

Nested and concurrent pauses (several savers) are counted; the collector is enabled again
when the last ends, and only if it was enabled when the first began (a program that disabled
it keeps it disabled).

TF name: none.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["paused"]

_lock = threading.Lock()
_pausers = 0
_was_enabled = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Disable the cyclic garbage collector until the block ends (module docstring)."""
    global _pausers, _was_enabled
    with _lock:
        if _pausers == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pausers += 1
    try:
        yield
    finally:
        with _lock:
            _pausers -= 1
            if _pausers == 0 and _was_enabled:
                gc.enable()
