"""RMSProp exactly as TF 1 computes it (``torch.optim.RMSprop`` differs in three places).

TF name: ``tf.compat.v1.train.RMSPropOptimizer``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from torchsupervisor.training.optimizers._base import _TFOptimizer

__all__ = ["RMSPropOptimizer"]


class RMSPropOptimizer(_TFOptimizer):
    """RMSProp with TF 1's update, for a port whose training must match TF's numbers.

    For a parameter ``w`` with gradient ``g``, learning rate ``lr``, mean square ``ms``
    (starts at **1**), momentum accumulator ``mom`` (starts at 0) and, with ``centered``,
    mean gradient ``mg`` (starts at 0)::

        ms = decay * ms + (1 - decay) * g * g
        mg = decay * mg + (1 - decay) * g                    # centered only
        denom = ms + epsilon            (centered: ms - mg * mg + epsilon)
        mom = momentum * mom + lr * g / sqrt(denom)
        w = w - mom

    ``torch.optim.RMSprop(params, lr, alpha=decay, eps=epsilon, momentum=momentum,
    centered=centered)`` starts ``ms`` at 0, adds ``eps`` outside the square root
    (``sqrt(ms) + eps``) and multiplies by ``lr`` after the momentum: its first steps are
    several times larger (with ``g = 0.1``, ``lr = 0.001``: 3.2e-3 against TF's 1.05e-4), and
    its later ones differ too. Use this class for a faithful port of a TF program;
    ``torch.optim.RMSprop`` for a new one.

    Args:
        params: The parameters or parameter groups (a group may override ``lr`` and the
            options below under the same names).
        learning_rate: The learning rate (stored as each group's ``"lr"``).
        decay: The discount of the history (TF's ``decay``, PyTorch's ``alpha``).
        momentum: The momentum (0: none).
        epsilon: Added to the denominator inside the square root.
        use_locking: Accepted for TF's signature; no effect.
        centered: Normalize by the estimated variance of the gradient (``ms - mg^2``)
            instead of the second moment.
        name: A name for logs; the state keys are TF's slot names ``"rms"``, ``"momentum"``
            and, when centered, ``"mg"``.

    ``step()`` raises ``RuntimeError`` for a sparse gradient, before updating any parameter;
    parameters without a gradient are skipped. The slots are in ``state_dict()``.
    Parameters, dtypes and devices: as every optimizer of ``training/optimizers/``.

    Thread safety: like any ``torch.optim`` optimizer, use from one thread.

    TF name: ``tf.compat.v1.train.RMSPropOptimizer``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        learning_rate: float,
        decay: float = 0.9,
        momentum: float = 0.0,
        epsilon: float = 1e-10,
        use_locking: bool = False,
        centered: bool = False,
        name: str = "RMSProp",
    ) -> None:
        del use_locking
        defaults = {
            "lr": learning_rate,
            "decay": decay,
            "momentum": momentum,
            "epsilon": epsilon,
            "centered": bool(centered),
        }
        super().__init__(params, defaults, name)

    def _initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = {
            "rms": torch.ones_like(param, memory_format=torch.preserve_format),
            "momentum": torch.zeros_like(param, memory_format=torch.preserve_format),
        }
        if group["centered"]:
            state["mg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _update(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        decay = float(group["decay"])
        rms = state["rms"]
        rms.mul_(decay).addcmul_(grad, grad, value=1.0 - decay)
        if group["centered"]:
            if "mg" not in state:  # Centered in a group turned so after the first step.
                state["mg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            mg = state["mg"]
            mg.mul_(decay).add_(grad, alpha=1.0 - decay)
            denom = torch.addcmul(rms, mg, mg, value=-1.0)
        else:
            denom = rms.clone()
        denom.add_(float(group["epsilon"])).sqrt_()
        mom = state["momentum"]
        mom.mul_(float(group["momentum"])).addcdiv_(grad, denom, value=float(group["lr"]))
        param.sub_(mom)
