"""Step boundaries: deferred work that must run on the training thread between two steps.

A checkpoint must capture one step, never half of one. Background services therefore do not
read the state themselves: they ask the training thread to do it at its next step boundary
(the entry of ``Session.run`` or a call of ``Supervisor.should_stop()``). ``StepBoundary`` is
that mailbox. Its fast path is one attribute read, so the training loop pays nothing when no
work is pending.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["StepBoundary"]


class StepBoundary:
    """A queue of callables run by the owner (training) thread at its next step boundary.

    Args:
        owner_ident: ``threading.get_ident()`` of the training thread (default: the caller's).

    Thread safety: ``call_soon`` may be called from any thread; ``run_pending`` does nothing
    unless called from the owner thread, so a service thread that happens to call
    ``Session.run`` never takes a snapshot.
    """

    __slots__ = ("_lock", "_tasks", "owner_ident", "pending")

    def __init__(self, owner_ident: int | None = None) -> None:
        self.owner_ident = threading.get_ident() if owner_ident is None else owner_ident
        self.pending = False
        self._lock = threading.Lock()
        self._tasks: list[Callable[[], object]] = []

    def call_soon(self, task: Callable[[], object]) -> None:
        """Queue ``task`` to run at the owner thread's next step boundary."""
        with self._lock:
            self._tasks.append(task)
            self.pending = True

    def run_pending(self) -> None:
        """Run the queued tasks if called from the owner thread; exceptions propagate.

        A task may queue new tasks; those run at the following boundary. If a task raises,
        the tasks after it stay queued.
        """
        if threading.get_ident() != self.owner_ident:
            return
        with self._lock:
            tasks, self._tasks = self._tasks, []
            self.pending = False
        for i, task in enumerate(tasks):
            try:
                task()
            except BaseException:
                with self._lock:
                    self._tasks[:0] = tasks[i + 1 :]
                    self.pending = bool(self._tasks)
                raise

    def clear(self) -> None:
        """Drop every queued task."""
        with self._lock:
            self._tasks.clear()
            self.pending = False
