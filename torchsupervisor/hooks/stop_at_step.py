"""``StopAtStepHook``: stop training when the global step reaches a given step.

TF name: ``tf.compat.v1.train.StopAtStepHook``.
"""

from __future__ import annotations

from typing import Any

from torchsupervisor.global_step import read_step
from torchsupervisor.hooks._global_step import require_global_step, session_global_step
from torchsupervisor.hooks.session_run_hook import (
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)

__all__ = ["StopAtStepHook"]


class StopAtStepHook(SessionRunHook):
    """Request a stop after the run that brings the global step to ``last_step``.

    With ``num_steps``, ``last_step`` is computed once, when the first session is created, as
    the step then plus ``num_steps`` (a run restored at step 3 with ``num_steps=4`` stops at
    7); a session re-created after a recoverable error keeps it.

    Args:
        num_steps: Steps to run from the step at session creation; None: use ``last_step``.
        last_step: The step to stop at; None: use ``num_steps``.

    Raises:
        ValueError: ``"One of num_steps or last_step must be specified."`` or ``"Only one of
            num_steps or last_step can be specified."``.
        RuntimeError: From ``begin()``, ``"Global step should be created to use
            StopAtStepHook."``.

    Thread safety: used on the training thread only.

    TF name: ``tf.compat.v1.train.StopAtStepHook``.
    """

    def __init__(self, num_steps: int | None = None, last_step: int | None = None) -> None:
        if num_steps is None and last_step is None:
            raise ValueError("One of num_steps or last_step must be specified.")
        if num_steps is not None and last_step is not None:
            raise ValueError("Only one of num_steps or last_step can be specified.")
        self._num_steps = num_steps
        self._last_step = last_step
        self._global_step: Any = None

    @property
    def last_step(self) -> int | None:
        """The step training stops at (None until known)."""
        return self._last_step

    def begin(self) -> None:
        """Find the global step."""
        self._global_step = require_global_step("StopAtStepHook")

    def after_create_session(self, session: Any, coord: Any) -> None:
        """Compute ``last_step`` from ``num_steps`` (on the first session only)."""
        del coord
        self._global_step = session_global_step(session, self._global_step)
        if self._last_step is None:
            self._last_step = read_step(self._global_step) + self._num_steps

    def before_run(self, run_context: SessionRunContext) -> None:
        """Without a session creation (a bare hooked session), count from the first run."""
        del run_context
        if self._last_step is None:
            self._last_step = read_step(self._global_step) + self._num_steps

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """Request a stop once the global step reached ``last_step``."""
        del run_values
        if read_step(self._global_step) >= self._last_step:
            run_context.request_stop()
