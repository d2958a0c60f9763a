"""Step boundaries: deferred work that must run on the training thread between two steps.

A checkpoint must capture one step, never half of one. Background services therefore do not
read the state themselves: they ask the training thread to do it at its next step boundary.
``StepBoundary`` is that mailbox. Its fast path is one attribute read, so the training loop
pays nothing when no work is pending.

Which call is the boundary: ``Supervisor.should_stop()``, and the entry of ``Session.run``
unless ``should_stop()`` was called since the previous ``run`` (``asked``). So a loop that asks
``should_stop()`` before each step has its boundary there alone: what it does between
``should_stop()`` and ``sess.run(fn)`` (drawing a batch, a random number) happens after the
snapshot, and a resume from it does the same again and continues exactly. A loop that never
asks has its boundary at the entry of ``Session.run``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["StepBoundary"]


class StepBoundary:
    """A queue of callables run by the owner (training) thread at its next step boundary.

    Args:
        owner_ident: ``threading.get_ident()`` of the training thread (default: the caller's).

    Attributes:
        asked: ``Supervisor.should_stop()`` was called since the last ``Session.run``, whose
            entry is then not a boundary (module docstring); ``Session.run`` resets it.
        watcher: Called at every boundary that runs while ``pending`` is set, after the
            tasks (the Supervisor's: a preemption signal in a loop that never asks
            ``should_stop()``); None: nothing.

    Thread safety: ``call_soon`` may be called from any thread, ``poke`` from a signal
    handler; ``run_pending`` does nothing unless called from the owner thread, so a service
    thread that happens to call ``Session.run`` never takes a snapshot.
    """

    __slots__ = (
        "_each",
        "_first",
        "_lock",
        "_tasks",
        "asked",
        "busy_secs",
        "owner_ident",
        "pending",
        "watcher",
    )

    def __init__(self, owner_ident: int | None = None) -> None:
        self.owner_ident = threading.get_ident() if owner_ident is None else owner_ident
        self.pending = False
        self.asked = False
        self.watcher: Callable[[], object] | None = None
        self.busy_secs = 0.0
        """Seconds the owner thread spent running boundary work (snapshots, mostly: the
        goodput ledger's ``checkpoint`` badput)."""
        self._lock = threading.Lock()
        self._tasks: list[Callable[[], object]] = []
        self._each: tuple[Callable[[], object], ...] = ()
        self._first: tuple[Callable[[], object], ...] = ()

    def poke(self) -> None:
        """Make the next boundary run (its ``watcher``); lock-free, for a signal handler."""
        self.pending = True

    def call_soon(self, task: Callable[[], object]) -> None:
        """Queue ``task`` to run at the owner thread's next step boundary."""
        with self._lock:
            self._tasks.append(task)
            self.pending = True

    def call_each(self, task: Callable[[], object], *, first: bool = False) -> None:
        """Run ``task`` at every boundary of the owner thread (after the queued tasks) until
        ``remove_each``: the memory tier's snapshot, which decides itself whether it is due.
        While one is set, every boundary runs ``run_pending``.

        With ``first``, ``task`` runs before the queued tasks (and the others): what a
        checkpoint of this boundary saves must be ready before it (``ReplicaStreams``).
        """
        with self._lock:
            if first:
                self._first = (*self._first, task)
            else:
                self._each = (*self._each, task)
            self.pending = True

    def remove_each(self, task: Callable[[], object]) -> None:
        """Stop running ``task`` at every boundary (absent: nothing happens)."""
        with self._lock:
            self._each = tuple(t for t in self._each if t != task)
            self._first = tuple(t for t in self._first if t != task)
            self.pending = bool(self._tasks or self._each or self._first)

    def run_pending(self) -> None:
        """Run the ``call_each(first=True)`` tasks, the queued ones, then the other
        ``call_each`` ones, if called from the owner thread; exceptions propagate.

        A task may queue new tasks; those run at the following boundary. If a task raises,
        the tasks after it stay queued.
        """
        if threading.get_ident() != self.owner_ident:
            return
        started = time.perf_counter()
        try:
            self._run_pending()
        finally:
            self.busy_secs += time.perf_counter() - started

    def _run_pending(self) -> None:
        with self._lock:
            tasks = self._tasks
            if tasks:  # No new list at a boundary with only ``call_each`` work (every step).
                self._tasks = []
            each, first = self._each, self._first
            self.pending = bool(each or first)
        for i, task in enumerate((*first, *tasks)):
            try:
                task()
            except BaseException:
                with self._lock:  # The queued tasks not run yet stay queued.
                    self._tasks[:0] = tasks[max(0, i + 1 - len(first)) :]
                    self.pending = bool(self._tasks or self._each or self._first)
                raise
        for task in each:
            task()
        watcher = self.watcher
        if watcher is not None:
            watcher()

    def clear(self) -> None:
        """Drop every queued task and every ``call_each`` one."""
        with self._lock:
            self._tasks.clear()
            self._each = self._first = ()
            self.pending = False
