"""TF 1's other queues: ``RandomShuffleQueue``, ``PaddingFIFOQueue``, ``PriorityQueue``.

They share ``QueueBase``'s rules (capacity, closing, waiting in arrival order, resumable
state) and differ in which element leaves next or how a batch is made.

``RandomShuffleQueue`` differs from TF in one way, on purpose: which elements may leave next
does not depend on thread timing. TF picked among whatever had arrived, so a seeded
``shuffle_batch`` gave another order on every run. Here each dequeue picks uniformly among the
oldest ``min_after_dequeue + 1`` elements in the queue (fewer once the queue is closed and
running out), with the queue's own seeded generator: a shuffle buffer of
``min_after_dequeue + 1`` elements, as ``tf.data.Dataset.shuffle``. With a ``seed`` and one
enqueuing thread the order is the same on every run, and resumes exactly from a checkpoint.
When to wait is TF's: a dequeue waits until more than ``min_after_dequeue`` elements are in the
queue, unless it is closed.

TF names: ``tf.queue.RandomShuffleQueue``, ``tf.queue.PaddingFIFOQueue``,
``tf.queue.PriorityQueue``.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchsupervisor.core.clock import Clock
from torchsupervisor.input.elements import check_shapes, collate
from torchsupervisor.input.queue import FIFOQueue, QueueBase

__all__ = ["PaddingFIFOQueue", "PriorityQueue", "RandomShuffleQueue"]


class RandomShuffleQueue(QueueBase):
    """A queue whose dequeues take a random element among the oldest ones.

    Args:
        capacity: The most elements the queue holds (> 0).
        min_after_dequeue: Elements left in the queue after a dequeue (until it is closed):
            a dequeue waits for more; the pick is among the oldest ``min_after_dequeue + 1``.
        dtypes, shapes, names, shared_name: As ``QueueBase``.
        seed: Seeds the queue's generator (Python's ``random.Random``); None: a fresh seed.
        name: The queue's name; None: the kind's default (TF's).
        clock: Time source for ``timeout_secs``.

    Raises:
        ValueError: If ``capacity`` is not a positive integer, or ``min_after_dequeue`` is
            negative or not below ``capacity`` (no dequeue could ever be served).

    Thread safety: every method may be called from any thread.

    TF name: ``tf.queue.RandomShuffleQueue`` (``tf.RandomShuffleQueue``).
    """

    _kind = "RandomShuffleQueue"
    _default_name = "random_shuffle_queue"

    def __init__(
        self,
        capacity: int,
        min_after_dequeue: int,
        dtypes: Any = None,
        shapes: Any = None,
        names: Sequence[str] | None = None,
        seed: int | None = None,
        shared_name: str | None = None,
        name: str | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(capacity, dtypes, shapes, names, shared_name, name, clock=clock)
        if isinstance(min_after_dequeue, bool) or not isinstance(min_after_dequeue, int):
            raise ValueError(f"min_after_dequeue must be an int, got {min_after_dequeue!r}")
        if not 0 <= min_after_dequeue < capacity:
            raise ValueError(
                f"min_after_dequeue ({min_after_dequeue}) must be at least 0 and less than "
                f"capacity ({capacity})"
            )
        self._min_after_dequeue = min_after_dequeue
        self._rng = random.Random(seed)

    def _init_storage(self) -> None:
        self._items: list[tuple[int, Any]] = []  # (arrival number, element), oldest first

    @property
    def min_after_dequeue(self) -> int:
        """The elements a dequeue leaves in the queue until it is closed."""
        return self._min_after_dequeue

    def _count(self) -> int:
        return len(self._items)

    def _add(self, element: object, seq: int) -> None:
        self._items.append((seq, element))

    def _can_take(self) -> bool:
        size = len(self._items)
        return size > self._min_after_dequeue or (self._closed and size > 0)

    def _remove(self) -> Any:
        window = min(len(self._items), self._min_after_dequeue + 1)
        return self._items.pop(self._rng.randrange(window))

    def _element(self, entry: object) -> Any:
        return entry[1]

    def _give_back(self, entries: list[Any]) -> None:
        for entry in entries:
            bisect.insort(self._items, entry, key=lambda e: e[0])

    def _entries(self, held: list[Any]) -> list[Any]:
        return sorted([*held, *self._items], key=lambda e: e[0])

    def _rng_state(self) -> Any:
        return self._rng.getstate()

    def _set_rng_state(self, state: Any) -> None:
        if state is not None:
            version, internal, gauss = state
            self._rng.setstate((version, tuple(internal), gauss))


def _padded_stack(tensors: list[torch.Tensor], queue: str) -> torch.Tensor:
    ranks = {t.dim() for t in tensors}
    if len(ranks) != 1:
        raise ValueError(f"queue '{queue}': elements of one component differ in rank: {ranks}")
    shape = [max(sizes) for sizes in zip(*(t.shape for t in tensors))]
    out = tensors[0].new_zeros((len(tensors), *shape))
    for i, t in enumerate(tensors):
        out[(i, *(slice(0, n) for n in t.shape))] = t
    return out


def _components(element: object) -> list[Any]:
    if isinstance(element, tuple):
        return list(element)
    if isinstance(element, Mapping):
        return list(element.values())
    return [element]


class PaddingFIFOQueue(FIFOQueue):
    """A FIFO queue whose batches pad tensors of different shapes with zeros.

    ``dequeue_many``/``dequeue_up_to`` pad each tensor component to the largest size of
    each dimension in the batch (zeros at the end of each dimension), so that elements of
    variable length can be batched. ``dequeue`` returns an element as it was enqueued.

    Args:
        capacity: The most elements the queue holds (> 0).
        dtypes: As ``QueueBase``.
        shapes: One shape per component (a list of sizes, None for a size that varies), or
            None (any shape; only the rank must agree within a batch). Checked at enqueue.
        names, shared_name: As ``QueueBase``.
        name: The queue's name; None: the kind's default (TF's).
        clock: Time source for ``timeout_secs``.

    Raises:
        ValueError: If ``capacity`` is not a positive integer, or the number of shapes is not
            the number of ``dtypes``. ``enqueue`` raises ``ValueError`` for an element whose
            tensors do not fit ``shapes``.

    Thread safety: every method may be called from any thread.

    TF name: ``tf.queue.PaddingFIFOQueue`` (``tf.PaddingFIFOQueue``).
    """

    _kind = "PaddingFIFOQueue"
    _default_name = "padding_fifo_queue"

    def _init_storage(self) -> None:
        super()._init_storage()
        shapes = self._shapes_given
        if shapes is not None:
            shapes = [shapes] if self._num_components == 1 and _is_shape(shapes) else shapes
            if isinstance(self._dtypes, (list, tuple)) and len(shapes) != len(self._dtypes):
                raise ValueError(
                    f"queue '{self._name}': {len(shapes)} shapes for {len(self._dtypes)} dtypes"
                )
        self._shapes = None if shapes is None else [None if s is None else list(s) for s in shapes]

    def _check(self, element: object) -> Any:
        if self._shapes is None:
            return element
        components = _components(element)
        if len(components) != len(self._shapes):
            raise ValueError(
                f"queue '{self._name}' expects {len(self._shapes)} components, "
                f"got {len(components)}"
            )
        check_shapes(components, self._shapes, self._name)
        return element

    def _batch(self, elements: list[Any]) -> Any:
        return collate(elements, lambda tensors: _padded_stack(tensors, self._name))


def _is_shape(value: object) -> bool:
    return isinstance(value, (list, tuple, torch.Size)) and all(
        d is None or isinstance(d, int) for d in value
    )


def _priority(element: object, queue: str) -> int:
    if not isinstance(element, (tuple, list)) or not element:
        raise ValueError(
            f"queue '{queue}': an element is a tuple whose first component is its priority, "
            f"got {type(element).__name__}"
        )
    priority = element[0]
    if (
        isinstance(priority, torch.Tensor)
        and priority.numel() == 1
        and not priority.is_floating_point()
    ):
        return int(priority.item())
    if isinstance(priority, int) and not isinstance(priority, bool):
        return priority
    raise ValueError(f"queue '{queue}': a priority must be an integer scalar, got {priority!r}")


class PriorityQueue(QueueBase):
    """A queue whose dequeues take the element of the lowest priority first.

    An element is a tuple ``(priority, *components)``; the priority is an integer (a Python
    int or an integer scalar tensor). Elements of equal priority leave in arrival order.
    ``dequeue`` returns the tuple as enqueued; a batch is ``(priorities, *components)``
    batched (``priorities`` an int64 tensor).

    Args:
        capacity: The most elements the queue holds (> 0).
        types: The types of the components after the priority (their number is used by
            ``enqueue_many``); not checked.
        shapes, names, shared_name: As ``QueueBase``.
        name: The queue's name; None: the kind's default (TF's).
        clock: Time source for ``timeout_secs``.

    Raises:
        ValueError: If ``capacity`` is not a positive integer; ``enqueue`` raises
            ``ValueError`` for an element without an integer priority first.

    Thread safety: every method may be called from any thread.

    TF name: ``tf.queue.PriorityQueue`` (``tf.PriorityQueue``).
    """

    _kind = "PriorityQueue"
    _default_name = "priority_queue"

    def __init__(
        self,
        capacity: int,
        types: Any = None,
        shapes: Any = None,
        names: Sequence[str] | None = None,
        shared_name: str | None = None,
        name: str | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        components = [None, *types] if isinstance(types, (list, tuple)) else [None, None]
        super().__init__(capacity, components, shapes, names, shared_name, name, clock=clock)
        # Without types, an element is (priority, *components) of any length.
        self._declared = isinstance(types, (list, tuple))

    def _init_storage(self) -> None:
        self._heap: list[tuple[int, int, Any]] = []

    def _check(self, element: object) -> Any:
        _priority(element, self._name)
        return tuple(element)

    def _count(self) -> int:
        return len(self._heap)

    def _add(self, element: object, seq: int) -> None:
        heapq.heappush(self._heap, (_priority(element, self._name), seq, element))

    def _remove(self) -> Any:
        return heapq.heappop(self._heap)

    def _element(self, entry: object) -> Any:
        return entry[2]

    def _give_back(self, entries: list[Any]) -> None:
        for entry in entries:
            heapq.heappush(self._heap, entry)

    def _entries(self, held: list[Any]) -> list[Any]:
        return sorted([*held, *self._heap], key=lambda e: (e[0], e[1]))

    def _batch(self, elements: list[Any]) -> Any:
        priorities = torch.tensor([_priority(e, self._name) for e in elements], dtype=torch.int64)
        rest = [e[1:] for e in elements]
        return (priorities, *(collate(rest) if rest[0] else ()))
