"""``QueueBase`` and ``FIFOQueue``: TF 1's input queues, holding any Python objects; the end of
the input raises ``OutOfRangeError``.

Threads (``QueueRunner``, ``queue_runner.py``) fill a queue with *enqueue ops*; the training
step dequeues; closing it (the end of the input) makes a dequeue on an empty queue raise
``OutOfRangeError``, the normal end of training. Tensors are kept as they are (no copy).

As in TF, waiting operations are served in arrival order: the elements of one ``enqueue_many``
enter the queue together, in order, before those of a later one; the oldest waiting dequeue
takes elements first, one by one as they arrive, so a ``dequeue_many(n)`` larger than the
capacity completes. A dequeue that fails (the queue closed with too few elements, or its
timeout) gives back what it gathered.

The other queues (``RandomShuffleQueue``, ``PaddingFIFOQueue``, ``PriorityQueue``,
``queues.py``) change only which element leaves next and how a batch is made.

Resumable: ``state_dict()`` gives the elements in the queue, the elements of enqueues waiting
for room (kept even when the queue is closed with ``cancel_pending_enqueues``: nothing taken
from upstream is lost) and the shuffling generator; ``load_state_dict`` puts them back
(``InputPipelineState`` does this for a whole pipeline, consistently).

TF names: ``tf.queue.QueueBase``, ``tf.queue.FIFOQueue``.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.registry import GraphKeys, get_collection
from torchsupervisor.errors import (
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    OutOfRangeError,
)
from torchsupervisor.input.elements import as_element, collate
from torchsupervisor.input.gate import GATE

__all__ = ["FIFOQueue", "QueueBase"]

logger = logging.getLogger("torchsupervisor")

_TIMEOUT_TEXT = "Timed out waiting for notification"


class _Enqueue:
    """An enqueue waiting for room: how many of its elements are still pending."""

    __slots__ = ("remaining",)

    def __init__(self, remaining: int) -> None:
        self.remaining = remaining


class _Dequeue:
    """A dequeue gathering elements: what it took so far, and the generator's state before."""

    __slots__ = ("held", "n", "rng_before")

    def __init__(self, n: int, rng_before: object) -> None:
        self.n = n
        self.held: list[Any] = []
        self.rng_before = rng_before


class QueueBase:
    """A bounded queue of Python objects that can be closed; the base of TF's queues.

    ``enqueue`` waits while the queue is full, ``dequeue`` while it is empty. After
    ``close()``, new enqueues fail with ``CancelledError`` while enqueues already waiting for
    room still complete (unless ``cancel_pending_enqueues``), and dequeues drain what is left,
    then fail with ``OutOfRangeError``: the signal that the input is exhausted.

    Args:
        capacity: The most elements the queue holds (> 0).
        dtypes: Accepted for TF's signature; a list or tuple gives the number of components of
            an element: an enqueued element is then a tuple or list of that many (a list is
            stored as a tuple, TF's rule; a list of one component as that component), and
            ``enqueue_many`` splits along them; types are not checked.
        shapes: Accepted for TF's signature; checked only by ``PaddingFIFOQueue``.
        names: Component names: elements are then dicts with these keys (for
            ``enqueue_many``); None: unnamed.
        shared_name: Accepted for TF's signature; unused.
        name: The queue's name (in messages and thread names); None: the kind's default
            (``fifo_queue``, ``padding_fifo_queue``, ...), as TF.
        clock: Time source for ``timeout_secs``; None means the real clock.

    Raises:
        ValueError: If ``capacity`` is not a positive integer.

    Thread safety: every method may be called from any thread.

    TF name: ``tf.queue.QueueBase``.
    """

    _kind = "FIFOQueue"
    _default_name = "fifo_queue"

    def __init__(
        self,
        capacity: int,
        dtypes: Any = None,
        shapes: Any = None,
        names: Sequence[str] | None = None,
        shared_name: str | None = None,
        name: str | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        del shared_name
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self._capacity = capacity
        self._declared = isinstance(dtypes, (list, tuple))  # TF's list of component types.
        self._num_components = len(dtypes) if self._declared else 1
        self._names = list(names) if names is not None else None
        self._dtypes = dtypes
        self._shapes_given = shapes
        self._name = self._default_name if name is None else name
        self._clock = clock or REAL_CLOCK
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pending: collections.deque[tuple[Any, _Enqueue | None]] = collections.deque()
        self._dequeues: collections.deque[_Dequeue] = collections.deque()
        self._seq = 0
        self._closed = False
        self._cancelled = False
        self._init_storage()

    # -- What a kind of queue decides (called with the lock held) ---------------------------

    def _init_storage(self) -> None:
        raise NotImplementedError

    def _count(self) -> int:
        raise NotImplementedError

    def _add(self, element: object, seq: int) -> None:
        raise NotImplementedError

    def _can_take(self) -> bool:
        return self._count() > 0

    def _remove(self) -> Any:
        """Remove the entry that leaves next and return it."""
        raise NotImplementedError

    def _element(self, entry: object) -> Any:
        return entry

    def _give_back(self, entries: list[Any]) -> None:
        """Put back entries a failed dequeue took, where they were."""
        raise NotImplementedError

    def _entries(self, held: list[Any]) -> list[Any]:
        """The elements in the queue, ``held`` (taken by a waiting dequeue) put back, in order."""
        raise NotImplementedError

    def _rng_state(self) -> Any:
        return None

    def _set_rng_state(self, state: Any) -> None:
        del state

    def _check(self, element: object) -> Any:
        return element

    def _batch(self, elements: list[Any]) -> Any:
        return collate(elements)

    # -- Public API ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The queue's name.

        TF name: ``tf.queue.QueueBase.name``.
        """
        return self._name

    @property
    def capacity(self) -> int:
        """The most elements the queue holds.

        TF name: none (TF takes ``capacity`` in the constructor only).
        """
        return self._capacity

    @property
    def dtypes(self) -> Any:
        """The ``dtypes`` given at construction (not checked).

        TF name: ``tf.queue.QueueBase.dtypes``.
        """
        return self._dtypes

    @property
    def shapes(self) -> Any:
        """The ``shapes`` given at construction (checked only by ``PaddingFIFOQueue``).

        TF name: ``tf.queue.QueueBase.shapes``.
        """
        return self._shapes_given

    @property
    def names(self) -> list[str] | None:
        """The component names, or None for unnamed components.

        TF name: ``tf.queue.QueueBase.names``.
        """
        return self._names

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r}, capacity={self._capacity})"

    def _check_fillable(self, n: int) -> None:
        """Raise rather than wait forever for runners that have not started (lock held).

        TF's ``images, labels = queue.dequeue_many(n)`` in graph-building code built an op;
        here a dequeue runs at once, before the session starts the queue's runners: waiting
        would hang the program without a word. A queue whose registered runners all never
        started (and that no enqueue is waiting to fill) is in that case.
        """
        runners = [
            r for r in get_collection(GraphKeys.QUEUE_RUNNERS) if getattr(r, "queue", None) is self
        ]
        if runners and not any(getattr(r, "started", True) for r in runners):
            what = "dequeue()" if n == 1 else f"dequeue_many({n})"
            raise FailedPreconditionError(
                None,
                None,
                f"{what} on {self._kind} '{self._name}' would wait forever: its QueueRunner "
                "has not started (a session starts it). TF's dequeue built an op; here it runs "
                "at once: call it inside the training loop (in the session, at each step), or "
                "use the batching functions (ts.batch, ts.shuffle_batch), whose outputs run "
                "at each sess.run",
            )

    def _deadline(self, timeout_secs: float | None) -> float | None:
        return None if timeout_secs is None else self._clock.monotonic() + timeout_secs

    def _wait(self, deadline: float | None) -> None:
        """Wait for a change (lock held); a runner thread gives back its gate share meanwhile."""
        timeout = None
        if deadline is not None:
            timeout = deadline - self._clock.monotonic()
            if timeout <= 0:
                raise DeadlineExceededError(_TIMEOUT_TEXT)
        shared = GATE.give_back()
        try:
            self._changed.wait(timeout)
        finally:
            if shared:
                # Never wait for the gate holding the queue's lock: a snapshot holding the
                # gate reads this queue.
                self._lock.release()
                try:
                    GATE.take_again()
                finally:
                    self._lock.acquire()

    def _closed_error(self) -> CancelledError:
        return CancelledError(f"{self._kind} '{self._name}' is closed.")

    def _fill(self) -> None:
        """Move pending elements in while there is room (lock held)."""
        moved = False
        while self._pending and not self._cancelled and self._count() < self._capacity:
            element, enqueue = self._pending.popleft()
            self._add(element, self._seq)
            self._seq += 1
            if enqueue is not None:
                enqueue.remaining -= 1
            moved = True
        if moved:
            self._changed.notify_all()

    def _enqueue(self, elements: list[Any], timeout_secs: float | None) -> None:
        deadline = self._deadline(timeout_secs)
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if not elements:
                return
            enqueue = _Enqueue(len(elements))
            self._pending.extend((element, enqueue) for element in elements)
            self._fill()
            while enqueue.remaining:
                if self._cancelled:
                    # Its elements stay pending: a snapshot keeps them, a reopen enqueues them.
                    raise CancelledError("Enqueue operation was cancelled")
                try:
                    self._wait(deadline)
                except DeadlineExceededError:
                    others = [p for p in self._pending if p[1] is not enqueue]
                    self._pending = collections.deque(others)
                    raise

    def enqueue(self, vals: object, *, timeout_secs: float | None = None) -> None:
        """Add one element, waiting while the queue is full.

        Args:
            vals: The element (any object; a tuple or list of components, or a dict of
                named ones, by convention; see ``dtypes``).
            timeout_secs: The longest wait for room, in seconds; None waits as long as needed.

        Raises:
            CancelledError: ``"<Kind> '<name>' is closed."`` if the queue is closed;
                ``"Enqueue operation was cancelled"`` if it is closed with
                ``cancel_pending_enqueues`` while waiting.
            DeadlineExceededError: If ``timeout_secs`` passed without room.
            ValueError: If the element does not fit the queue (its number of components,
                ``PaddingFIFOQueue`` shapes, ``PriorityQueue`` priorities).

        TF name: ``tf.queue.QueueBase.enqueue``.
        """
        self._enqueue([self._check(self._as_element(vals))], timeout_secs)

    def _as_element(self, vals: object) -> Any:
        return as_element(
            vals,
            queue=self._name,
            components=self._num_components if self._declared else None,
            named=self._names is not None,
        )

    def enqueue_many(self, vals: object, *, timeout_secs: float | None = None) -> None:
        """Add several elements, in order, waiting for room as needed.

        Args:
            vals: The elements: an iterable of them (a tensor is split along its first
                dimension); for a queue of several components (``dtypes``), a tuple of
                components of equal first dimension, zipped into tuples; for a queue with
                ``names``, a dict of such components, zipped into dicts.
            timeout_secs: The longest wait for room, in seconds; None: no limit.

        Raises:
            CancelledError, DeadlineExceededError: As ``enqueue`` (elements that entered
                before a timeout stay in the queue).
            ValueError: If a tuple or list for a queue of several components has another
                number of components, or an element does not fit the queue.
            KeyError: If a dict for a queue with ``names`` lacks one of them.

        TF name: ``tf.queue.QueueBase.enqueue_many``.
        """
        self._enqueue([self._check(self._as_element(e)) for e in self._split(vals)], timeout_secs)

    def _split(self, vals: object) -> list[Any]:
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
            dequeue = _Dequeue(n, self._rng_state())
            self._dequeues.append(dequeue)
            done = waited = False
            try:
                while True:
                    if self._dequeues[0] is dequeue:
                        while len(dequeue.held) < n and self._can_take():
                            dequeue.held.append(self._remove())
                            self._fill()
                        if len(dequeue.held) == n or (
                            up_to and dequeue.held and self._closed and not self._count()
                        ):
                            done = True
                            return [self._element(e) for e in dequeue.held]
                        if self._closed and not self._count():
                            raise OutOfRangeError(
                                f"{self._kind} '{self._name}' is closed and has insufficient "
                                f"elements (requested {n}, current size {len(dequeue.held)})"
                            )
                        if deadline is None and not self._pending and not waited:
                            self._check_fillable(n)  # Once: before the first wait.
                    waited = True
                    self._wait(deadline)
            finally:
                self._dequeues.remove(dequeue)
                if not done and dequeue.held:
                    self._give_back(dequeue.held)
                    self._fill()
                self._changed.notify_all()

    def dequeue(self, *, timeout_secs: float | None = None) -> Any:
        """Remove and return the next element, waiting while there is none.

        Args:
            timeout_secs: The longest wait, in seconds; None waits as long as needed.

        Returns:
            The element, as it was enqueued.

        Raises:
            OutOfRangeError: ``"<Kind> '<name>' is closed and has insufficient elements
                (requested 1, current size 0)"`` once the queue is closed and drained.
            DeadlineExceededError: If ``timeout_secs`` passed first.

        TF name: ``tf.queue.QueueBase.dequeue``.
        """
        return self._take(1, self._deadline(timeout_secs), up_to=False)[0]

    def dequeue_many(self, n: int, *, timeout_secs: float | None = None) -> Any:
        """Remove ``n`` elements and return them batched.

        Elements are taken one by one as they arrive, so ``n`` may exceed the capacity.

        Args:
            n: How many elements.
            timeout_secs: The longest wait, in seconds; None waits as long as needed.

        Returns:
            The batch: stacked tensors for tensor elements (tuples and dicts batched per
            component; ``PaddingFIFOQueue`` pads), else a list; ``[]`` for ``n == 0``.

        Raises:
            ValueError: If ``n`` is not a non-negative int.
            OutOfRangeError: If the queue is closed with fewer than ``n`` elements left (they
                stay in the queue).
            DeadlineExceededError: If ``timeout_secs`` passed first (the elements gathered
                stay in the queue).

        TF name: ``tf.queue.QueueBase.dequeue_many``.
        """
        taken = self._take(n, self._deadline(timeout_secs), up_to=False)
        return self._batch(taken) if taken else []

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

        TF name: ``tf.queue.QueueBase.dequeue_up_to``.
        """
        taken = self._take(n, self._deadline(timeout_secs), up_to=True)
        return self._batch(taken) if taken else []

    def close(self, cancel_pending_enqueues: bool = False, name: str | None = None) -> None:
        """Close the queue now (idempotent).

        Args:
            cancel_pending_enqueues: Also fail the enqueues waiting for room
                (``CancelledError``) instead of letting them complete. Their elements stay
                in the queue's state (not dequeued): a reopened queue (``QueueRunner``
                starting again) or a restored snapshot enqueues them first.
            name: Accepted for TF's signature; unused.

        TF name: ``tf.queue.QueueBase.close`` (which returns an op; this closes at once).
        """
        del name
        with self._lock:
            self._closed = True
            if cancel_pending_enqueues:
                self._cancelled = True
            self._changed.notify_all()

    def _reopen(self) -> None:
        """Accept enqueues again (a runner restarting for a new session); elements are kept."""
        with self._lock:
            self._closed = False
            self._cancelled = False
            for i, (element, _) in enumerate(self._pending):
                self._pending[i] = (element, None)  # Their enqueues failed; the queue owns them.
            self._fill()

    def size(self) -> int:
        """Return the number of elements in the queue.

        As in TF, neither the elements of enqueues waiting for room nor those a waiting
        ``dequeue_many`` already took count (those go back if it fails).

        TF name: ``tf.queue.QueueBase.size``.
        """
        with self._lock:
            return self._count()

    def is_closed(self) -> bool:
        """Return True once the queue is closed.

        TF name: ``tf.queue.QueueBase.is_closed``.
        """
        return self._closed

    def state_dict(self) -> dict[str, Any]:
        """Return the queue's contents: its elements, waiting enqueues' elements, generator.

        It is taken with the pipeline gate held (no runner thread holds an element in its
        hands); elements a waiting ``dequeue_many`` gathered count as still in the queue, and
        the generator is the one from before it took them. For a pipeline of several queues,
        put ``InputPipelineState`` in the state rather than the queues: it takes them all at
        one moment.

        Returns:
            ``{"kind", "name", "elements", "pending", "rng"}`` (elements as enqueued).

        TF name: none (TF's queues were not checkpointed).
        """
        with GATE.exclusive(), self._lock:
            held = self._dequeues[0].held if self._dequeues else []
            rng = self._dequeues[0].rng_before if held else self._rng_state()
            return {
                "kind": self._kind,
                "name": self._name,
                "elements": [self._element(e) for e in self._entries(held)],
                "pending": [element for element, _ in self._pending],
                "rng": rng,
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the contents by a ``state_dict``'s; call before the runners start.

        Raises:
            ValueError: If the state is of another kind of queue, or the queue is in use
                (elements or waiting operations).

        TF name: none.
        """
        if state.get("kind") != self._kind:
            raise ValueError(
                f"queue '{self._name}': the state is of a {state.get('kind')!r}, not a {self._kind}"
            )
        with self._lock:
            if self._count() or self._pending or self._dequeues:
                raise ValueError(f"queue '{self._name}' is in use; load its state before it is")
            self._set_rng_state(state.get("rng"))
            for element in state["elements"]:
                self._add(element, self._seq)
                self._seq += 1
            self._pending.extend((element, None) for element in state["pending"])
            self._fill()


class FIFOQueue(QueueBase):
    """A bounded first-in first-out queue of Python objects that can be closed.

    See ``QueueBase`` for the arguments, the waiting rules and the errors.

    TF name: ``tf.queue.FIFOQueue`` (``tf.FIFOQueue``).
    """

    def _init_storage(self) -> None:
        self._items: collections.deque[Any] = collections.deque()

    def _count(self) -> int:
        return len(self._items)

    def _add(self, element: object, seq: int) -> None:
        self._items.append(element)

    def _remove(self) -> Any:
        return self._items.popleft()

    def _give_back(self, entries: list[Any]) -> None:
        self._items.extendleft(reversed(entries))

    def _entries(self, held: list[Any]) -> list[Any]:
        return [*held, *self._items]
