"""CPU priority of background threads (the checkpoint writer, its checksum helper, summaries).

On Linux every thread is a task with its own priority, so a background thread can step aside
for the training thread alone. Two knobs: the ``nice`` value, and the ``SCHED_IDLE`` policy,
under which a thread runs only when a core would otherwise idle. On a machine with few cores
the training loop's parallel operators use every core and run at the speed of their slowest
thread: measured on 2 cores (``benchmarks/checkpoint.py``, a 100 MB state written back to back
while a loop trains), the loop kept 93 to 98% of its speed with the writer at nice 19 and 97 to
99% with it under ``SCHED_IDLE``. When training waits (a final checkpoint, a synchronous save)
the background threads get the whole machine anyway.

Elsewhere (macOS, Windows) these calls do nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import NamedTuple

__all__ = ["Priority", "current", "lower", "restore"]

logger = logging.getLogger("torchsupervisor")

_LINUX = sys.platform.startswith("linux")
_SCHED_IDLE = getattr(os, "SCHED_IDLE", None)


class Priority(NamedTuple):
    """A thread's CPU priority: its ``nice`` value and scheduling policy (None: unknown)."""

    niceness: int | None
    policy: int | None


def current() -> Priority:
    """Return the calling thread's priority.

    Thread safety: reads the calling thread only.
    """
    if not _LINUX:
        return Priority(None, None)
    tid = threading.get_native_id()
    try:
        niceness: int | None = os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
        niceness = None
    try:
        policy: int | None = os.sched_getscheduler(tid)
    except (AttributeError, OSError):
        policy = None
    return Priority(niceness, policy)


def lower(niceness: int, *, idle: bool = False) -> None:
    """Lower the calling thread's priority: ``nice`` value ``niceness``, ``SCHED_IDLE`` if ``idle``.

    Args:
        niceness: The ``nice`` value (1 to 19); 0 or less leaves the thread as it is.
        idle: Also run the thread under ``SCHED_IDLE`` (only when a core would otherwise idle).

    Errors are logged at debug level and ignored: a thread that keeps its priority works.

    Thread safety: changes the calling thread only.
    """
    if niceness <= 0 or not _LINUX:
        return
    restore(Priority(niceness, _SCHED_IDLE if idle else None))


def restore(priority: Priority) -> None:
    """Give the calling thread ``priority`` (from ``current()``); unknown parts are left alone.

    A thread can always lower its priority; raising it back may need privileges and then
    fails silently (the thread stays lower, never higher, than asked).

    Thread safety: changes the calling thread only.
    """
    if not _LINUX:
        return
    tid = threading.get_native_id()
    if priority.niceness is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, priority.niceness)
        except OSError as e:
            logger.debug("Could not set the niceness of thread %d: %s", tid, e)
    if priority.policy is not None:
        try:
            os.sched_setscheduler(tid, priority.policy, os.sched_param(0))
        except (AttributeError, OSError) as e:
            logger.debug("Could not set the scheduling policy of thread %d: %s", tid, e)
