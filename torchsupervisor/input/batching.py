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

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from torchsupervisor.core.registry import get_default_graph
from torchsupervisor.input.ops import evaluate, outputs
from torchsupervisor.input.queue import FIFOQueue, QueueBase
from torchsupervisor.input.queue_runner import QueueRunner, add_queue_runner
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


def _flatten(tensors: Any, fn: str) -> tuple[list[Any], list[Any]]:
    """Return (keys, leaves) of an example: a dict's sorted keys, a sequence's indices."""
    if isinstance(tensors, Mapping):
        keys = sorted(tensors)
        leaves = [tensors[k] for k in keys]
    elif isinstance(tensors, (list, tuple)):
        keys = list(range(len(tensors)))
        leaves = list(tensors)
    else:
        keys, leaves = [0], [tensors]
    if not leaves:
        raise ValueError(f"Expected at least one tensor in {fn}().")
    return keys, leaves


def _as_value(value: Any) -> Any:
    """A component as it is queued: numbers and NumPy arrays become tensors."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, (bool, int, float)):
        return torch.tensor(value)
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], (str, bytes)):
        try:
            return torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            return value
    return value


def _fits(value: Any, shape: Any) -> bool:
    if shape is None or not isinstance(value, torch.Tensor):
        return True
    shape = list(shape)
    return value.dim() == len(shape) and all(
        want is None or want == got for want, got in zip(shape, value.shape)
    )


def _keep(keep: Any, n: int | None) -> list[bool] | bool:
    if keep is None:
        return True
    if isinstance(keep, torch.Tensor):
        if keep.dim() == 0:
            return bool(keep)
        if n is None or keep.dim() != 1:
            raise ValueError("`keep_input` must be a scalar or a vector.")
        return [bool(k) for k in keep.tolist()]
    if isinstance(keep, (list, tuple)):
        return [bool(k) for k in keep]
    return bool(keep)


class _Enqueue:
    """The enqueue op of one input of a batching function: evaluate, check, enqueue."""

    def __init__(
        self,
        queue: QueueBase,
        leaves: list[Any],
        keep_input: Any,
        enqueue_many: bool,
        shapes: Sequence[Any] | None,
    ) -> None:
        self._queue = queue
        self._leaves = leaves
        self._keep_input = keep_input
        self._enqueue_many = enqueue_many
        self._shapes = shapes
        self.name = f"{queue.name}_enqueue"

    def pipeline_inputs(self) -> tuple[Any, ...]:
        """What this op evaluates (for ``InputPipelineState``)."""
        return (self._leaves, self._keep_input)

    def _check(self, example: tuple[Any, ...]) -> None:
        if self._shapes is None:
            return
        for i, (value, shape) in enumerate(zip(example, self._shapes)):
            if not _fits(value, shape):
                raise ValueError(
                    f"Shape mismatch in tuple component {i} of queue '{self._queue.name}'. "
                    f"Expected {list(shape)}, got {list(value.shape)}"
                )

    def check_constants(self) -> None:
        """Check the constant tensors against ``shapes`` now, as TF did when building."""
        rows = [
            (v[0] if self._enqueue_many and v.dim() else v) if isinstance(v, torch.Tensor) else None
            for v in self._leaves
        ]
        self._check(tuple(rows))

    def __call__(self) -> None:
        values, keep = evaluate((self._leaves, self._keep_input))
        components = [_as_value(v) for v in values]
        if not self._enqueue_many:
            example = tuple(components)
            self._check(example)
            if _keep(keep, None):
                self._queue.enqueue(example)
            return
        sizes = {len(c) for c in components}
        if len(sizes) != 1:
            raise ValueError(
                f"queue '{self._queue.name}': enqueue_many components differ in their first "
                f"dimension: {[len(c) for c in components]}"
            )
        rows = [tuple(c[i] for c in components) for i in range(sizes.pop())]
        for row in rows:
            self._check(row)
        mask = _keep(keep, len(rows))
        if isinstance(mask, list):
            if len(mask) != len(rows):
                raise ValueError(
                    f"keep_input has {len(mask)} entries for a batch of {len(rows)} examples"
                )
            rows = [row for row, k in zip(rows, mask) if k]
        elif not mask:
            rows = []
        if rows:
            self._queue.enqueue_many(rows)


class _Dequeue:
    """The dequeue op of a batching function: one batch, a tuple of components."""

    def __init__(self, queue: QueueBase, batch_size: int, up_to: bool) -> None:
        self._queue = queue
        self._batch_size = batch_size
        self._up_to = up_to
        self.name = f"{queue.name}_dequeue"

    def __call__(self) -> tuple[Any, ...]:
        if self._up_to:
            return self._queue.dequeue_up_to(self._batch_size)
        return self._queue.dequeue_many(self._batch_size)


def _check_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, torch.Tensor):
        batch_size = int(batch_size.item())
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return batch_size


def _build(
    fn: str,
    tensors_list: list[Any],
    keep_input: Any,
    batch_size: int,
    threads_per_input: int,
    queue: QueueBase,
    enqueue_many: bool,
    shapes: Sequence[Any] | None,
    allow_smaller_final_batch: bool,
) -> Any:
    batch_size = _check_batch_size(batch_size)
    keys, _ = _flatten(tensors_list[0], fn)
    ops: list[_Enqueue] = []
    for tensors in tensors_list:
        these_keys, leaves = _flatten(tensors, fn)
        if these_keys != keys:
            raise ValueError(f"{fn}(): every input must have the same structure (keys {keys})")
        if shapes is not None and len(shapes) != len(leaves):
            raise ValueError(f"{fn}(): {len(shapes)} shapes for {len(leaves)} tensors")
        op = _Enqueue(queue, leaves, keep_input, enqueue_many, shapes)
        op.check_constants()
        ops.extend([op] * threads_per_input)
    add_queue_runner(QueueRunner(queue, ops))
    dequeue = _Dequeue(queue, batch_size, allow_smaller_final_batch)
    return outputs(dequeue, tensors_list[0], keys)


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
    return _build(
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
    return _build(
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
    return _build(
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
    return _build(
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
