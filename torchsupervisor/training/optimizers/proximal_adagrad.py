"""Proximal Adagrad: Adagrad's per-coordinate rate with the L1/L2 proximal step (TF 1).

TF name: ``tf.compat.v1.train.ProximalAdagradOptimizer``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from torchsupervisor.training.optimizers._base import _TFOptimizer, check_l1_l2

__all__ = ["ProximalAdagradOptimizer"]


class ProximalAdagradOptimizer(_TFOptimizer):
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

    ``step()`` raises ``RuntimeError`` for a sparse gradient, before updating any parameter;
    parameters without a gradient are skipped. The accumulators are in ``state_dict()``.
    Parameters, dtypes and devices: as every optimizer of ``training/optimizers/``.

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
        super().__init__(params, defaults, name)

    @staticmethod
    def _check_options(group: dict[str, Any]) -> None:
        if group["initial_accumulator_value"] <= 0.0:
            raise ValueError(
                f"initial_accumulator_value must be positive: {group['initial_accumulator_value']}"
            )
        check_l1_l2(group)

    def _initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        value = group["initial_accumulator_value"]
        return {"accumulator": torch.full_like(param, value, memory_format=torch.preserve_format)}

    def _update(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        lr = float(group["lr"])
        l1 = float(group["l1_regularization_strength"])
        l2 = float(group["l2_regularization_strength"])
        accumulator = state["accumulator"]
        accumulator.addcmul_(grad, grad)
        rate = lr * accumulator.rsqrt()
        prox = param - rate * grad
        if l1 > 0.0:
            shrunk = torch.clamp_min(prox.abs() - rate * l1, 0.0)
            param.copy_(torch.sign(prox) * shrunk / (1.0 + rate * l2))
        else:
            param.copy_(prox / (1.0 + rate * l2))
