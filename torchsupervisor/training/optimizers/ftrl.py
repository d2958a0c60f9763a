"""FTRL-Proximal, the optimizer of large sparse linear models, with TF 1's semantics.

TF name: ``tf.compat.v1.train.FtrlOptimizer``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from torchsupervisor.training.optimizers._base import _TFOptimizer

__all__ = ["FtrlOptimizer"]


class FtrlOptimizer(_TFOptimizer):
    """Follow-the-regularized-leader (FTRL-Proximal) with TF's update rule.

    For a parameter ``w`` with gradient ``g``, accumulators ``n`` (starts at
    ``initial_accumulator_value``) and ``z`` (starts at 0), ``lr`` the learning rate, ``p`` the
    ``learning_rate_power``, ``l2' = l2 + beta / (2 * lr)``::

        g_s = g + 2 * l2_shrinkage * w
        n_new = n + g * g
        z += g_s - (n_new ** -p - n ** -p) / lr * w
        quadratic = 1 / (n_new ** p * lr) + 2 * l2'
        w = (sign(z) * l1 - z) / quadratic   if |z| > l1   else 0
        n = n_new

    With ``p = -0.5`` and no regularization this is Adagrad; with ``p = 0``, gradient descent
    (for weights that start at 0).

    Args:
        params: The parameters or parameter groups (as for any ``torch.optim`` optimizer;
            a group may override any of the options below, under the same names, and ``lr``).
        learning_rate: The learning rate (stored as each group's ``"lr"``, so schedulers
            work).
        learning_rate_power: How the per-coordinate rate decreases; <= 0 (0: fixed rate).
        initial_accumulator_value: Start value of ``n``; >= 0.
        l1_regularization_strength: ``l1`` >= 0.
        l2_regularization_strength: ``l2`` >= 0 (the stabilizing, "online" L2).
        use_locking: Accepted for TF's signature; no effect (updates run on the calling
            thread).
        name: A name for logs; the state keys are always ``"accum"`` (``n``) and ``"linear"``
            (``z``).
        accum_name: Accepted for TF's signature (slot names); no effect.
        linear_name: Accepted for TF's signature (slot names); no effect.
        l2_shrinkage_regularization_strength: ``l2_shrinkage`` >= 0, an L2 penalty on the
            weights' magnitude added to the gradient.
        beta: The paper's ``beta`` (None: 0), folded into ``l2'`` as TF does.

    Raises:
        ValueError: With TF's texts, e.g. ``"learning_rate_power 0.500000 needs to be negative
            or zero"``, ``"initial_accumulator_value -0.100000 needs to be positive or zero"``,
            ``"l1_regularization_strength ... needs to be positive or zero"`` (also ``l2_`` and
            ``l2_shrinkage_``), for the defaults or a parameter group.

    ``step()`` raises ``RuntimeError`` for a sparse gradient, before updating any parameter.
    Parameters without a gradient are skipped. The state (``accum``, ``linear`` per parameter)
    is in ``state_dict()``.
    Parameters, dtypes and devices: as every optimizer of ``training/optimizers/``.

    Thread safety: like any ``torch.optim`` optimizer, use from one thread.

    TF name: ``tf.compat.v1.train.FtrlOptimizer``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        learning_rate: float,
        learning_rate_power: float = -0.5,
        initial_accumulator_value: float = 0.1,
        l1_regularization_strength: float = 0.0,
        l2_regularization_strength: float = 0.0,
        use_locking: bool = False,
        name: str = "Ftrl",
        accum_name: str | None = None,
        linear_name: str | None = None,
        l2_shrinkage_regularization_strength: float = 0.0,
        beta: float | None = None,
    ) -> None:
        del use_locking, accum_name, linear_name
        defaults = {
            "lr": learning_rate,
            "learning_rate_power": learning_rate_power,
            "initial_accumulator_value": initial_accumulator_value,
            "l1_regularization_strength": l1_regularization_strength,
            "l2_regularization_strength": l2_regularization_strength,
            "l2_shrinkage_regularization_strength": l2_shrinkage_regularization_strength,
            "beta": 0.0 if beta is None else beta,
        }
        super().__init__(params, defaults, name)

    @staticmethod
    def _check_options(group: dict[str, Any]) -> None:
        """Raise TF's ValueError for an invalid hyper-parameter of ``group``."""
        if group["initial_accumulator_value"] < 0.0:
            raise ValueError(
                f"initial_accumulator_value {group['initial_accumulator_value']:f} needs to be "
                "positive or zero"
            )
        if group["learning_rate_power"] > 0.0:
            raise ValueError(
                f"learning_rate_power {group['learning_rate_power']:f} needs to be negative or zero"
            )
        for key in (
            "l1_regularization_strength",
            "l2_regularization_strength",
            "l2_shrinkage_regularization_strength",
        ):
            if group[key] < 0.0:
                raise ValueError(f"{key} {group[key]:f} needs to be positive or zero")

    def _initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {
            "accum": torch.full_like(
                param, group["initial_accumulator_value"], memory_format=torch.preserve_format
            ),
            "linear": torch.zeros_like(param, memory_format=torch.preserve_format),
        }

    def _update(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        lr = float(group["lr"])
        lr_power = float(group["learning_rate_power"])
        l1 = float(group["l1_regularization_strength"])
        l2 = float(group["l2_regularization_strength"])
        l2 += float(group["beta"]) / (2.0 * max(lr, 1e-36))
        shrinkage = float(group["l2_shrinkage_regularization_strength"])
        accum, linear = state["accum"], state["linear"]
        shrunk = grad + (2.0 * shrinkage) * param if shrinkage > 0.0 else grad
        accum_new = accum + grad * grad
        if lr_power == -0.5:
            old_root, new_root = accum.sqrt(), accum_new.sqrt()
            linear.add_(shrunk - (new_root - old_root) / lr * param)
            quadratic = new_root / lr + 2.0 * l2
        else:
            new_pow = accum_new.pow(-lr_power)
            linear.add_(shrunk - (new_pow - accum.pow(-lr_power)) / lr * param)
            quadratic = 1.0 / (accum_new.pow(lr_power) * lr) + 2.0 * l2
        solved = (torch.sign(linear) * l1 - linear) / quadratic
        param.copy_(torch.where(linear.abs() > l1, solved, torch.zeros_like(solved)))
        accum.copy_(accum_new)
