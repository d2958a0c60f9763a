"""TF 1's input producers: queues filled with the elements of an input, epoch after epoch.

``input_producer`` enqueues the rows of its input once per epoch (a new permutation each epoch
when ``shuffle``), ``num_epochs`` times, then closes the queue (``OutOfRangeError`` after the
last element); its ``QueueRunner`` joins ``QUEUE_RUNNERS``, so ``start_queue_runners``, the
Supervisor and ``MonitoredSession`` start it. ``string_input_producer`` (file names, say),
``range_input_producer`` (``0 .. limit-1``) and ``slice_input_producer`` (rows of several
tensors, together) are built on it. As TF, each adds a scalar summary of how full its queue
is (``<name>/fraction_of_<capacity>_full``) to the ``SUMMARIES`` collection.

Resumable: a producer's epochs and generator state are in ``InputPipelineState``; the rest of
the current epoch is in its queue's state.

TF names: ``tf.compat.v1.train.input_producer``, ``string_input_producer``,
``range_input_producer``, ``slice_input_producer``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from torchsupervisor.core.registry import get_default_graph
from torchsupervisor.errors import OutOfRangeError
from torchsupervisor.input.ops import OpOutput, OutputList
from torchsupervisor.input.queue import FIFOQueue
from torchsupervisor.input.queue_runner import QueueRunner, add_queue_runner
from torchsupervisor.summary import ops as summary_ops

__all__ = [
    "input_producer",
    "range_input_producer",
    "slice_input_producer",
    "string_input_producer",
]


def _rows(value: object, what: str) -> list[Any]:
    """The elements of an input: a tensor's rows (dimension 0), or a sequence's items."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(f"{what}: the input must have at least one dimension")
        return list(value.unbind(0))
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{what}: expected a tensor or a sequence, got {type(value).__name__}")
    return list(value)


def _generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


class _Producer:
    """The enqueue op of ``input_producer``: one epoch of elements per run.

    Its state is small whatever the input's size: the epochs started, the generator as it was
    before the current epoch's permutation (which it draws again on a restore), and how many
    elements of the epoch went to the queue (an element waiting for room is counted: the
    queue's state holds it).
    """

    def __init__(
        self,
        elements: list[Any],
        queue: FIFOQueue,
        num_epochs: int | None,
        shuffle: bool,
        seed: int | None,
    ) -> None:
        self._elements = elements
        self._queue = queue
        self._num_epochs = num_epochs
        self._shuffle = shuffle
        self._generator = _generator(seed)
        self._before_epoch = self._generator.get_state()
        self._epochs = 0
        self._order: list[int] = []
        self._position = 0
        self._lock = threading.Lock()
        self.name = f"{queue.name}_enqueue"

    def _draw_order(self) -> None:
        n = len(self._elements)
        self._order = (
            torch.randperm(n, generator=self._generator).tolist()
            if self._shuffle
            else list(range(n))
        )

    def _next(self) -> tuple[bool, Any]:
        with self._lock:
            if self._position >= len(self._order):
                return False, None
            element = self._elements[self._order[self._position]]
            self._position += 1  # Before the enqueue: a waiting element is the queue's.
            return True, element

    def __call__(self) -> None:
        with self._lock:
            if self._position >= len(self._order):
                if self._num_epochs is not None and self._epochs >= self._num_epochs:
                    raise OutOfRangeError(f"Reached limit of {self._num_epochs}")
                self._before_epoch = self._generator.get_state()
                self._draw_order()
                self._epochs += 1
                self._position = 0
        more, element = self._next()
        while more:
            self._queue.enqueue(element)
            more, element = self._next()

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"epochs", "rng" (before this epoch's permutation), "position"}``."""
        with self._lock:
            return {
                "epochs": self._epochs,
                "rng": self._before_epoch,
                "position": self._position,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the epochs, the generator and the position in the current epoch."""
        with self._lock:
            self._epochs = int(state["epochs"])
            self._generator.set_state(state["rng"])
            self._before_epoch = self._generator.get_state()
            self._order, self._position = [], 0
            if self._epochs:
                self._draw_order()  # The current epoch's permutation, drawn again.
                self._position = int(state["position"])


def input_producer(
    input_tensor: Any,
    element_shape: Sequence[int] | None = None,
    num_epochs: int | None = None,
    shuffle: bool = True,
    seed: int | None = None,
    capacity: int = 32,
    shared_name: str | None = None,
    summary_name: str | None = None,
    name: str | None = None,
    cancel_op: Callable[..., Any] | None = None,
) -> FIFOQueue:
    """Return a queue filled with the rows of ``input_tensor``, ``num_epochs`` times.

    Args:
        input_tensor: A tensor (its rows along dimension 0 are the elements), a NumPy array,
            or a sequence (its items).
        element_shape: The shape of one row, checked against a tensor's; None: not checked.
        num_epochs: Passes over the input; None: forever. After the last one the queue is
            closed: dequeues return what is left, then raise ``OutOfRangeError``.
        shuffle: A new random permutation of the rows each epoch.
        seed: Seeds the permutations (``torch.Generator``); None: a fresh seed.
        capacity: The most elements the queue holds.
        shared_name: Accepted for TF's signature; unused.
        summary_name: If given, a scalar summary ``<name>/<summary_name>`` of how full the
            queue is (a fraction) joins the ``SUMMARIES`` collection.
        name: The queue's name (made unique in the default graph); None: ``input_producer``.
        cancel_op: The runner's cancel op; None: close the queue cancelling pending enqueues.

    Returns:
        The ``FIFOQueue``; its ``QueueRunner`` (one thread) is in ``QUEUE_RUNNERS``.

    Raises:
        ValueError: For an empty input, a 0-d tensor, ``num_epochs`` < 1, or rows that do not
            have ``element_shape``.
        TypeError: If ``input_tensor`` is neither a tensor nor a sequence.

    TF name: ``tf.compat.v1.train.input_producer``.
    """
    del shared_name
    elements = _rows(input_tensor, "input_producer")
    if not elements:
        raise ValueError("input_producer: the input has no elements")
    if num_epochs is not None and num_epochs <= 0:
        raise ValueError(f"num_epochs must be > 0 not {num_epochs}.")
    if element_shape is not None and isinstance(input_tensor, (torch.Tensor, np.ndarray)):
        row_shape = list(input_tensor.shape[1:])
        if row_shape != list(element_shape):
            raise ValueError(
                f"input_producer: rows have shape {row_shape}, not element_shape "
                f"{list(element_shape)}"
            )
    scope = get_default_graph().unique_name(name or "input_producer")
    queue = FIFOQueue(capacity, name=scope)
    producer = _Producer(elements, queue, num_epochs, shuffle, seed)
    add_queue_runner(QueueRunner(queue, [producer], cancel_op=cancel_op))
    if summary_name is not None:
        summary_ops.scalar(f"{scope}/{summary_name}", lambda: queue.size() / capacity)
    return queue


def string_input_producer(
    string_tensor: object,
    num_epochs: int | None = None,
    shuffle: bool = True,
    seed: int | None = None,
    capacity: int = 32,
    shared_name: str | None = None,
    name: str | None = None,
    cancel_op: Callable[..., Any] | None = None,
) -> FIFOQueue:
    """Return a queue of strings (file names, typically), ``num_epochs`` passes over them.

    Args:
        string_tensor: A sequence of strings (``str`` or ``bytes``, dequeued as given).
        num_epochs, shuffle, seed, capacity, shared_name, cancel_op: As ``input_producer``.
        name: The queue's name; None: ``input_producer``.

    Returns:
        The ``FIFOQueue``; a summary ``<name>/fraction_of_<capacity>_full`` joins
        ``SUMMARIES``.

    Raises:
        ValueError: ``"string_input_producer requires a non-null input tensor"`` for an empty
            input; as ``input_producer`` otherwise.
        TypeError: If an element is not a string.

    TF name: ``tf.compat.v1.train.string_input_producer``.
    """
    if isinstance(string_tensor, (str, bytes)) or not string_tensor:
        raise ValueError("string_input_producer requires a non-null input tensor")
    strings = list(string_tensor)
    for s in strings:
        if not isinstance(s, (str, bytes)):
            raise TypeError(f"string_input_producer: expected strings, got {s!r}")
    return input_producer(
        strings,
        num_epochs=num_epochs,
        shuffle=shuffle,
        seed=seed,
        capacity=capacity,
        summary_name=f"fraction_of_{capacity}_full",
        name=name,
        cancel_op=cancel_op,
    )


def range_input_producer(
    limit: int,
    num_epochs: int | None = None,
    shuffle: bool = True,
    seed: int | None = None,
    capacity: int = 32,
    shared_name: str | None = None,
    name: str | None = None,
) -> FIFOQueue:
    """Return a queue of the integers ``0 .. limit-1`` (0-d int32 tensors), epoch after epoch.

    Args:
        limit: How many integers (> 0).
        num_epochs, shuffle, seed, capacity, shared_name: As ``input_producer``.
        name: The queue's name; None: ``input_producer``.

    Returns:
        The ``FIFOQueue``; a summary ``<name>/fraction_of_<capacity>_full`` joins
        ``SUMMARIES``.

    Raises:
        ValueError: If ``limit`` < 1; as ``input_producer`` otherwise.

    TF name: ``tf.compat.v1.train.range_input_producer``.
    """
    del shared_name
    if isinstance(limit, torch.Tensor):
        limit = int(limit.item())
    if limit < 1:
        raise ValueError(f"range_input_producer: limit must be at least 1, got {limit}")
    return input_producer(
        torch.arange(limit, dtype=torch.int32),
        num_epochs=num_epochs,
        shuffle=shuffle,
        seed=seed,
        capacity=capacity,
        summary_name=f"fraction_of_{capacity}_full",
        name=name,
    )


class _Slices:
    """The op of ``slice_input_producer``: one index dequeued, that row of every input."""

    def __init__(self, inputs: list[Any], queue: FIFOQueue) -> None:
        self._inputs = inputs
        self._queue = queue
        self.name = f"{queue.name}_slices"

    def __call__(self) -> tuple[Any, ...]:
        index = int(self._queue.dequeue())
        return tuple(t[index] for t in self._inputs)


def slice_input_producer(
    tensor_list: Sequence[Any],
    num_epochs: int | None = None,
    shuffle: bool = True,
    seed: int | None = None,
    capacity: int = 32,
    shared_name: str | None = None,
    name: str | None = None,
) -> OutputList:
    """Return one row of each input, together: the same row index for all of them.

    A ``range_input_producer`` over the row indices feeds the rows; the outputs, evaluated
    together (``sess.run(outputs)``, ``outputs()``, or as the input of ``batch``), dequeue one
    index and return that row of each input.

    Args:
        tensor_list: Tensors, NumPy arrays or sequences of equal length (dimension 0).
        num_epochs, shuffle, seed, capacity, shared_name: As ``input_producer``.
        name: The index queue's name; None: ``input_producer``.

    Returns:
        A list of ``OpOutput`` s, one per input (a list even for one input, as TF); calling
        the list evaluates them together.

    Raises:
        ValueError: ``"Expected at least one tensor in slice_input_producer()."``, or inputs
            of different lengths.

    TF name: ``tf.compat.v1.train.slice_input_producer``.
    """
    inputs = [torch.from_numpy(t) if isinstance(t, np.ndarray) else t for t in tensor_list]
    if not inputs:
        raise ValueError("Expected at least one tensor in slice_input_producer().")
    lengths = [len(t) for t in inputs]
    if len(set(lengths)) != 1:
        raise ValueError(
            f"slice_input_producer: the inputs differ in their first dimension: {lengths}"
        )
    queue = range_input_producer(lengths[0], num_epochs, shuffle, seed, capacity, shared_name, name)
    op = _Slices(inputs, queue)
    return OutputList(OpOutput(op, i) for i in range(len(inputs)))
