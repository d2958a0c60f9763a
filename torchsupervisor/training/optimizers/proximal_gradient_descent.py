"""Proximal gradient descent (FOBOS) with L1/L2 regularization, with TF 1's semantics.

TF name: ``tf.compat.v1.train.ProximalGradientDescentOptimizer``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from torchsupervisor.errors import InvalidArgumentError

__all__ = ["ProximalGradientDescentOptimizer"]


def _check(group: dict[str, Any]) -> None:
    for key in ("l1_regularization_strength", "l2_regularization_strength"):
        if group[key] < 0.0:
            raise InvalidArgumentError(f"{key} {group[key]:f} needs to be positive or zero")


class ProximalGradientDescentOptimizer(torch.optim.Optimizer):
    """Gradient descent followed by the proximal step of L1 and L2 regularization.

    For a parameter ``w`` with gradient ``g`` and learning rate ``lr``::

        v = w - lr * g
        w = sign(v) * max(|v| - lr * l1, 0) / (1 + lr * l2)

    (``w = v / (1 + lr * l2)`` when ``l1`` is 0). L1 sets small weights exactly to zero.

    Args:
        params: The parameters or parameter groups (a group may override ``lr`` and the
            options below under the same names).
        learning_rate: The learning rate (stored as each group's ``"lr"``).
        l1_regularization_strength: ``l1`` >= 0.
        l2_regularization_strength: ``l2`` >= 0.
        use_locking: Accepted for TF's signature; no effect.
        name: A name for logs.

    Raises:
        InvalidArgumentError: ``"l1_regularization_strength -1.000000 needs to be positive or
            zero"`` (or ``l2_``): TF documents the constraint without checking it; here it is
            checked for the defaults and every parameter group.

    ``step()`` raises ``RuntimeError`` for sparse gradients; parameters without a gradient are
    skipped. The optimizer keeps no per-parameter state.
    Parameters may have any shape, a floating dtype and any device; the update is computed
    elementwise in the parameter's dtype, and state tensors have the parameter's shape, dtype
    and device.

    Thread safety: like any ``torch.optim`` optimizer, use from one thread.

    TF name: ``tf.compat.v1.train.ProximalGradientDescentOptimizer``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        learning_rate: float,
        l1_regularization_strength: float = 0.0,
        l2_regularization_strength: float = 0.0,
        use_locking: bool = False,
        name: str = "ProximalGradientDescent",
    ) -> None:
        del use_locking
        defaults = {
            "lr": learning_rate,
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
            InvalidArgumentError: For a negative ``l1_`` or ``l2_regularization_strength``.
            ValueError: From ``torch.optim``, for a parameter already in another group.
            TypeError: From ``torch.optim``, for ``params`` that are not tensors.

        TF name: none (``torch.optim.Optimizer.add_param_group``; TF's optimizers have no
        parameter groups).
        """
        if isinstance(param_group, dict):
            _check({**self.defaults, **param_group})
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply one proximal gradient descent update to every parameter with a gradient.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: For a sparse gradient (parameters before it are already updated).

        TF name: none (``torch.optim.Optimizer.step``; TF's
        ``tf.compat.v1.train.ProximalGradientDescentOptimizer.apply_gradients``).
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
                    raise RuntimeError(
                        "ProximalGradientDescentOptimizer does not support sparse gradients"
                    )
                prox = param - lr * grad
                if l1 > 0.0:
                    shrunk = torch.clamp_min(prox.abs() - lr * l1, 0.0)
                    param.copy_(torch.sign(prox) * shrunk / (1.0 + lr * l2))
                else:
                    param.copy_(prox / (1.0 + lr * l2))
        return loss
