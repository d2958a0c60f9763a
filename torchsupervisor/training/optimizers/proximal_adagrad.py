"""Proximal Adagrad: Adagrad's per-coordinate rate with the L1/L2 proximal step (TF 1).

TF name: ``tf.compat.v1.train.ProximalAdagradOptimizer``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from torchsupervisor.errors import InvalidArgumentError

__all__ = ["ProximalAdagradOptimizer"]


def _check(group: dict[str, Any]) -> None:
    if group["initial_accumulator_value"] <= 0.0:
        raise ValueError(
            f"initial_accumulator_value must be positive: {group['initial_accumulator_value']}"
        )
    for key in ("l1_regularization_strength", "l2_regularization_strength"):
        if group[key] < 0.0:
            raise InvalidArgumentError(f"{key} {group[key]:f} needs to be positive or zero")


class ProximalAdagradOptimizer(torch.optim.Optimizer):
    """Adagrad followed by the proximal step of L1 and L2 regularization, as TF computes it.

    For a parameter ``w`` with gradient ``g``, accumulator ``a`` (starts at
    ``initial_accumulator_value``) and learning rate ``lr``::

        a += g * g
        lr_t = lr / sqrt(a)                          # per coordinate
        v = w - lr_t * g
        w = sign(v) * max(|v| - lr_t * l1, 0) / (1 + lr_t * l2)

    (``w = v / (1 + lr_t * l2)`` when ``l1`` is 0). TF's documentation writes the shrinkage
    with ``lr``; its kernel, and this class, use the per-coordinate ``lr_t`` (TF's published
    test values, e.g. 10 steps from ``[1, 2]`` with ``g = [0.1, 0.2]``, ``lr = 3``,
    ``l1 = 0.001`` giving ``[-6.663634, -9.190331]``, are reproduced).

    Args:
        params: The parameters or parameter groups (a group may override ``lr`` and the
            options below under the same names).
        learning_rate: The learning rate (stored as each group's ``"lr"``).
        initial_accumulator_value: Start value of the accumulators; must be positive.
        l1_regularization_strength: ``l1`` >= 0.
        l2_regularization_strength: ``l2`` >= 0.
        use_locking: Accepted for TF's signature; no effect.
        name: A name for logs; the state key is always ``"accumulator"``.

    Raises:
        ValueError: ``"initial_accumulator_value must be positive: <value>"`` (TF's text).
        InvalidArgumentError: ``"l1_regularization_strength ... needs to be positive or
            zero"`` (or ``l2_``): documented by TF, checked here.

    ``step()`` raises ``RuntimeError`` for sparse gradients; parameters without a gradient are
    skipped. The accumulators are in ``state_dict()``.
    Parameters may have any shape, a floating dtype and any device; the update is computed
    elementwise in the parameter's dtype, and state tensors have the parameter's shape, dtype
    and device.

    Thread safety: like any ``torch.optim`` optimizer, use from one thread.

    TF name: ``tf.compat.v1.train.ProximalAdagradOptimizer``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        learning_rate: float,
        initial_accumulator_value: float = 0.1,
        l1_regularization_strength: float = 0.0,
        l2_regularization_strength: float = 0.0,
        use_locking: bool = False,
        name: str = "ProximalAdagrad",
    ) -> None:
        del use_locking
        defaults = {
            "lr": learning_rate,
            "initial_accumulator_value": initial_accumulator_value,
            "l1_regularization_strength": l1_regularization_strength,
            "l2_regularization_strength": l2_regularization_strength,
        }
        _check(defaults)
        self.name = name
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (its options are checked as the constructor's).

        Args:
            param_group: A dict with ``"params"`` and, optionally, options overriding the
                defaults.

        Raises:
            ValueError: ``"initial_accumulator_value must be positive: <value>"``; from
                ``torch.optim``, for a parameter already in another group.
            InvalidArgumentError: For a negative ``l1_`` or ``l2_regularization_strength``.
            TypeError: From ``torch.optim``, for ``params`` that are not tensors.

        TF name: none (``torch.optim.Optimizer.add_param_group``; TF's optimizers have no
        parameter groups).
        """
        if isinstance(param_group, dict):
            _check({**self.defaults, **param_group})
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply one proximal Adagrad update to every parameter with a gradient.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: For a sparse gradient (parameters before it are already updated).

        TF name: none (``torch.optim.Optimizer.step``; TF's
        ``tf.compat.v1.train.ProximalAdagradOptimizer.apply_gradients``).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = float(group["lr"])
            l1 = float(group["l1_regularization_strength"])
            l2 = float(group["l2_regularization_strength"])
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("ProximalAdagradOptimizer does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state["accumulator"] = torch.full_like(
                        param,
                        group["initial_accumulator_value"],
                        memory_format=torch.preserve_format,
                    )
                accumulator = state["accumulator"]
                accumulator.addcmul_(grad, grad)
                rate = lr * accumulator.rsqrt()
                prox = param - rate * grad
                if l1 > 0.0:
                    shrunk = torch.clamp_min(prox.abs() - rate * l1, 0.0)
                    param.copy_(torch.sign(prox) * shrunk / (1.0 + rate * l2))
                else:
                    param.copy_(prox / (1.0 + rate * l2))
        return loss
