"""What a queue's element is: TF's list of components, shape checks, and batching.

An element is any object; a queue that declares its components (``dtypes``, a list of k)
takes a tuple or list of k (a list is TF's way to write the components: kept as a tuple), or,
with ``names``, a dict. ``collate`` batches elements per component; ``check_shapes`` checks
tensor components against declared shapes (``PaddingFIFOQueue``, the batching functions).

TF name: none (TF's queue kernels' component rules).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["as_element", "check_shapes", "collate"]


def as_element(vals: object, *, queue: str, components: int | None, named: bool) -> Any:
    """An element as queued.

    Args:
        vals: What was enqueued.
        queue: The queue's name, for the error.
        components: How many components the queue declares (``dtypes``); None: none.
        named: The queue has component ``names`` (a dict element is taken as it is).

    Returns:
        ``vals``; a tuple for a declared list of several components; the component itself
        for a declared list of one (TF: a list of the one component).

    Raises:
        ValueError: For a queue of several components, an element that is not a tuple or list
            of that many, naming the queue.
    """
    if named and isinstance(vals, Mapping):
        return vals
    if components is not None and components > 1:
        if not isinstance(vals, (tuple, list)) or len(vals) != components:
            got = (
                f"{len(vals)} components"
                if isinstance(vals, (tuple, list))
                else f"a {type(vals).__name__}"
            )
            raise ValueError(
                f"Queue '{queue}' has {components} components (dtypes): an element is a tuple "
                f"or list of {components}, got {got}"
            )
        return tuple(vals)
    if components is not None and isinstance(vals, (tuple, list)) and len(vals) == 1:
        return vals[0]
    return vals


def collate(elements: list[Any], stack: Callable[[list[Any]], Any] = torch.stack) -> Any:
    """Batch elements: tensors are stacked; tuples and dicts per component; others listed.

    Args:
        elements: The elements (at least one).
        stack: Batches the tensors of one component (``PaddingFIFOQueue`` pads them).

    Raises:
        RuntimeError: From ``torch.stack`` if tensors of one component differ in shape.
    """
    first = elements[0]
    if all(isinstance(e, torch.Tensor) for e in elements):
        return stack(elements)
    if isinstance(first, tuple) and all(
        isinstance(e, tuple) and len(e) == len(first) for e in elements
    ):
        return tuple(collate(list(column), stack) for column in zip(*elements))
    if isinstance(first, Mapping) and all(isinstance(e, Mapping) for e in elements):
        return {key: collate([e[key] for e in elements], stack) for key in first}
    return list(elements)


def check_shapes(components: Sequence[Any], shapes: Sequence[Any], queue: str) -> None:
    """Check each tensor component against its shape (None sizes match any; a None shape or a
    non-tensor component is not checked).

    Raises:
        ValueError: ``"Shape mismatch in tuple component <i> of queue '<queue>'. Expected
            [...], got [...]"``.
    """
    for i, (value, shape) in enumerate(zip(components, shapes)):
        if shape is None or not isinstance(value, torch.Tensor):
            continue
        shape = list(shape)
        fits = value.dim() == len(shape) and all(
            want is None or want == got for want, got in zip(shape, value.shape)
        )
        if not fits:
            raise ValueError(
                f"Shape mismatch in tuple component {i} of queue '{queue}'. "
                f"Expected {shape}, got {list(value.shape)}"
            )
