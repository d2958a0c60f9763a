"""TF 1's batching: ``batch``, ``shuffle_batch``, their ``_join`` and ``maybe_`` forms.

Each builds a queue (``FIFOQueue``; ``PaddingFIFOQueue`` for ``dynamic_pad``;
``RandomShuffleQueue`` for the shuffling forms) and a ``QueueRunner`` in ``QUEUE_RUNNERS``
whose threads evaluate ``tensors`` and enqueue the example (or, with ``enqueue_many``, each row
of a batch of examples), and returns the dequeued batch as lazy values (``OpOutput`` s) shaped
like ``tensors``: ``sess.run(batch)``, or ``batch()``, dequeues one batch.

What ``tensors`` holds: tensors and other constants (enqueued again at every run, as in TF),
callables (a reader function, ``q.dequeue``), ``OpOutput`` s of other pipeline ops (those of
one op run once per example: ``slice_input_producer``'s outputs stay together). Numbers and
NumPy arrays become tensors; strings are batched as lists.

What comes back (TF's rules): a dict gives a dict; a list or tuple gives a list or tuple, but
one of a single element gives that element's batch alone; a single value gives its batch.
Batches are stacked tensors (``dynamic_pad``: zero-padded to the longest in the batch).

TF names: ``tf.compat.v1.train.batch``, ``batch_join``, ``shuffle_batch``,
``shuffle_batch_join``, ``maybe_batch``, ``maybe_batch_join``, ``maybe_shuffle_batch``,
``maybe_shuffle_batch_join``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchsupervisor.core.registry import get_default_graph
from torchsupervisor.input.batch_ops import build_batch
from torchsupervisor.input.queue import FIFOQueue, QueueBase
from torchsupervisor.input.queues import PaddingFIFOQueue, RandomShuffleQueue
from torchsupervisor.summary import ops as summary_ops

__all__ = [
    "batch",
    "batch_join",
    "maybe_batch",
    "maybe_batch_join",
    "maybe_shuffle_batch",
    "maybe_shuffle_batch_join",
    "shuffle_batch",
    "shuffle_batch_join",
]


def _fifo_queue(scope: str, capacity: int, dynamic_pad: bool) -> QueueBase:
    if dynamic_pad:
        queue: QueueBase = PaddingFIFOQueue(capacity, name=f"{scope}/padding_fifo_queue")
    else:
        queue = FIFOQueue(capacity, name=f"{scope}/fifo_queue")
    summary_ops.scalar(f"{scope}/fraction_of_{capacity}_full", lambda: queue.size() / capacity)
    return queue


def _shuffle_queue(
    scope: str, capacity: int, min_after_dequeue: int, seed: int | None
) -> RandomShuffleQueue:
    queue = RandomShuffleQueue(
        capacity, min_after_dequeue, seed=seed, name=f"{scope}/random_shuffle_queue"
    )
    room = capacity - min_after_dequeue
    summary_ops.scalar(
        f"{scope}/fraction_over_{min_after_dequeue}_of_{room}_full",
        lambda: max(0, queue.size() - min_after_dequeue) / room,
    )
    return queue


def _join_inputs(tensors_list: Sequence[Any], fn: str) -> list[Any]:
    inputs = list(tensors_list)
    if not inputs:
        raise ValueError(f"Expected at least one input in {fn}().")
    return inputs


def _check_threads(num_threads: int) -> int:
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive integer, got {num_threads!r}")
    return num_threads


def maybe_batch(
    tensors: Any,
    keep_input: Any,
    batch_size: int,
    num_threads: int = 1,
    capacity: int = 32,
    enqueue_many: bool = False,
    shapes: Sequence[Any] | None = None,
    dynamic_pad: bool = False,
    allow_smaller_final_batch: bool = False,
    shared_name: str | None = None,
    name: str | None = None,
) -> Any:
    """``batch``, enqueuing an example only where ``keep_input`` is true.

    Args:
        keep_input: Evaluated with each example (a bool, a 0-d bool tensor, or a callable
            or ``OpOutput`` giving one); with ``enqueue_many``, a vector keeps or drops each
            row. Other arguments: as ``batch``.

    Raises:
        ValueError: As ``batch``; at run time (reported to the coordinator) for a
            ``keep_input`` that is neither a scalar nor a vector of the batch's length.

    TF name: ``tf.compat.v1.train.maybe_batch``.
    """
    del shared_name
    scope = get_default_graph().unique_name(name or "batch")
    queue = _fifo_queue(scope, capacity, dynamic_pad)
    return build_batch(
        "batch",
        [tensors],
        keep_input,
        batch_size,
        _check_threads(num_threads),
        queue,
        enqueue_many,
        shapes,
        allow_smaller_final_batch,
    )


def batch(
    tensors: Any,
    batch_size: int,
    num_threads: int = 1,
    capacity: int = 32,
    enqueue_many: bool = False,
    shapes: Sequence[Any] | None = None,
    dynamic_pad: bool = False,
    allow_smaller_final_batch: bool = False,
    shared_name: str | None = None,
    name: str | None = None,
) -> Any:
    """Batch examples through a FIFO queue filled by ``num_threads`` threads.

    Args:
        tensors: One example (or, with ``enqueue_many``, a batch of examples along dimension
            0): a value, a list or tuple, or a dict of values (see the module docstring).
        batch_size: Examples per batch (> 0; may exceed ``capacity``).
        num_threads: Threads running the enqueue op (more than one: order not kept).
        capacity: The most examples the queue holds.
        enqueue_many: ``tensors`` is a batch: each row is one example.
        shapes: The shape of each component of one example (None sizes allowed with
            ``dynamic_pad``), checked at enqueue; None: not checked.
        dynamic_pad: Use a ``PaddingFIFOQueue``: examples of one component may differ in
            size; a batch pads them with zeros to the largest.
        allow_smaller_final_batch: Once the input ends, the last batch may be smaller than
            ``batch_size`` (``dequeue_up_to``), instead of its examples being dropped.
        shared_name: Accepted for TF's signature; unused.
        name: The name scope of the queue and its summary (made unique); None: ``batch``.

    Returns:
        The batch, shaped like ``tensors`` (see the module docstring), as ``OpOutput`` s:
        ``sess.run(result)`` or ``result()`` dequeues one batch; ``OutOfRangeError`` once the
        input ended and fewer than ``batch_size`` examples (none, with
        ``allow_smaller_final_batch``) are left. A summary
        ``<name>/fraction_of_<capacity>_full`` joins ``SUMMARIES``.

    Raises:
        ValueError: ``"Expected at least one tensor in batch()."``, a ``batch_size`` or
            ``num_threads`` that is not a positive integer, or a count of ``shapes`` that is
            not the count of tensors. At run time (the runner reports it to the coordinator):
            ``ValueError`` for an example that does not fit ``shapes``, or components of an
            ``enqueue_many`` batch of different lengths.

    TF name: ``tf.compat.v1.train.batch``.
    """
    return maybe_batch(
        tensors,
        None,
        batch_size,
        num_threads,
        capacity,
        enqueue_many,
        shapes,
        dynamic_pad,
        allow_smaller_final_batch,
        shared_name,
        name,
    )


def maybe_batch_join(
    tensors_list: Sequence[Any],
    keep_input: Any,
    batch_size: int,
    capacity: int = 32,
    enqueue_many: bool = False,
    shapes: Sequence[Any] | None = None,
    dynamic_pad: bool = False,
    allow_smaller_final_batch: bool = False,
    shared_name: str | None = None,
    name: str | None = None,
) -> Any:
    """``batch_join``, enqueuing an example only where ``keep_input`` is true.

    Args: as ``batch_join``, and ``keep_input`` as ``maybe_batch``.

    TF name: ``tf.compat.v1.train.maybe_batch_join``.
    """
    del shared_name
    inputs = _join_inputs(tensors_list, "batch_join")
    scope = get_default_graph().unique_name(name or "batch_join")
    queue = _fifo_queue(scope, capacity, dynamic_pad)
    return build_batch(
        "batch_join",
        inputs,
        keep_input,
        batch_size,
        1,
        queue,
        enqueue_many,
        shapes,
        allow_smaller_final_batch,
    )


def batch_join(
    tensors_list: Sequence[Any],
    batch_size: int,
    capacity: int = 32,
    enqueue_many: bool = False,
    shapes: Sequence[Any] | None = None,
    dynamic_pad: bool = False,
    allow_smaller_final_batch: bool = False,
    shared_name: str | None = None,
    name: str | None = None,
) -> Any:
    """Batch examples from several inputs of one structure, one thread per input.

    Args:
        tensors_list: The inputs (each as ``batch``'s ``tensors``; same keys or length).
        Other arguments: as ``batch``.

    Returns:
        The batch, shaped like ``tensors_list[0]``.

    Raises:
        ValueError: ``"Expected at least one input in batch_join()."``, inputs of different
            structures; as ``batch`` otherwise.

    TF name: ``tf.compat.v1.train.batch_join``.
    """
    return maybe_batch_join(
        tensors_list,
        None,
        batch_size,
        capacity,
        enqueue_many,
        shapes,
        dynamic_pad,
        allow_smaller_final_batch,
        shared_name,
        name,
    )


def maybe_shuffle_batch(
    tensors: Any,
    batch_size: int,
    capacity: int,
    min_after_dequeue: int,
    keep_input: Any,
    num_threads: int = 1,
    seed: int | None = None,
    enqueue_many: bool = False,
    shapes: Sequence[Any] | None = None,
    allow_smaller_final_batch: bool = False,
    shared_name: str | None = None,
    name: str | None = None,
) -> Any:
    """``shuffle_batch``, enqueuing an example only where ``keep_input`` is true.

    Args: as ``shuffle_batch``, and ``keep_input`` as ``maybe_batch``.

    TF name: ``tf.compat.v1.train.maybe_shuffle_batch``.
    """
    del shared_name
    scope = get_default_graph().unique_name(name or "shuffle_batch")
    queue = _shuffle_queue(scope, capacity, min_after_dequeue, seed)
    return build_batch(
        "shuffle_batch",
        [tensors],
        keep_input,
        batch_size,
        _check_threads(num_threads),
        queue,
        enqueue_many,
        shapes,
        allow_smaller_final_batch,
    )


def shuffle_batch(
    tensors: Any,
    batch_size: int,
    capacity: int,
    min_after_dequeue: int,
    num_threads: int = 1,
    seed: int | None = None,
    enqueue_many: bool = False,
    shapes: Sequence[Any] | None = None,
    allow_smaller_final_batch: bool = False,
    shared_name: str | None = None,
    name: str | None = None,
) -> Any:
    """Batch examples in random order through a ``RandomShuffleQueue``.

    Args:
        tensors: As ``batch``.
        batch_size: Examples per batch (> 0).
        capacity: The most examples the queue holds.
        min_after_dequeue: Examples left in the queue after a dequeue until the input ends:
            the shuffle buffer is ``min_after_dequeue + 1`` examples (see
            ``RandomShuffleQueue``); must be below ``capacity``.
        num_threads: Threads running the enqueue op; one gives the same order on every run
            with a ``seed`` (and an exact resume).
        seed: Seeds the queue's generator; None: a fresh seed.
        enqueue_many, shapes, allow_smaller_final_batch, shared_name: As ``batch``.
        name: The name scope (made unique); None: ``shuffle_batch``.

    Returns:
        The batch, shaped like ``tensors``, as ``batch``. A summary
        ``<name>/fraction_over_<min_after_dequeue>_of_<capacity - min_after_dequeue>_full``
        joins ``SUMMARIES``.

    Raises:
        ValueError: If ``min_after_dequeue`` is negative or not below ``capacity``; as
            ``batch`` otherwise.

    TF name: ``tf.compat.v1.train.shuffle_batch``.
    """
    return maybe_shuffle_batch(
        tensors,
        batch_size,
        capacity,
        min_after_dequeue,
        None,
        num_threads,
        seed,
        enqueue_many,
        shapes,
        allow_smaller_final_batch,
        shared_name,
        name,
    )


def maybe_shuffle_batch_join(
    tensors_list: Sequence[Any],
    batch_size: int,
    capacity: int,
    min_after_dequeue: int,
    keep_input: Any,
    seed: int | None = None,
    enqueue_many: bool = False,
    shapes: Sequence[Any] | None = None,
    allow_smaller_final_batch: bool = False,
    shared_name: str | None = None,
    name: str | None = None,
) -> Any:
    """``shuffle_batch_join``, enqueuing an example only where ``keep_input`` is true.

    Args: as ``shuffle_batch_join``, and ``keep_input`` as ``maybe_batch``.

    TF name: ``tf.compat.v1.train.maybe_shuffle_batch_join``.
    """
    del shared_name
    inputs = _join_inputs(tensors_list, "shuffle_batch_join")
    scope = get_default_graph().unique_name(name or "shuffle_batch_join")
    queue = _shuffle_queue(scope, capacity, min_after_dequeue, seed)
    return build_batch(
        "shuffle_batch_join",
        inputs,
        keep_input,
        batch_size,
        1,
        queue,
        enqueue_many,
        shapes,
        allow_smaller_final_batch,
    )


def shuffle_batch_join(
    tensors_list: Sequence[Any],
    batch_size: int,
    capacity: int,
    min_after_dequeue: int,
    seed: int | None = None,
    enqueue_many: bool = False,
    shapes: Sequence[Any] | None = None,
    allow_smaller_final_batch: bool = False,
    shared_name: str | None = None,
    name: str | None = None,
) -> Any:
    """Batch examples from several inputs in random order, one thread per input.

    Args: as ``batch_join`` and ``shuffle_batch``.

    Returns:
        The batch, shaped like ``tensors_list[0]``.

    Raises:
        ValueError: As ``batch_join`` and ``shuffle_batch``.

    TF name: ``tf.compat.v1.train.shuffle_batch_join``.
    """
    return maybe_shuffle_batch_join(
        tensors_list,
        batch_size,
        capacity,
        min_after_dequeue,
        None,
        seed,
        enqueue_many,
        shapes,
        allow_smaller_final_batch,
        shared_name,
        name,
    )
