"""``StopAtStepHook``: stop training when the global step reaches a given step.

TF name: ``tf.compat.v1.train.StopAtStepHook``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchsupervisor.core.checks import check_int
from torchsupervisor.core.global_step import read_step
from torchsupervisor.hooks._global_step import require_global_step, session_global_step
from torchsupervisor.hooks.session_run_hook import (
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)

if TYPE_CHECKING:
    from torchsupervisor.core.coordinator import Coordinator
    from torchsupervisor.core.global_step import GlobalStepLike
    from torchsupervisor.core.session import SessionLike

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
        num_steps = check_int("num_steps", num_steps, allow_none=True)
        last_step = check_int("last_step", last_step, allow_none=True)
        self._num_steps = num_steps
        self._last_step = last_step
        self._global_step: GlobalStepLike | None = None

    @property
    def last_step(self) -> int | None:
        """The step training stops at (None until ``num_steps`` is turned into a step).

        TF name: none (TF keeps it private, ``StopAtStepHook._last_step``).
        """
        return self._last_step

    def begin(self) -> None:
        """Find the global step in the default graph's ``GLOBAL_STEP`` collection.

        Raises:
            RuntimeError: ``"Global step should be created to use StopAtStepHook."``.

        TF name: ``tf.compat.v1.train.StopAtStepHook.begin``.
        """
        self._global_step = require_global_step("StopAtStepHook")

    def after_create_session(self, session: SessionLike, coord: Coordinator) -> None:
        """Take the session state's global step; compute ``last_step`` on the first session.

        ``last_step`` is the step read now plus ``num_steps``; a later session keeps it.

        Raises:
            TypeError: If the global step is not an integer step.

        TF name: ``tf.compat.v1.train.StopAtStepHook.after_create_session``.
        """
        del coord
        self._global_step = session_global_step(session, self._global_step)
        if self._last_step is None:
            self._last_step = read_step(self._global_step) + self._num_steps

    def before_run(self, run_context: SessionRunContext) -> None:
        """Compute ``last_step`` here if no session was created (a bare hooked session).

        Returns:
            None: the hook adds no fetches (the step is read directly after the run).

        TF name: ``tf.compat.v1.train.StopAtStepHook.before_run``.
        """
        del run_context
        if self._last_step is None:
            self._last_step = read_step(self._global_step) + self._num_steps

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """Request a stop once the global step reached ``last_step``.

        TF name: ``tf.compat.v1.train.StopAtStepHook.after_run``.
        """
        del run_values
        if read_step(self._global_step) >= self._last_step:
            run_context.request_stop()
