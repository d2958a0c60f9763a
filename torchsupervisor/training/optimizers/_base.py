"""The ``torch.optim`` plumbing shared by the TF 1 optimizers of this package (private)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from torchsupervisor.errors import InvalidArgumentError

__all__: list[str] = []


class _TFOptimizer(torch.optim.Optimizer):
    """Option checks, the closure, the sparse-gradient check and the loop over parameters.

    A subclass gives its update rule for one parameter; this class calls it for every
    parameter with a dense gradient, in group order:

    - ``_check_options(group)`` (static): raise for an invalid option of ``group`` (the
      defaults, or a parameter group merged with them), with the class's error texts.
    - ``_initial_state(param, group)``: the new state of ``param`` (empty: it keeps none and
      ``self.state`` gets no entry); called at the first update, or while its state is empty.
    - ``_begin_step()``: read what the update needs once per step (e.g. the global step),
      after the sparse check and before any parameter changes.
    - ``_update(param, grad, state, group)``: update ``param`` (and ``state``) in place.

    Every such optimizer takes parameters of any shape, a floating dtype and any device; the
    update is computed elementwise in the parameter's dtype, and state tensors have the
    parameter's shape, dtype and device.
    """

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], name: str) -> None:
        self._check_options(defaults)
        self.name = name
        super().__init__(params, defaults)

    @staticmethod
    def _check_options(group: dict[str, Any]) -> None:
        """Raise for an invalid option of ``group`` (every option is present)."""

    def _initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """Return the new per-parameter state of ``param`` (empty: no state)."""
        del param, group
        return {}

    def _begin_step(self) -> None:
        """Read the per-step values of the update, once per ``step()``."""

    def _update(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """Apply the update rule to one parameter in place."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (its options are checked as the constructor's).

        Args:
            param_group: A dict with ``"params"`` and, optionally, options overriding the
                defaults.

        Raises:
            ValueError: For an invalid option of the group, with the constructor's text (see
                the class's Raises section); from ``torch.optim``, for a parameter already in
                another group.
            InvalidArgumentError: For an invalid option, if the constructor raises it for that
                option (see the class's Raises section; ``FtrlOptimizer`` never does).
            TypeError: From ``torch.optim``, for ``params`` that are not tensors.

        TF name: none (``torch.optim.Optimizer.add_param_group``; TF's optimizers have no
        parameter groups).
        """
        if isinstance(param_group, dict):
            self._check_options({**self.defaults, **param_group})
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply one update (the class's rule) to every parameter with a gradient.

        Parameters without a gradient are skipped. Every gradient is checked before any
        parameter or state changes.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: ``"<class name> does not support sparse gradients"`` if any gradient
                is sparse, raised before any parameter is updated (the closure, if given, has
                run).

        TF name: none (``torch.optim.Optimizer.step``; TF's
        ``tf.compat.v1.train.<class name>.apply_gradients``, the class's TF name).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None and param.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        self._begin_step()
        for group in self.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                state = self.state.get(param)
                if not state:
                    state = self._initial_state(param, group)
                    if state:
                        self.state[param] = state
                self._update(param, grad, state, group)
        return loss


def check_l1_l2(group: dict[str, Any]) -> None:
    """Raise TF's ``InvalidArgumentError`` for a negative L1 or L2 regularization strength."""
    for key in ("l1_regularization_strength", "l2_regularization_strength"):
        if group[key] < 0.0:
            raise InvalidArgumentError(f"{key} {group[key]:f} needs to be positive or zero")
