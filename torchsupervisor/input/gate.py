"""The pipeline gate: a snapshot of the input pipeline sees it between enqueue ops.

A queue runner's thread runs its enqueue op holding a *share* of the gate; a snapshot
(``InputPipelineState.state_dict``) holds the gate *exclusively*, so it waits until every
runner thread is between two ops or waiting inside a queue (a thread gives its share back for
as long as it waits for room or for elements, and takes it again before it goes on). What a
waiting thread holds is then visible in the queues' own state: the elements of a waiting
enqueue are the queue's pending elements, the elements a waiting ``dequeue_many`` gathered are
still counted in the queue. So a snapshot never sees an element in a thread's hands.

A thread that is not a runner thread (the training loop) holds no share and is never held up.

TF name: none (TF's queues were not checkpointed).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["GATE", "PipelineGate"]


class PipelineGate:
    """A shared/exclusive lock whose shares a thread can give back while it waits in a queue.

    Exclusive holders are preferred: once one waits, no new share is granted, so a snapshot
    waits at most for the ops already running.

    Thread safety: every method may be called from any thread.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shares = 0
        self._exclusive = False
        self._exclusive_waiting = 0
        self._local = threading.local()

    def _acquire_share(self) -> None:
        with self._cond:
            while self._exclusive or self._exclusive_waiting:
                self._cond.wait()
            self._shares += 1
        self._local.held = True

    def _release_share(self) -> None:
        self._local.held = False
        with self._cond:
            self._shares -= 1
            if self._shares == 0:
                self._cond.notify_all()

    def holds_share(self) -> bool:
        """True if the calling thread holds a share."""
        return getattr(self._local, "held", False)

    @contextlib.contextmanager
    def share(self) -> Iterator[None]:
        """Hold a share for the block (a runner thread running one enqueue op)."""
        self._acquire_share()
        try:
            yield
        finally:
            self._release_share()

    def give_back(self) -> bool:
        """Give back the calling thread's share before a wait; True if it held one."""
        if not self.holds_share():
            return False
        self._release_share()
        return True

    def take_again(self) -> None:
        """Take a share again after a wait that ``give_back`` returned True for."""
        self._acquire_share()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the gate alone for the block: every runner thread is between ops or waiting.

        Reentrant: a thread holding it may enter again (the block then holds it already).

        Raises:
            RuntimeError: If the calling thread holds a share (an enqueue op taking a
                snapshot would wait for itself).
        """
        if self.holds_share():
            raise RuntimeError("an enqueue op cannot snapshot the input pipeline")
        if getattr(self._local, "exclusive", False):
            yield  # Already held by this thread (a queue's state inside a pipeline's).
            return
        with self._cond:
            self._exclusive_waiting += 1
            try:
                while self._exclusive or self._shares:
                    self._cond.wait()
            finally:
                self._exclusive_waiting -= 1
            self._exclusive = True
        self._local.exclusive = True
        try:
            yield
        finally:
            self._local.exclusive = False
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


GATE = PipelineGate()
"""The process's gate: every queue runner thread and every pipeline snapshot uses it."""
