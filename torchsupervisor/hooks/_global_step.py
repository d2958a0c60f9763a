"""How hooks find the global step: the ``GLOBAL_STEP`` collection, then the session's state.

``begin()`` runs before any session exists, so a hook first takes the step from the default
graph's ``GLOBAL_STEP`` collection (the session creators register the state's global step
there). Once a session exists, the state's ``"global_step"`` entry wins: it is the object this
run trains and checkpoints, whatever an earlier run left in a process-wide collection.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from torchsupervisor.core.global_step import GlobalStep, get_global_step

if TYPE_CHECKING:
    from torchsupervisor.core.session import SessionLike

__all__ = ["is_step", "require_global_step", "session_global_step", "step_name"]


def is_step(value: object) -> bool:
    """True for a ``GlobalStep`` or an integer scalar tensor."""
    if isinstance(value, GlobalStep):
        return True
    return (
        isinstance(value, torch.Tensor)
        and value.numel() == 1
        and not (
            value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool
        )
    )


def require_global_step(hook_name: str) -> Any:
    """Return the default graph's global step.

    Raises:
        RuntimeError: ``"Global step should be created to use <hook_name>."`` when there is none.
    """
    step = get_global_step()
    if step is None:
        raise RuntimeError(f"Global step should be created to use {hook_name}.")
    return step


def session_global_step(session: SessionLike, current: Any) -> Any:
    """Return the ``"global_step"`` entry of the session's state, or ``current``."""
    state = getattr(session, "state", None)
    if isinstance(state, Mapping):
        candidate = state.get("global_step")
        if candidate is not None and is_step(candidate):
            return candidate
    return current


def step_name(step: Any) -> str:
    """The name of the step for summary tags (``"global_step"`` for a tensor)."""
    return step.name if isinstance(step, GlobalStep) else "global_step"
