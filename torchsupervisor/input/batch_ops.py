"""The ops behind TF 1's batching functions: evaluate an example, check it, enqueue it; dequeue
a batch; build both for a queue and return the batch shaped like the example.

``batching.py`` chooses the queue (FIFO, padding, random shuffle); everything else a batching
function does is here.

TF name: none (TF's ``_batch``/``_shuffle_batch`` internals).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from torchsupervisor.input.elements import check_shapes
from torchsupervisor.input.ops import evaluate, outputs
from torchsupervisor.input.queue import QueueBase
from torchsupervisor.input.queue_runner import QueueRunner, add_queue_runner

__all__ = ["build_batch"]


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


def _as_value(value: object) -> Any:
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
        if self._shapes is not None:
            check_shapes(example, self._shapes, self._queue.name)

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


def build_batch(
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
    """Add a runner filling ``queue`` from each input, and return the batch's outputs.

    Raises:
        ValueError: For a ``batch_size`` that is not a positive integer, inputs of different
            structures, an empty input (naming ``fn``), a count of ``shapes`` that is not the
            count of tensors, or a constant tensor that does not fit ``shapes``.
    """
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
