"""CPU priority of background threads (the checkpoint writer, its checksum helper, summaries).

On Linux every thread is a task with its own priority, so a background thread can step aside
for the training thread alone. Two knobs: the ``nice`` value, and the ``SCHED_IDLE`` policy,
under which a thread runs only when a core would otherwise idle. On a machine with few cores
the training loop's parallel operators use every core and run at the speed of their slowest
thread: measured on 2 cores (``benchmarks/checkpoint.py``, a 100 MB state written back to back
while a loop trains), the loop kept 93 to 98% of its speed with the writer at nice 19 and 97 to
99% with it under ``SCHED_IDLE``. When training waits (a final checkpoint, a synchronous save)
the background threads get the whole machine anyway, if nothing else runs.

On a machine that other processes keep busy (data-loader workers, another job) a thread under
``SCHED_IDLE`` gets almost no CPU at all: measured here with two CPU-bound processes beside it,
a 100 MB save that a synchronous write commits in 0.1 s took 2.5 to 5 s on the idle-priority
writer while training waited for it. So a thread that waits for background work first raises
the *hurriable* background threads to its own priority (``hurry``): the work it waits for
runs as if the thread ran it itself (priority inheritance), and each such thread lowers itself
again once that job has ended. Raising a priority needs ``CAP_SYS_NICE`` (root outside a
container has it; containers lack it unless granted) or a ``RLIMIT_NICE`` that allows it.
``raise_permitted`` tells, once per process, whether the system would allow it; where it would
not, the checkpoint writer does not go under ``SCHED_IDLE`` at all (``checkpoint/engine.py``),
and where a raise is refused all the same, the refusal is logged once and the wait takes what
the machine leaves.

Elsewhere (macOS, Windows) these calls do nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from typing import NamedTuple

from torchsupervisor.core import thread_registry

__all__ = [
    "Priority",
    "apply_priority",
    "current",
    "follow",
    "hurry",
    "lower",
    "raise_permitted",
    "restore",
]

logger = logging.getLogger("torchsupervisor")

_LINUX = sys.platform.startswith("linux")
_SCHED_IDLE = getattr(os, "SCHED_IDLE", None)

# Background threads that ``hurry`` raises while another thread waits for their work.
_hurriable: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_hurriable_lock = threading.Lock()  # Registrations and ``hurry``'s copy of the set.
_refusal_logged = False
_permitted: bool | None = None  # ``raise_permitted``'s answer, once asked.


def _forget_threads() -> None:
    """In a forked child only the forking thread exists (and the lock may be held)."""
    global _hurriable, _hurriable_lock
    _hurriable, _hurriable_lock = weakref.WeakSet(), threading.Lock()


thread_registry.register("hurriable threads", at_fork=_forget_threads)


class Priority(NamedTuple):
    """A thread's CPU priority: its ``nice`` value and scheduling policy (None: unknown)."""

    niceness: int | None
    policy: int | None


def current(tid: int | None = None) -> Priority:
    """Return the priority of the calling thread, or of the thread of native id ``tid``.

    Thread safety: reads one thread only.
    """
    if not _LINUX:
        return Priority(None, None)
    if tid is None:
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


def lower(niceness: int, *, idle: bool = False, hurriable: bool = False) -> None:
    """Lower the calling thread's priority: ``nice`` value ``niceness``, ``SCHED_IDLE`` if ``idle``.

    Args:
        niceness: The ``nice`` value (1 to 19); 0 or less leaves the thread as it is.
        idle: Also run the thread under ``SCHED_IDLE`` (only when a core would otherwise idle).
        hurriable: Let ``hurry`` raise the thread while another thread waits for its work
            (it must then lower itself again when the job it was raised for has ended);
            ignored where raising is refused (``raise_permitted``).

    Errors are logged at debug level and ignored: a thread that keeps its priority works.

    Thread safety: changes the calling thread only.
    """
    if niceness <= 0 or not _LINUX:
        return
    restore(Priority(niceness, _SCHED_IDLE if idle else None), hurriable=hurriable)


def restore(priority: Priority, *, hurriable: bool = False) -> None:
    """Give the calling thread ``priority`` (from ``current()``); unknown parts are left alone.

    A thread can always lower its priority; raising it back may need privileges and then
    fails silently (the thread stays lower, never higher, than asked).

    Args:
        priority: The priority to take.
        hurriable: As ``lower``'s.

    Thread safety: changes the calling thread only.
    """
    if not _LINUX:
        return
    if hurriable and raise_permitted():  # Else ``hurry`` could not raise it anyway.
        with _hurriable_lock:
            _hurriable.add(threading.current_thread())
    apply_priority(threading.get_native_id(), priority)


def follow(tid: int) -> None:
    """Take the priority that thread ``tid`` has now; be hurriable, as it is.

    For a helper thread at the start of each job it does for ``tid`` (the checkpoint writer's
    checksums, an object's upload parts): it runs at the writer's priority, raised if training
    waits for the save (``hurry``), and lower again once the writer is.

    Thread safety: changes the calling thread only.
    """
    restore(current(tid), hurriable=True)


def raise_permitted() -> bool:
    """Whether a thread of this process lowered to nice 19 under ``SCHED_IDLE`` can be raised
    back to the priority of the process's main thread (``hurry``).

    Linux lets any thread lower itself, but leaving ``SCHED_IDLE`` or lowering a ``nice``
    value again needs ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that allows it; containers lack
    the capability by default. Asked once per process, by trying it on a thread of its own
    that then ends (a fraction of a millisecond); later calls give the same answer.

    Returns:
        True if the raise worked, or where priorities are not set at all (not Linux).

    Thread safety: any thread.
    """
    global _permitted
    if not _LINUX:
        return True
    if _permitted is None:
        target = current(os.getpid())  # The main thread's (its native id is the pid's).
        answer: list[bool] = []

        def probe() -> None:
            tid = threading.get_native_id()
            apply_priority(tid, Priority(19, _SCHED_IDLE))
            answer.append(apply_priority(tid, target) is None and current(tid) == target)

        thread = threading.Thread(target=probe, name="torchsupervisor-priority-probe")
        try:
            thread.start()
        except RuntimeError:  # No new thread (the interpreter is shutting down): ask later.
            return False
        thread.join()
        _permitted = bool(answer and answer[0])
    return _permitted


def hurry() -> bool:
    """Raise the hurriable background threads to the calling thread's priority.

    For a thread about to wait for their work (a save in flight): see the module docstring.
    Each raised thread keeps the priority until it lowers itself again (the checkpoint writer
    when its job ends, the checksum helper when its next job starts).

    Returns:
        False if the system refused to raise a thread (no ``CAP_SYS_NICE``; logged once at
        WARNING level), else True.

    Thread safety: any thread; changes the priority of other threads.
    """
    global _refusal_logged
    if not _LINUX:
        return True
    target = current()
    me = threading.current_thread()
    refused = None
    with _hurriable_lock:
        hurriable = list(_hurriable)
    for thread in hurriable:
        tid = thread.native_id
        if thread is me or tid is None or not thread.is_alive():
            continue
        refused = apply_priority(tid, target) or refused
    if refused is None:
        return True
    if not _refusal_logged:
        _refusal_logged = True
        logger.warning(
            "Cannot raise the CPU priority of the checkpoint writer while training waits for "
            "it (%s; needs CAP_SYS_NICE or a higher RLIMIT_NICE): on a machine that other "
            "processes keep busy, a save that training waits for gets only the CPU they leave",
            refused,
        )
    return False


def apply_priority(tid: int, priority: Priority) -> OSError | None:
    """Give thread ``tid`` ``priority``; return the error if the system refused a part."""
    refused = None
    if priority.policy is not None:  # Before the niceness: leaving SCHED_IDLE comes first.
        try:
            os.sched_setscheduler(tid, priority.policy, os.sched_param(0))
        except (AttributeError, OSError) as e:
            logger.debug("Could not set the scheduling policy of thread %d: %s", tid, e)
            refused = e if isinstance(e, OSError) else None
    if priority.niceness is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, priority.niceness)
        except OSError as e:
            logger.debug("Could not set the niceness of thread %d: %s", tid, e)
            refused = refused or e
    return refused
