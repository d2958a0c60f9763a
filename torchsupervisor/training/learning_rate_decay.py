"""Learning-rate decay as functions of the global step, and a scheduler that follows the step.

Each schedule is a plain function of the step, with TF 1's formula, arguments and errors::

    lr = exponential_decay(0.1, global_step, 1000, 0.96)            # a float, for this step

To drive an optimizer, wrap the schedule in a ``GlobalStepLR``. It computes the learning rate
from the global step's *value*, not from a count of ``scheduler.step()`` calls, so a resumed
run continues with the learning rate of its restored step::

    step = GlobalStep()
    step.bind(optimizer)                                            # optimizer.step() adds 1
    scheduler = GlobalStepLR(
        optimizer, functools.partial(polynomial_decay, 0.1, decay_steps=10_000), step
    )
    ...
    optimizer.step()                                                # uses schedule(step)
    scheduler.step()                                                # optional, see GlobalStepLR

The same works with ``torch.optim.lr_scheduler.LambdaLR`` if the lambda ignores its epoch
argument and reads the step (the factor multiplies each group's initial learning rate)::

    LambdaLR(optimizer, lambda _: exponential_decay(1.0, step, 1000, 0.96))

but ``LambdaLR`` sets the learning rate only in ``scheduler.step()``; ``GlobalStepLR`` also
sets it right before each ``optimizer.step()``, which is what makes the first step after a
restore use the restored step's rate.

Arithmetic is IEEE double precision (TF computes in the dtype of ``learning_rate``, usually
float32): overflow gives ``inf`` and invalid operations ``nan``, as in TF, instead of Python
exceptions.

TF names: ``tf.compat.v1.train.exponential_decay``, ``inverse_time_decay``,
``natural_exp_decay``, ``piecewise_constant`` (alias ``piecewise_constant_decay``),
``polynomial_decay``.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.optim.lr_scheduler import LRScheduler

from torchsupervisor.core.global_step import (
    GlobalStep,
    check_step_source,
    get_global_step,
    read_step,
)
from torchsupervisor.errors import InvalidArgumentError

if TYPE_CHECKING:
    from torchsupervisor.core.global_step import GlobalStepLike

__all__ = [
    "GlobalStepLR",
    "exponential_decay",
    "inverse_time_decay",
    "natural_exp_decay",
    "piecewise_constant",
    "piecewise_constant_decay",
    "polynomial_decay",
]


# ------------------------------------------------------------------------------ arguments


def _number(value: object, what: str) -> float:
    """Return ``value`` (a real number or a one-element tensor/array) as a float."""
    if isinstance(value, GlobalStep):
        return float(value.value)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{what} must be a real scalar, got a tensor {value!r}")
        return float(value.item())
    if isinstance(value, np.ndarray | np.generic):
        if np.size(value) != 1 or not np.issubdtype(np.asarray(value).dtype, np.number):
            raise TypeError(f"{what} must be a real scalar, got an array {value!r}")
        return float(np.asarray(value).item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {type(value).__name__}: {value!r}")
    return float(value)


def _global_step(global_step: GlobalStepLike, fn_name: str) -> float:
    if global_step is None:
        raise ValueError(f"global_step is required for {fn_name}.")
    return _number(global_step, "global_step")


def _decay_steps(decay_steps: Any, fn_name: str) -> float:
    steps = _number(decay_steps, "decay_steps")
    if not steps > 0:
        raise InvalidArgumentError(
            f"decay_steps of {fn_name} must be positive, got {decay_steps!r}"
        )
    return steps


def _ieee(fn: Callable[[], Any]) -> float:
    """Evaluate numpy float64 arithmetic with IEEE results (inf, nan) and no warnings."""
    with np.errstate(all="ignore"):
        return float(fn())


# ------------------------------------------------------------------------------- schedules


_Curve = Callable[[np.float64, np.float64, np.float64], Any]


def _period_decay(curve: _Curve) -> Callable[..., float]:
    """Make a TF decay function of ``curve(learning_rate, decay_rate, periods)``.

    The result has TF's arguments ``(learning_rate, global_step, decay_steps, decay_rate,
    staircase=False, name=None)`` and ``curve``'s name and docstring. ``periods`` is
    ``global_step / decay_steps``, floored with ``staircase``; the arguments are checked
    first, and the errors name the function.
    """

    def decay(
        learning_rate: Any,
        global_step: GlobalStepLike,
        decay_steps: Any,
        decay_rate: Any,
        staircase: bool = False,
        name: str | None = None,
    ) -> float:
        del name
        fn = curve.__name__
        step = _global_step(global_step, fn)
        lr = _number(learning_rate, "learning_rate")
        steps = _decay_steps(decay_steps, fn)
        rate = _number(decay_rate, "decay_rate")
        periods = step / steps
        if staircase:
            periods = math.floor(periods)
        return _ieee(lambda: curve(np.float64(lr), np.float64(rate), np.float64(periods)))

    decay.__name__ = curve.__name__
    decay.__qualname__ = curve.__qualname__
    decay.__doc__ = curve.__doc__
    decay.__module__ = curve.__module__
    return decay


@_period_decay
def exponential_decay(lr: np.float64, rate: np.float64, periods: np.float64) -> Any:
    """Return the learning rate decayed exponentially at ``global_step``.

    ``learning_rate * decay_rate ** (global_step / decay_steps)``; with ``staircase`` the
    exponent is the integer division ``floor(global_step / decay_steps)``, so the rate drops
    every ``decay_steps`` steps.

    Args:
        learning_rate: The initial learning rate (a real number or one-element tensor).
        global_step: The step: a ``GlobalStep``, an int, or a one-element tensor. Must not be
            negative (not checked, as in TF).
        decay_steps: Steps per decay period; must be positive.
        decay_rate: The factor applied per period.
        staircase: Decay at discrete intervals instead of continuously.
        name: Unused (TF's op name).

    Returns:
        The decayed learning rate (float).

    Raises:
        ValueError: ``"global_step is required for exponential_decay."`` if it is None.
        InvalidArgumentError: If ``decay_steps`` is not positive (TF would divide by zero).
        TypeError: If an argument is not a real scalar.

    TF name: ``tf.compat.v1.train.exponential_decay``.
    """
    return lr * np.power(rate, periods)


@_period_decay
def inverse_time_decay(lr: np.float64, rate: np.float64, periods: np.float64) -> Any:
    """Return the learning rate decayed as ``1 / t`` at ``global_step`` (a float).

    ``learning_rate / (1 + decay_rate * global_step / decay_steps)``; with ``staircase`` the
    ratio ``global_step / decay_steps`` is floored. Arguments and errors as
    ``exponential_decay`` (the ValueError names ``inverse_time_decay``).

    TF name: ``tf.compat.v1.train.inverse_time_decay``.
    """
    return lr / (1.0 + rate * periods)


@_period_decay
def natural_exp_decay(lr: np.float64, rate: np.float64, periods: np.float64) -> Any:
    """Return the learning rate decayed as ``exp(-k t)`` at ``global_step`` (a float).

    ``learning_rate * exp(-decay_rate * global_step / decay_steps)``; with ``staircase`` the
    ratio ``global_step / decay_steps`` is floored. Arguments and errors as
    ``exponential_decay`` (the ValueError names ``natural_exp_decay``).

    TF name: ``tf.compat.v1.train.natural_exp_decay``.
    """
    return lr * np.exp(-rate * periods)


def polynomial_decay(
    learning_rate: Any,
    global_step: GlobalStepLike,
    decay_steps: Any,
    end_learning_rate: Any = 0.0001,
    power: Any = 1.0,
    cycle: bool = False,
    name: str | None = None,
) -> float:
    """Return the learning rate decayed polynomially to ``end_learning_rate`` at ``global_step``.

    Without ``cycle`` the step is capped at ``decay_steps``::

        step = min(global_step, decay_steps)
        lr = (learning_rate - end_learning_rate) * (1 - step / decay_steps) ** power
             + end_learning_rate

    so the rate reaches ``end_learning_rate`` at ``decay_steps`` and stays there. With
    ``cycle`` the period becomes the first multiple of ``decay_steps`` that is not smaller
    than the step (``decay_steps * ceil(global_step / decay_steps)``, and ``decay_steps`` itself
    at step 0): the rate reaches ``end_learning_rate`` at every multiple of ``decay_steps`` and
    jumps back up on the next step.

    Args:
        learning_rate: The initial learning rate.
        global_step: The step (``GlobalStep``, int, or one-element tensor).
        decay_steps: Steps to reach ``end_learning_rate``; must be positive.
        end_learning_rate: The final learning rate.
        power: The power of the polynomial (1.0: linear).
        cycle: Start over after every ``decay_steps`` steps instead of staying at the end.
        name: Unused (TF's op name).

    Returns:
        The decayed learning rate (float).

    Raises:
        ValueError: ``"global_step is required for polynomial_decay."`` if it is None.
        InvalidArgumentError: If ``decay_steps`` is not positive.
        TypeError: If an argument is not a real scalar.

    TF name: ``tf.compat.v1.train.polynomial_decay``.
    """
    del name
    step = _global_step(global_step, "polynomial_decay")
    lr = _number(learning_rate, "learning_rate")
    steps = _decay_steps(decay_steps, "polynomial_decay")
    end = _number(end_learning_rate, "end_learning_rate")
    exponent = _number(power, "power")
    if cycle:
        # The first multiple of decay_steps that is >= the step; 1 at step 0 (TF's rule).
        steps *= 1.0 if step == 0 else math.ceil(step / steps)
    else:
        step = min(step, steps)
    return _ieee(
        lambda: (np.float64(lr) - end) * np.power(1.0 - np.float64(step) / steps, exponent) + end
    )


def _tf_dtype(value: object) -> str:
    """Return the TF dtype name ``value`` would convert to (Python ints: int32 when they fit)."""
    if isinstance(value, GlobalStep):
        return "int64"
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    if isinstance(value, np.ndarray | np.generic):
        return np.asarray(value).dtype.name
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, numbers.Integral):
        return "int32" if -(2**31) <= int(value) < 2**31 else "int64"
    if isinstance(value, float):
        return "float32"
    raise TypeError(
        f"piecewise_constant takes numbers, GlobalSteps and scalar tensors; got "
        f"{type(value).__name__}: {value!r}"
    )


def _selectable(value: object) -> Any:
    """Return ``value`` with a one-element tensor or array turned into a Python number."""
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        size = value.numel() if isinstance(value, torch.Tensor) else np.size(value)
        if size != 1:
            raise TypeError(f"piecewise_constant takes scalars; got shape {tuple(value.shape)}")
        return value.item()
    return value


def piecewise_constant(
    x: object, boundaries: Sequence[Any], values: Sequence[Any], name: str | None = None
) -> Any:
    """Return the value of the interval of ``boundaries`` that contains ``x``.

    ``values[0]`` when ``x <= boundaries[0]``, ``values[i]`` when
    ``boundaries[i - 1] < x <= boundaries[i]``, ``values[-1]`` when ``x > boundaries[-1]``.
    E.g. ``piecewise_constant(step, [100000, 110000], [1.0, 0.5, 0.1])`` is 1.0 up to step
    100000, 0.5 up to 110000 and 0.1 after.

    Types follow TF's conversion rules: Python ints are ``int32`` (``int64`` when too large),
    Python floats ``float32``, a ``GlobalStep`` ``int64``, tensors keep their dtype. Every
    boundary must have the dtype of ``x`` (``int32`` boundaries are accepted for an ``int64``
    ``x``), and all values one dtype: ``[1, 0.5]`` is an error, write ``[1.0, 0.5]``.

    Args:
        x: The step or other scalar (``GlobalStep``, number, or one-element tensor).
        boundaries: Strictly increasing numbers or one-element tensors.
        values: One more entry than ``boundaries``.
        name: Unused (TF's op name).

    Returns:
        The selected entry of ``values`` (a one-element tensor is returned as a Python number).

    Raises:
        ValueError: With TF's texts: ``"Boundaries (<dtype: 'float32'>) must have the same
            dtype as x (<dtype: 'int64'>)."``, ``"Values must have elements all with the same
            dtype (<dtype: 'float32'> vs <dtype: 'int32'>)."``, ``"The length of boundaries
            should be 1 less than the length of values"``.
        InvalidArgumentError: If ``boundaries`` are not strictly increasing (TF's documented
            precondition, which TF only detects when ``x`` hits an ambiguous interval).
        TypeError: For an entry that is not a scalar.

    TF name: ``tf.compat.v1.train.piecewise_constant`` (alias ``piecewise_constant_decay``).
    """
    del name
    boundaries, values = list(boundaries), list(values)
    # TF checks the lengths when the schedule is built, the dtypes when it is evaluated.
    if len(boundaries) != len(values) - 1:
        raise ValueError("The length of boundaries should be 1 less than the length of values")
    x_dtype = _tf_dtype(x)
    for b in boundaries:
        b_dtype = _tf_dtype(b)
        if b_dtype != x_dtype and not (b_dtype == "int32" and x_dtype == "int64"):
            raise ValueError(
                f"Boundaries (<dtype: '{b_dtype}'>) must have the same dtype as x "
                f"(<dtype: '{x_dtype}'>)."
            )
    for v in values[1:]:
        if _tf_dtype(v) != _tf_dtype(values[0]):
            raise ValueError(
                "Values must have elements all with the same dtype "
                f"(<dtype: '{_tf_dtype(values[0])}'> vs <dtype: '{_tf_dtype(v)}'>)."
            )
    point = _selectable(x.value if isinstance(x, GlobalStep) else x)
    limits = [_selectable(b) for b in boundaries]
    for lower, upper in itertools.pairwise(limits):
        if not lower < upper:
            raise InvalidArgumentError(
                f"boundaries must be strictly increasing; got {lower!r} before {upper!r}"
            )
    for limit, value in zip(limits, values):
        if point <= limit:
            return _selectable(value)
    return _selectable(values[-1])


piecewise_constant_decay = piecewise_constant


# ------------------------------------------------------------------------------ scheduler

_NOT_SAVED = frozenset({"optimizer", "_lr_fns", "_global_step", "_pre_step_hook"})


class GlobalStepLR(LRScheduler):
    """A learning-rate scheduler that sets ``lr = fn(global_step)`` for every parameter group.

    The rate is a function of the global step's current value (``GlobalStep.value``), never
    of how many times ``scheduler.step()`` ran, so after the Supervisor restores the step
    (say to 5000) the run continues with ``fn(5000)``, exactly as a TF program whose
    learning rate is ``exponential_decay(..., global_step, ...)``.

    When the rate is set:

    - at construction (``fn`` of the current step);
    - right before every ``optimizer.step()`` (a step pre-hook; ``sync_before_step``), so the
      update that takes the step from ``s`` to ``s + 1`` always uses ``fn(s)``, even on the
      first step after a restore, whatever learning rate the restored optimizer state held.
      The optimizer keeps the hook (and this scheduler) until ``remove_hook()``;
    - at ``scheduler.step()`` (PyTorch's usual call after ``optimizer.step()``): ``fn`` of the
      step at that moment, i.e. the rate of the next update. Calling it is optional with
      ``sync_before_step``; it keeps ``get_last_lr()`` current.

    Args:
        optimizer: The optimizer whose ``param_groups[i]["lr"]`` are set.
        lr_fn: ``fn(step) -> float``, the absolute learning rate (not a factor), e.g.
            ``functools.partial(polynomial_decay, 0.1, decay_steps=10_000)`` or
            ``lambda s: piecewise_constant(s, [1000], [0.1, 0.01])``; or a list with one such
            function per parameter group. ``step`` is an int.
        global_step: A ``GlobalStep`` or an integer scalar tensor, read at every update. None:
            the default graph's global step (``get_global_step()``).
        sync_before_step: Also set the rate right before every ``optimizer.step()``.

    Raises:
        TypeError: If ``optimizer`` is not a ``torch.optim.Optimizer``, an ``lr_fn`` is not
            callable, or ``global_step`` is not a ``GlobalStep`` / integer tensor.
        ValueError: If a list of ``lr_fn`` does not have one per parameter group, or
            ``"global_step is required for GlobalStepLR."`` when there is none.

    ``state_dict()`` holds PyTorch's bookkeeping (``last_epoch``, ``base_lrs``, ...) but not
    the functions or the step, which stay those given to the constructor; the rate after
    ``load_state_dict`` comes from the (restored) global step at the next update.

    Thread safety: use from the training thread, like the optimizer.

    TF name: none; the role of passing a decayed ``learning_rate`` tensor to a TF optimizer.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_fn: Callable[[int], Any] | Sequence[Callable[[int], Any]],
        global_step: GlobalStepLike | None = None,
        *,
        sync_before_step: bool = True,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        groups = len(optimizer.param_groups)
        if isinstance(lr_fn, list | tuple):
            fns = list(lr_fn)
            if len(fns) != groups:
                raise ValueError(f"Expected {groups} lr functions, but got {len(fns)}")
        else:
            fns = [lr_fn] * groups
        for fn in fns:
            if not callable(fn):
                raise TypeError(f"lr_fn must be callable, got {type(fn).__name__}: {fn!r}")
        if global_step is None:
            global_step = get_global_step()
            if global_step is None:
                raise ValueError("global_step is required for GlobalStepLR.")
        check_step_source(global_step)
        self._lr_fns = fns
        self._global_step = global_step
        self._pre_step_hook = None
        super().__init__(optimizer)
        if sync_before_step:

            def _sync(_optimizer: Any, _args: object, _kwargs: object) -> None:
                self._set_lrs(self._compute())

            self._pre_step_hook = optimizer.register_step_pre_hook(_sync)

    @property
    def global_step(self) -> Any:
        """The ``GlobalStep`` (or tensor) the rate is computed from.

        TF name: none (TF passes ``global_step`` to the decay function).
        """
        return self._global_step

    def _compute(self) -> list[float]:
        step = read_step(self._global_step)
        return [float(fn(step)) for fn in self._lr_fns]

    def _set_lrs(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = lrs

    def get_lr(self) -> list[float]:
        """Return ``[fn(global_step) for each group]`` (called by ``step()``).

        TF name: none (``torch.optim.lr_scheduler.LRScheduler.get_lr``).
        """
        return self._compute()

    _get_closed_form_lr = get_lr

    def remove_hook(self) -> None:
        """Stop setting the rate before every ``optimizer.step()`` (``sync_before_step``).

        Idempotent.

        TF name: none (our addition).
        """
        if self._pre_step_hook is not None:
            self._pre_step_hook.remove()
            self._pre_step_hook = None

    def state_dict(self) -> dict[str, Any]:
        """Return PyTorch's scheduler bookkeeping (not the functions, the step or the hook).

        TF name: none (``torch.optim.lr_scheduler.LRScheduler.state_dict``).
        """
        return {k: v for k, v in self.__dict__.items() if k not in _NOT_SAVED}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the bookkeeping of ``state_dict()``; the rate still follows the global step.

        TF name: none (``torch.optim.lr_scheduler.LRScheduler.load_state_dict``).
        """
        self.__dict__.update({k: v for k, v in state_dict.items() if k not in _NOT_SAVED})
