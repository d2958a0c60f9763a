"""Adagrad dual averaging, for sparse linear models, with TF 1's semantics.

TF name: ``tf.compat.v1.train.AdagradDAOptimizer``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from torchsupervisor.core.global_step import check_step_source, read_step
from torchsupervisor.training.optimizers._base import _TFOptimizer, check_l1_l2

if TYPE_CHECKING:
    from torchsupervisor.core.global_step import GlobalStepLike

__all__ = ["AdagradDAOptimizer"]


class AdagradDAOptimizer(_TFOptimizer):
    """Adagrad dual averaging: the weights are a closed form of the accumulated gradients.

    For a parameter ``w`` with gradient ``g``, accumulators ``G`` (starts at 0) and ``H``
    (starts at ``initial_gradient_squared_accumulator_value``), learning rate ``lr`` and
    ``t = global_step + 1`` (the step read before this update, as TF's ``global_step + 1``)::

        G += g
        H += g * g
        G' = sign(G) * max(|G| - l1 * t, 0)        if l1 > 0 else G
        w = -lr * G' / (l2 * t * lr + sqrt(H))

    The weights do not depend on their previous values: a coordinate whose gradient is 0 for
    a while is updated as if it had been updated every step (the regularization of features
    unseen in a batch). The step is usually bound to this optimizer (``global_step.bind(opt)``)
    so that it counts its updates; it is read in ``step()`` before the increment.

    Args:
        params: The parameters or parameter groups (a group may override ``lr`` and the
            options below under the same names).
        learning_rate: The learning rate (stored as each group's ``"lr"``).
        global_step: The training step: a ``GlobalStep`` or an integer scalar tensor, read at
            every ``step()``.
        initial_gradient_squared_accumulator_value: Start value of ``H``; must be positive.
        l1_regularization_strength: ``l1`` >= 0.
        l2_regularization_strength: ``l2`` >= 0.
        use_locking: Accepted for TF's signature; no effect.
        name: A name for logs; the state keys are always ``"gradient_accumulator"`` and
            ``"gradient_squared_accumulator"``.

    Raises:
        ValueError: ``"initial_gradient_squared_accumulator_value must be positive: <value>"``
            (TF's text), or if ``global_step`` is None.
        TypeError: If ``global_step`` is not a ``GlobalStep`` or an integer scalar tensor.
        InvalidArgumentError: ``"l1_regularization_strength ... needs to be positive or
            zero"`` (or ``l2_``): documented by TF, checked here.

    ``step()`` raises ``RuntimeError`` for a sparse gradient, before updating any parameter;
    parameters without a gradient are skipped. The accumulators are in ``state_dict()``; the
    global step is saved where it lives (the state's ``GlobalStep``).
    Parameters, dtypes and devices: as every optimizer of ``training/optimizers/``.

    Thread safety: like any ``torch.optim`` optimizer, use from one thread.

    TF name: ``tf.compat.v1.train.AdagradDAOptimizer``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        learning_rate: float,
        global_step: GlobalStepLike,
        initial_gradient_squared_accumulator_value: float = 0.1,
        l1_regularization_strength: float = 0.0,
        l2_regularization_strength: float = 0.0,
        use_locking: bool = False,
        name: str = "AdagradDA",
    ) -> None:
        del use_locking
        defaults = {
            "lr": learning_rate,
            "initial_gradient_squared_accumulator_value": (
                initial_gradient_squared_accumulator_value
            ),
            "l1_regularization_strength": l1_regularization_strength,
            "l2_regularization_strength": l2_regularization_strength,
        }
        self._check_options(defaults)  # the options' errors come before global_step's
        if global_step is None:
            raise ValueError("AdagradDAOptimizer needs global_step (a GlobalStep or a tensor)")
        check_step_source(global_step)
        self.global_step = global_step
        self._t = 1.0  # global_step + 1, read by _begin_step() at every step()
        super().__init__(params, defaults, name)

    @staticmethod
    def _check_options(group: dict[str, Any]) -> None:
        value = group["initial_gradient_squared_accumulator_value"]
        if value <= 0.0:
            raise ValueError(
                f"initial_gradient_squared_accumulator_value must be positive: {value}"
            )
        check_l1_l2(group)

    def _initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        value = group["initial_gradient_squared_accumulator_value"]
        return {
            "gradient_accumulator": torch.zeros_like(param, memory_format=torch.preserve_format),
            "gradient_squared_accumulator": torch.full_like(
                param, value, memory_format=torch.preserve_format
            ),
        }

    def _begin_step(self) -> None:
        self._t = float(read_step(self.global_step) + 1)

    def _update(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        t = self._t
        lr = float(group["lr"])
        l1 = float(group["l1_regularization_strength"])
        l2 = float(group["l2_regularization_strength"])
        sums = state["gradient_accumulator"]
        squares = state["gradient_squared_accumulator"]
        sums.add_(grad)
        squares.addcmul_(grad, grad)
        if l1 > 0.0:
            numerator = torch.sign(sums) * torch.clamp_min(sums.abs() - l1 * t, 0.0)
        else:
            numerator = sums
        param.copy_(-lr * numerator / (l2 * t * lr + squares.sqrt()))
