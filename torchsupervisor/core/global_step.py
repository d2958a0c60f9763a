"""The global step: an integer counter that lives in the state and is saved with it.

TF names: the ``global_step`` variable, ``tf.train.get_global_step``,
``tf.train.get_or_create_global_step``, ``tf.train.create_global_step``,
``tf.train.global_step``, ``tf.train.assert_global_step``.
"""

from __future__ import annotations

import logging
import numbers
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from torchsupervisor.core.checks import check_str
from torchsupervisor.core.registry import Graph, GraphKeys, get_default_graph

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchsupervisor.core.session import SessionLike

__all__ = [
    "GlobalStep",
    "GlobalStepLike",
    "assert_global_step",
    "check_step_source",
    "create_global_step",
    "get_global_step",
    "get_or_create_global_step",
    "global_step",
    "read_checkpoint_step",
    "read_step",
]

logger = logging.getLogger("torchsupervisor")


GlobalStepLike: TypeAlias = "int | torch.Tensor | GlobalStep"
"""A global step as the API takes it: an int, a one-element integer tensor, or a ``GlobalStep``."""


class GlobalStep:
    """A 64-bit integer counter of training steps, saved in checkpoints.

    Put it in the state (``state={"global_step": gs, ...}``) or let the Supervisor find it in
    the ``GLOBAL_STEP`` collection. ``bind(optimizer)`` makes every ``optimizer.step()`` add 1,
    like passing ``global_step`` to TF's ``Optimizer.minimize``.

    Args:
        value: The initial value (int).
        name: The name used for summaries (``"<name>/sec"``) and in the state.

    Thread safety: reads are safe from any thread; increments are meant to come from the
    training thread (one writer), as in TF.

    TF name: the ``global_step`` variable (``tf.train.get_or_create_global_step()``).
    """

    __slots__ = ("__weakref__", "_gate", "_mirror", "_value", "name")

    def __init__(self, value: int = 0, name: str = "global_step") -> None:
        self._value = _as_int(value, "value")
        self.name = check_str("name", name, allow_empty=False)
        self._gate: Callable[[], object] | None = None
        self._mirror: Any = None

    @property
    def value(self) -> int:
        """The current step (int).

        TF name: ``tf.Variable.value`` (a method there; ``tf.compat.v1.train.global_step``
        reads it through a session).
        """
        return self._value

    def __int__(self) -> int:
        return self._value

    __index__ = __int__

    def __repr__(self) -> str:
        return f"GlobalStep(value={self._value}, name={self.name!r})"

    def increment(self, n: int = 1) -> int:
        """Add ``n`` to the step and return the new value.

        Args:
            n: Steps to add: an int or an integer scalar tensor.

        Returns:
            The step after the addition (int).

        Raises:
            TypeError: If ``n`` is not an integer (a float would make the step a float).

        TF name: ``tf.Variable.assign_add`` (on the ``global_step`` variable).
        """
        if type(n) is not int:
            n = _as_int(n, "n")
        gate = self._gate
        if gate is not None:
            gate()
        self._value += n
        if self._mirror is not None:
            self._mirror[0] = self._value
        return self._value

    def mirror_to(self, view: Any) -> None:
        """Write the step into ``view[0]`` at every change from now on (None: no more).

        ``view`` is a one-element writable buffer of signed 64-bit integers
        (``memoryview(mapped_file).cast("q")``): the goodput ledger's heartbeat, a page of a
        mapped file that outlives a killed process, so the next one knows exactly the step
        this one reached. Costs one store per step.

        TF name: none.
        """
        self._mirror = view
        if view is not None:
            view[0] = self._value

    def gate_increments(self, gate: Callable[[], object] | None) -> Callable[[], object] | None:
        """Call ``gate`` before every ``increment`` (None: no more); return the one replaced.

        The memory tier passes its wait for the snapshot being written: a step is counted
        only once the snapshot of the step before it is committed, so a process killed at
        any moment has lost at most the step it was running.

        TF name: none.
        """
        previous, self._gate = self._gate, gate
        return previous

    def assign(self, value: int) -> None:
        """Set the step to ``value`` (an int or an integer scalar tensor).

        Raises:
            TypeError: If ``value`` is not an integer or an integer scalar tensor.

        TF name: ``tf.Variable.assign`` (on the ``global_step`` variable).
        """
        self._value = _as_int(value, "value")
        if self._mirror is not None:
            self._mirror[0] = self._value

    def state_dict(self) -> dict[str, int]:
        """Return ``{"value": step}`` for checkpoints.

        TF name: none (PyTorch's ``state_dict`` protocol; TF's Saver reads the variable).
        """
        return {"value": self._value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the step from ``state_dict()`` output.

        Raises:
            KeyError: If ``"value"`` is missing.
            TypeError: If the value is not an integer.

        TF name: none (PyTorch's ``load_state_dict`` protocol; TF's Saver restores the
        variable).
        """
        self._value = _as_int(state_dict["value"], "state_dict['value']")
        if self._mirror is not None:
            self._mirror[0] = self._value

    def bind(self, optimizer: torch.optim.Optimizer) -> Any:
        """Increment this step by 1 after every ``optimizer.step()``.

        Args:
            optimizer: The optimizer whose ``step()`` counts as a training step.

        Returns:
            The hook handle; ``handle.remove()`` unbinds.

        TF name: none (TF passes ``global_step`` to ``tf.compat.v1.train.Optimizer.minimize``
        or ``apply_gradients``).
        """

        def _after_step(_opt: Any, _args: object, _kwargs: object) -> None:
            self._value += 1
            if self._mirror is not None:
                self._mirror[0] = self._value

        return optimizer.register_step_post_hook(_after_step)


def _as_int(value: object, what: str) -> int:
    if isinstance(value, torch.Tensor):
        dtype = value.dtype
        if value.numel() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"{what} must be an integer scalar, got a tensor {value!r}")
        return int(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}: {value!r}")
    return int(value)


def read_step(step: Any) -> int:
    """Return the integer value of a step given as a ``GlobalStep``, int or integer tensor.

    Raises:
        TypeError: For anything else.
    """
    if type(step) is GlobalStep or isinstance(step, GlobalStep):
        return step._value
    return _as_int(step, "global_step")


def read_checkpoint_step(global_step: GlobalStepLike) -> int | None:
    """Return the step a checkpoint records: ``read_step`` of ``global_step``, or None.

    Raises:
        TypeError: As ``read_step``.
        ValueError: For a negative step (a checkpoint records the steps taken, from 0), before
            anything is written.
    """
    if global_step is None:
        return None
    step = read_step(global_step)
    if step < 0:
        raise ValueError(f"global_step must be 0 or more to save a checkpoint, got {step}")
    return step


def check_step_source(global_step: GlobalStepLike) -> Any:
    """Return ``global_step`` if it is a ``GlobalStep`` or an integer scalar tensor.

    Raises:
        TypeError: For anything else, naming its type and value.
    """
    if not isinstance(global_step, GlobalStep | torch.Tensor):
        raise TypeError(
            "global_step must be a GlobalStep or an integer scalar tensor, got "
            f"{type(global_step).__name__}: {global_step!r}"
        )
    read_step(global_step)  # TypeError for a tensor that is not an integer scalar.
    return global_step


def assert_global_step(global_step_tensor: GlobalStepLike) -> None:
    """Check that ``global_step_tensor`` can serve as a global step.

    A ``GlobalStep`` or a scalar integer tensor qualifies.

    Raises:
        TypeError: With TF's texts, if it is of another kind, not an integer, or not a scalar.

    TF name: ``tf.compat.v1.train.assert_global_step``.
    """
    if isinstance(global_step_tensor, GlobalStep):
        return
    if not isinstance(global_step_tensor, torch.Tensor):
        raise TypeError(
            f'Existing "global_step" must be a Variable or Tensor: {global_step_tensor}.'
        )
    dtype = global_step_tensor.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f'Existing "global_step" does not have integer type: {dtype}')
    if global_step_tensor.dim() != 0:
        raise TypeError(f'Existing "global_step" is not scalar: {tuple(global_step_tensor.shape)}')


def get_global_step(graph: Graph | None = None) -> Any:
    """Return the global step of ``graph``'s ``GLOBAL_STEP`` collection, or None.

    Returns:
        The single item of the collection; None when the collection is empty, or (with an
        error logged, as TF) when it holds more than one item.

    Raises:
        TypeError: If the item is not a valid global step (see ``assert_global_step``).

    TF name: ``tf.compat.v1.train.get_global_step``.
    """
    graph = graph or get_default_graph()
    items = graph.get_collection(GraphKeys.GLOBAL_STEP)
    if not items:
        return None
    if len(items) > 1:
        logger.error("Multiple tensors in global_step collection.")
        return None
    assert_global_step(items[0])
    return items[0]


def create_global_step(graph: Graph | None = None) -> GlobalStep:
    """Create a ``GlobalStep`` at 0 and add it to the ``GLOBAL_STEP`` collection.

    Raises:
        ValueError: ``'"global_step" already exists.'`` if the graph has one.

    TF name: ``tf.compat.v1.train.create_global_step``.
    """
    graph = graph or get_default_graph()
    if get_global_step(graph) is not None:
        raise ValueError('"global_step" already exists.')
    step = GlobalStep()
    graph.add_to_collection(GraphKeys.GLOBAL_STEP, step)
    return step


def get_or_create_global_step(graph: Graph | None = None) -> Any:
    """Return the graph's global step, creating a ``GlobalStep`` when there is none.

    TF name: ``tf.compat.v1.train.get_or_create_global_step``.
    """
    graph = graph or get_default_graph()
    step = get_global_step(graph)
    return create_global_step(graph) if step is None else step


def global_step(sess: SessionLike, global_step_tensor: GlobalStepLike) -> int:
    """Return the value of ``global_step_tensor`` as an int.

    Args:
        sess: The session (unused in eager code; kept for TF's signature).
        global_step_tensor: A ``GlobalStep``, an int, or an integer scalar tensor.

    TF name: ``tf.compat.v1.train.global_step``.
    """
    del sess
    return read_step(global_step_tensor)
