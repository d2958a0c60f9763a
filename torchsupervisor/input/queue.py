"""``FIFOQueue``: TF 1's input queue, holding any Python objects; its end raises
``OutOfRangeError``.

Threads (``QueueRunner``, ``queue_runner.py``) fill it with *enqueue ops*; the training step
dequeues; closing it (the end of the input) makes a dequeue on an empty queue raise
``OutOfRangeError``, the normal end of training. Tensors are kept as they are (no copy).

TF name: ``tf.queue.FIFOQueue``.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.errors import CancelledError, DeadlineExceededError, OutOfRangeError

__all__ = ["FIFOQueue"]

logger = logging.getLogger("torchsupervisor")

_TIMEOUT_TEXT = "Timed out waiting for notification"


def _collate(elements: list[Any]) -> Any:
    """Batch elements: tensors are stacked; tuples and dicts per component; others listed."""
    first = elements[0]
    if all(isinstance(e, torch.Tensor) for e in elements):
        return torch.stack(elements)
    if isinstance(first, tuple) and all(
        isinstance(e, tuple) and len(e) == len(first) for e in elements
    ):
        return tuple(_collate(list(column)) for column in zip(*elements))
    if isinstance(first, Mapping) and all(isinstance(e, Mapping) for e in elements):
        return {key: _collate([e[key] for e in elements]) for key in first}
    return list(elements)


class FIFOQueue:
    """A bounded first-in first-out queue of Python objects that can be closed.

    ``enqueue`` blocks while the queue is full, ``dequeue`` while it is empty. After
    ``close()``, new enqueues fail with ``CancelledError`` while enqueues already waiting for
    room still complete (unless ``cancel_pending_enqueues``), and dequeues drain what is left,
    then fail with ``OutOfRangeError``: the signal that the input is exhausted.

    Args:
        capacity: The most elements the queue holds (> 0).
        dtypes: Accepted for TF's signature; a list or tuple gives the number of components of
            an element (what ``enqueue_many`` splits along); types are not checked.
        shapes: Accepted for TF's signature; not checked.
        names: Component names: elements are then dicts with these keys (for
            ``enqueue_many``); None: unnamed.
        shared_name: Accepted for TF's signature; unused.
        name: The queue's name (in messages and thread names).
        clock: Time source for ``timeout_secs``; None means the real clock.

    Raises:
        ValueError: If ``capacity`` is not a positive integer.

    Thread safety: every method may be called from any thread.

    TF name: ``tf.queue.FIFOQueue`` (``tf.FIFOQueue``).
    """

    def __init__(
        self,
        capacity: int,
        dtypes: Any = None,
        shapes: Any = None,
        names: Sequence[str] | None = None,
        shared_name: str | None = None,
        name: str = "fifo_queue",
        *,
        clock: Clock | None = None,
    ) -> None:
        del shapes, shared_name
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self._capacity = capacity
        self._num_components = len(dtypes) if isinstance(dtypes, (list, tuple)) else 1
        self._names = list(names) if names is not None else None
        self._name = name
        self._clock = clock or REAL_CLOCK
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._items: collections.deque[Any] = collections.deque()
        self._closed = False
        self._cancelled = False

    @property
    def name(self) -> str:
        """The queue's name.

        TF name: ``tf.queue.FIFOQueue.name``.
        """
        return self._name

    @property
    def capacity(self) -> int:
        """The most elements the queue holds.

        TF name: none (TF takes ``capacity`` in the constructor only).
        """
        return self._capacity

    @property
    def names(self) -> list[str] | None:
        """The component names, or None for unnamed components.

        TF name: ``tf.queue.FIFOQueue.names``.
        """
        return self._names

    def __repr__(self) -> str:
        return f"FIFOQueue(name={self._name!r}, capacity={self._capacity})"

    def _deadline(self, timeout_secs: float | None) -> float | None:
        return None if timeout_secs is None else self._clock.monotonic() + timeout_secs

    def _wait(self, condition: threading.Condition, deadline: float | None) -> None:
        if deadline is None:
            condition.wait()
            return
        remaining = deadline - self._clock.monotonic()
        if remaining <= 0:
            raise DeadlineExceededError(_TIMEOUT_TEXT)
        condition.wait(remaining)

    def _closed_error(self) -> CancelledError:
        return CancelledError(f"FIFOQueue '{self._name}' is closed.")

    def enqueue(self, vals: Any, *, timeout_secs: float | None = None) -> None:
        """Add one element, waiting while the queue is full.

        Args:
            vals: The element (any object; a tuple of components, or a dict of named ones,
                by convention).
            timeout_secs: The longest wait for room, in seconds; None waits as long as needed.

        Raises:
            CancelledError: ``"FIFOQueue '<name>' is closed."`` if the queue is closed;
                ``"Enqueue operation was cancelled"`` if it is closed with
                ``cancel_pending_enqueues`` while waiting.
            DeadlineExceededError: If ``timeout_secs`` passed without room.

        TF name: ``tf.queue.FIFOQueue.enqueue``.
        """
        deadline = self._deadline(timeout_secs)
        with self._lock:
            if self._closed:
                raise self._closed_error()
            self._put(vals, deadline)

    def _put(self, vals: Any, deadline: float | None) -> None:
        while len(self._items) >= self._capacity:
            if self._cancelled:
                raise CancelledError("Enqueue operation was cancelled")
            self._wait(self._not_full, deadline)
        if self._cancelled:
            raise CancelledError("Enqueue operation was cancelled")
        self._items.append(vals)
        self._not_empty.notify()

    def enqueue_many(self, vals: Any, *, timeout_secs: float | None = None) -> None:
        """Add several elements, in order, waiting for room as needed.

        Args:
            vals: The elements: an iterable of them (a tensor is split along its first
                dimension); for a queue of several components (``dtypes``), a tuple of
                components of equal first dimension, zipped into tuples; for a queue with
                ``names``, a dict of such components, zipped into dicts.
            timeout_secs: The longest wait for room for each element; None: no limit.

        Raises:
            CancelledError, DeadlineExceededError: As ``enqueue`` (elements added before the
                error stay in the queue).
            ValueError: If a tuple or list for a queue of several components has another
                number of components.
            KeyError: If a dict for a queue with ``names`` lacks one of them.

        TF name: ``tf.queue.FIFOQueue.enqueue_many``.
        """
        elements = self._split(vals)
        deadline = self._deadline(timeout_secs)
        with self._lock:
            if self._closed:
                raise self._closed_error()
            for element in elements:
                self._put(element, deadline)

    def _split(self, vals: Any) -> list[Any]:
        if self._names is not None and isinstance(vals, Mapping):
            keys = self._names
            return [dict(zip(keys, row)) for row in zip(*(vals[k] for k in keys))]
        if self._num_components > 1 and isinstance(vals, (tuple, list)):
            if len(vals) != self._num_components:
                raise ValueError(
                    f"enqueue_many on queue '{self._name}' expects {self._num_components} "
                    f"components, got {len(vals)}"
                )
            return [tuple(row) for row in zip(*vals)]
        return list(vals)

    def _take(self, n: int, deadline: float | None, up_to: bool) -> list[Any]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        with self._lock:
            while len(self._items) < n and not self._closed:
                self._wait(self._not_empty, deadline)
            size = len(self._items)
            if size < n and not (up_to and size > 0):
                raise OutOfRangeError(
                    f"FIFOQueue '{self._name}' is closed and has insufficient elements "
                    f"(requested {n}, current size {size})"
                )
            taken = [self._items.popleft() for _ in range(min(n, size))]
            self._not_full.notify(len(taken))
            return taken

    def dequeue(self, *, timeout_secs: float | None = None) -> Any:
        """Remove and return the oldest element, waiting while the queue is empty.

        Args:
            timeout_secs: The longest wait, in seconds; None waits as long as needed.

        Returns:
            The element, as it was enqueued.

        Raises:
            OutOfRangeError: ``"FIFOQueue '<name>' is closed and has insufficient elements
                (requested 1, current size 0)"`` once the queue is closed and drained.
            DeadlineExceededError: If ``timeout_secs`` passed first.

        TF name: ``tf.queue.FIFOQueue.dequeue``.
        """
        return self._take(1, self._deadline(timeout_secs), up_to=False)[0]

    def dequeue_many(self, n: int, *, timeout_secs: float | None = None) -> Any:
        """Remove ``n`` elements at once and return them batched.

        Args:
            n: How many elements.
            timeout_secs: The longest wait, in seconds; None waits as long as needed.

        Returns:
            The batch: stacked tensors for tensor elements (tuples and dicts batched per
            component), else a list; ``[]`` for ``n == 0``.

        Raises:
            ValueError: If ``n`` is not a non-negative int.
            OutOfRangeError: If the queue is closed with fewer than ``n`` elements left.
            DeadlineExceededError: If ``timeout_secs`` passed first.

        TF name: ``tf.queue.FIFOQueue.dequeue_many``.
        """
        taken = self._take(n, self._deadline(timeout_secs), up_to=False)
        return _collate(taken) if taken else []

    def dequeue_up_to(self, n: int, *, timeout_secs: float | None = None) -> Any:
        """Like ``dequeue_many``, but a closed queue gives what is left (at least one).

        Args:
            n: The most elements to take.
            timeout_secs: The longest wait, in seconds; None waits as long as needed.

        Returns:
            The batch, as ``dequeue_many``.

        Raises:
            OutOfRangeError: If the queue is closed and empty.
            DeadlineExceededError: If ``timeout_secs`` passed first.

        TF name: ``tf.queue.FIFOQueue.dequeue_up_to``.
        """
        taken = self._take(n, self._deadline(timeout_secs), up_to=True)
        return _collate(taken) if taken else []

    def close(self, cancel_pending_enqueues: bool = False, name: str | None = None) -> None:
        """Close the queue now (idempotent).

        Args:
            cancel_pending_enqueues: Also fail the enqueues waiting for room
                (``CancelledError``) instead of letting them complete.
            name: Accepted for TF's signature; unused.

        TF name: ``tf.queue.FIFOQueue.close`` (which returns an op; this closes at once).
        """
        del name
        with self._lock:
            self._closed = True
            if cancel_pending_enqueues:
                self._cancelled = True
            self._not_empty.notify_all()
            self._not_full.notify_all()

    def _reopen(self) -> None:
        """Accept enqueues again (a runner restarting for a new session); elements are kept."""
        with self._lock:
            self._closed = False
            self._cancelled = False

    def size(self) -> int:
        """Return the number of elements in the queue.

        TF name: ``tf.queue.FIFOQueue.size``.
        """
        with self._lock:
            return len(self._items)

    def is_closed(self) -> bool:
        """Return True once the queue is closed.

        TF name: ``tf.queue.FIFOQueue.is_closed``.
        """
        return self._closed
