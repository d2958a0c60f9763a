"""Proximal gradient descent (FOBOS) with L1/L2 regularization, with TF 1's semantics.

TF name: ``tf.compat.v1.train.ProximalGradientDescentOptimizer``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from torchsupervisor.training.optimizers._base import _TFOptimizer, check_l1_l2

__all__ = ["ProximalGradientDescentOptimizer"]


class ProximalGradientDescentOptimizer(_TFOptimizer):
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

    ``step()`` raises ``RuntimeError`` for a sparse gradient, before updating any parameter;
    parameters without a gradient are skipped. The optimizer keeps no per-parameter state.
    Parameters, dtypes and devices: as every optimizer of ``training/optimizers/``.

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
        super().__init__(params, defaults, name)

    @staticmethod
    def _check_options(group: dict[str, Any]) -> None:
        check_l1_l2(group)

    def _update(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        del state  # no per-parameter state
        lr = float(group["lr"])
        l1 = float(group["l1_regularization_strength"])
        l2 = float(group["l2_regularization_strength"])
        prox = param - lr * grad
        if l1 > 0.0:
            shrunk = torch.clamp_min(prox.abs() - lr * l1, 0.0)
            param.copy_(torch.sign(prox) * shrunk / (1.0 + lr * l2))
        else:
            param.copy_(prox / (1.0 + lr * l2))
