"""Lazy values of an input pipeline: an op's outputs, and ``limit_epochs``.

In TF 1 an input pipeline was a graph: ``batch`` returned tensors that each ``sess.run``
evaluated anew by dequeuing a batch. Here such a value is an ``OpOutput``: a callable that runs
its op and picks its part of the result. Outputs of one op evaluated together (in one
``sess.run([images, labels])``, or in one element of an enqueue op) share a single run of the
op: one dequeue, whose parts stay together. An output called on its own runs its op alone.

An enqueue op evaluates its input structure with ``evaluate``: callables (and outputs) are
called, tensors and other constants are taken as they are, so a constant tensor is enqueued
again at each run, as in TF.

TF names: ``tf.Tensor`` (an op's output), ``tf.compat.v1.train.limit_epochs``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchsupervisor.core.session import evaluate_fetches
from torchsupervisor.errors import OutOfRangeError

if TYPE_CHECKING:
    import torch

__all__ = ["OpOutput", "evaluate", "limit_epochs", "outputs", "py_func"]


def evaluate(structure: object) -> Any:
    """Evaluate an input structure once: shared ops run once, constants are kept.

    Raises:
        Exception: Whatever an evaluated callable raises (``OutOfRangeError`` at the end of
            an input).
    """
    return evaluate_fetches(structure, constants=True)


class OpOutput:
    """One output of an op: calling it runs the op and returns this output's part.

    Args:
        op: A zero-argument callable returning a sequence or mapping of outputs.
        index: This output's index or key in what ``op`` returns.

    Thread safety: as thread-safe as ``op``.

    TF name: ``tf.Tensor`` (output ``index`` of an op).
    """

    __slots__ = ("_index", "output_of")

    def __init__(self, op: Callable[[], Any], index: Any) -> None:
        self.output_of = op
        self._index = index

    def select(self, value: object) -> Any:
        """Pick this output from the op's result."""
        return value[self._index]

    def __call__(self) -> Any:
        return self.select(self.output_of())

    def __repr__(self) -> str:
        op = getattr(self.output_of, "name", type(self.output_of).__name__)
        return f"OpOutput(op={op!r}, index={self._index!r})"


class _Outputs:
    """A container of outputs that is also callable: ``batch(...)()`` runs the op once."""

    _plain: type = object

    def __call__(self) -> Any:
        return evaluate(self._plain(self))  # A plain container: not called again.


class OutputList(_Outputs, list):
    """A list of ``OpOutput`` s; calling it evaluates them together (one run of their op)."""

    _plain = list


class OutputTuple(_Outputs, tuple):
    """A tuple of ``OpOutput`` s; calling it evaluates them together."""

    _plain = tuple


class OutputDict(_Outputs, dict):
    """A dict of ``OpOutput`` s; calling it evaluates them together."""

    _plain = dict


def outputs(op: Callable[[], Any], like: Any, keys: list[Any]) -> Any:
    """Return ``op``'s outputs shaped like ``like`` (TF's rules for ``batch``'s result).

    ``op`` returns a tuple with one entry per key of ``keys`` (the flattened ``like``). A
    dict gives a dict; a list or tuple of one element gives the single output (TF: "a list
    of one element ... returns a tensor, not a list"); a longer list or tuple gives the same
    container; anything else is one value and gives one output.
    """
    parts = [OpOutput(op, i) for i in range(len(keys))]
    if isinstance(like, dict):
        return OutputDict(zip(keys, parts))
    if isinstance(like, (list, tuple)):
        if len(parts) == 1:
            return parts[0]
        return OutputTuple(parts) if isinstance(like, tuple) else OutputList(parts)
    return parts[0]


class _LimitEpochs:
    """The op of ``limit_epochs``: its value, at most ``num_epochs`` times."""

    def __init__(self, tensor: torch.Tensor, num_epochs: int, name: str) -> None:
        self._tensor = tensor
        self._num_epochs = num_epochs
        self._epochs = 0
        self._lock = threading.Lock()
        self.name = name

    def __call__(self) -> Any:
        with self._lock:
            if self._epochs >= self._num_epochs:
                raise OutOfRangeError(f"Reached limit of {self._num_epochs}")
            self._epochs += 1
        return evaluate(self._tensor)

    def pipeline_inputs(self) -> tuple[Any, ...]:
        """What this op evaluates (for ``InputPipelineState``)."""
        return (self._tensor,)

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"epochs": times the value was produced}``."""
        with self._lock:
            return {"epochs": self._epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set the count of times the value was produced."""
        with self._lock:
            self._epochs = int(state["epochs"])


def limit_epochs(
    tensor: torch.Tensor, num_epochs: int | None = None, name: str | None = None
) -> Any:
    """Return a value that yields ``tensor`` ``num_epochs`` times, then ``OutOfRangeError``.

    Args:
        tensor: The value: a tensor (or any constant), or a callable evaluated at each use.
        num_epochs: How many times; None: ``tensor`` itself is returned (no limit).
        name: The op's name (in messages).

    Returns:
        ``tensor`` if ``num_epochs`` is None, else a callable op: each call returns
        ``tensor``'s value and counts one epoch; the call after the last raises
        ``OutOfRangeError("Reached limit of <num_epochs>")``. Its count is resumable
        (``state_dict``), and ``InputPipelineState`` saves it with the pipeline using it.

    Raises:
        ValueError: ``"num_epochs must be > 0 not <n>."``.

    TF name: ``tf.compat.v1.train.limit_epochs``.
    """
    if num_epochs is None:
        return tensor
    if num_epochs <= 0:
        raise ValueError(f"num_epochs must be > 0 not {num_epochs}.")
    return _LimitEpochs(tensor, num_epochs, name or "limit_epochs")


class _PyFunc:
    """The op of ``py_func``: its inputs evaluated, the function called once."""

    def __init__(self, func: Callable[..., Any], inp: list[Any], count: int | None, name: str):
        self._func = func
        self._inp = inp
        self._count = count
        self.name = name

    def pipeline_inputs(self) -> tuple[Any, ...]:
        """What this op evaluates (for ``InputPipelineState``)."""
        return (self._inp,)

    def __call__(self) -> tuple[Any, ...]:
        result = self._func(*evaluate(self._inp))
        if self._count is None:
            return (result,)
        if not isinstance(result, (list, tuple)) or len(result) != self._count:
            raise ValueError(
                f"py_func '{self.name}': {getattr(self._func, '__name__', self._func)!r} must "
                f"return {self._count} values, got {result!r:.100}"
            )
        return tuple(result)


def py_func(
    func: Callable[..., Any],
    inp: list[Any],
    Tout: Any,
    stateful: bool = True,
    name: str | None = None,
) -> Any:
    """Wrap a Python function as an op of an input pipeline (a reader, a decoder).

    The outputs are lazy: each evaluation (one example of an enqueue op, one ``sess.run``)
    evaluates ``inp`` (callables such as ``filename_queue.dequeue`` are called, constants
    kept), calls ``func(*inp)`` once, and gives each output its part of the result::

        image, label = ts.py_func(read_file, [filename_queue.dequeue], [torch.uint8, torch.int64])
        images, labels = ts.shuffle_batch([image, label], 32, 1000, 100)

    Args:
        func: Called with the evaluated ``inp``; returns ``len(Tout)`` values if ``Tout`` is
            a list or tuple, else one value.
        inp: The inputs (a list).
        Tout: The output types: a list or tuple gives that many outputs; a single type gives
            one. Types are not checked.
        stateful: Accepted for TF's signature (every call runs ``func``).
        name: The op's name (in messages).

    Returns:
        A list of ``OpOutput`` s (``Tout`` a list or tuple; calling the list evaluates them
        together), or one ``OpOutput``.

    Raises:
        ValueError: At evaluation, if ``func`` returns another number of values.

    TF name: ``tf.compat.v1.py_func``.
    """
    del stateful
    count = len(Tout) if isinstance(Tout, (list, tuple)) else None
    op = _PyFunc(func, list(inp), count, name or getattr(func, "__name__", "py_func"))
    if count is None:
        return OpOutput(op, 0)
    return OutputList(OpOutput(op, i) for i in range(count))
