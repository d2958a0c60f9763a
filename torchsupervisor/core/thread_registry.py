"""One registry of the background machinery: what drains at exit, what resets after a fork.

The checkpoint writer (``checkpoint/engine.py``), its checksum helper (``checkpoint/commit.py``),
the events writers (``summary/event_file.py``), the process group ``connect`` made
(``distributed/env.py``) and the hurriable-thread set (``core/threads.py``) each register here,
once, and nothing else in the package calls ``atexit`` or ``os.register_at_fork``:

* **drain** runs once, at interpreter exit, in ``order`` (lower first): saves in flight are
  finished before the events writers close (a commit writes a CHECKPOINT event), and those
  before the process group is torn down. Each drain bounds its own wait. The one ``atexit``
  hook is registered again with each part that drains (the first save, the first events
  file, the process group), so it runs before every hook registered before any of them.
* **at_fork** runs in a forked child, before anything else there: only the forking thread
  exists in the child, so each part forgets the threads (and locks) it had.
* **quiet** (for tests, through ``torchsupervisor.testing.wait_for_quiet``) waits up to a
  deadline for the part's work to end and stops its idle threads; it returns what is still
  busy.

Per-operation pools (an object's upload parts, a read-ahead) are not registered: the upload or
reader that made one shuts it down before it returns or closes.

Thread safety: ``register`` and ``wait_for_quiet`` from any thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "DRAIN_EVENTS",
    "DRAIN_PROCESS_GROUP",
    "DRAIN_SAVES",
    "register",
    "registered",
    "wait_for_quiet",
]

logger = logging.getLogger("torchsupervisor")

DRAIN_SAVES = 0
"""Drain order of the checkpoint writer: saves in flight finish first."""
DRAIN_EVENTS = 10
"""Drain order of the events writers: after the saves (whose commits write events)."""
DRAIN_PROCESS_GROUP = 20
"""Drain order of the process group: last (a save's agreement may still need it)."""


@dataclass(frozen=True)
class _Part:
    name: str
    order: int
    drain: Callable[[], object] | None
    at_fork: Callable[[], object] | None
    quiet: Callable[[float], list[str]] | None


_parts: dict[str, _Part] = {}
_lock = threading.Lock()
_drained = False


def register(
    name: str,
    *,
    order: int = DRAIN_EVENTS,
    drain: Callable[[], object] | None = None,
    at_fork: Callable[[], object] | None = None,
    quiet: Callable[[float], list[str]] | None = None,
) -> None:
    """Register a part of the background machinery (again under one name: replaced).

    Args:
        name: What it is, for logs and ``wait_for_quiet``'s answer ("checkpoint writer").
        order: When ``drain`` runs at exit among the others (lower first; ``DRAIN_*``).
        drain: Called once at interpreter exit; bounds its own wait.
        at_fork: Called in a forked child.
        quiet: ``quiet(timeout_secs)`` waits for the part's work to end and stops its idle
            threads; returns what is still busy (empty when quiet).

    TF name: none.
    """
    with _lock:
        _parts[name] = _Part(name, order, drain, at_fork, quiet)
        if drain is not None:
            # Registered again at each part that drains: the hook then runs before every
            # atexit hook registered before that part (the interpreter runs them last in,
            # first out), as each part's own hook did when it registered it.
            atexit.unregister(_drain_all)
            atexit.register(_drain_all)


def registered() -> list[str]:
    """The names registered, in drain order."""
    with _lock:
        return [part.name for part in sorted(_parts.values(), key=lambda p: p.order)]


def _drain_all() -> None:
    global _drained
    with _lock:
        if _drained:
            return
        _drained = True
        parts = sorted(_parts.values(), key=lambda p: p.order)
    for part in parts:
        if part.drain is None:
            continue
        try:
            part.drain()
        except Exception:  # Exiting anyway: the others still drain.
            logger.exception("Draining the %s at exit failed", part.name)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # The parent's may have been held by another thread.
    for part in list(_parts.values()):
        if part.at_fork is not None:
            part.at_fork()


def wait_for_quiet(timeout_secs: float = 10.0) -> list[str]:
    """Wait until every registered part is quiet: its work done, its idle threads stopped.

    Args:
        timeout_secs: The deadline for all parts together (seconds).

    Returns:
        What is still busy at the deadline, as "<part>: <what>" (empty when all is quiet).

    TF name: none.
    """
    deadline = time.monotonic() + timeout_secs
    with _lock:
        parts = sorted(_parts.values(), key=lambda p: p.order)
    busy = []
    for part in parts:
        if part.quiet is not None:
            left = max(0.0, deadline - time.monotonic())
            busy += [f"{part.name}: {what}" for what in part.quiet(left)]
    return busy


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
