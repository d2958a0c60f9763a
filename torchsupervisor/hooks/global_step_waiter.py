"""``GlobalStepWaiterHook``: hold a worker back until the global step reaches a value.

TF name: ``tf.compat.v1.train.GlobalStepWaiterHook``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torchsupervisor.core.checks import check_int, check_number
from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.global_step import read_step
from torchsupervisor.hooks._global_step import require_global_step, session_global_step
from torchsupervisor.hooks.session_run_hook import SessionRunContext, SessionRunHook

if TYPE_CHECKING:
    from torchsupervisor.core.coordinator import Coordinator
    from torchsupervisor.core.global_step import GlobalStepLike
    from torchsupervisor.core.session import SessionLike

__all__ = ["GlobalStepWaiterHook"]

logger = logging.getLogger("torchsupervisor")

_WAIT_LOG_EVERY_STEPS = 1000


class GlobalStepWaiterHook(SessionRunHook):
    """Delay the first run until the global step reaches ``wait_until_step``.

    Meant for a worker that should start after others moved the shared step (another thread
    of this process increments it). The first ``before_run`` polls the step every
    ``poll_secs``; once the step is reached (or if ``wait_until_step <= 0``) it never waits
    again.

    Args:
        wait_until_step: The step to wait for.
        poll_secs: Seconds between two looks at the step.
        clock: Time source for the sleeps; None means the real clock.

    Raises:
        RuntimeError: From ``begin()``, ``"Global step should be created to use
            _GlobalStepWaiterHook."`` (TF's text).

    Thread safety: used on the training thread only; the step may be moved by any thread.

    TF name: ``tf.compat.v1.train.GlobalStepWaiterHook``.
    """

    def __init__(
        self, wait_until_step: int, *, poll_secs: float = 0.5, clock: Clock | None = None
    ) -> None:
        self._wait_until_step = check_int("wait_until_step", wait_until_step, minimum=None)
        self._poll_secs = check_number("poll_secs", poll_secs, positive=True)
        self._clock = clock or REAL_CLOCK
        self._worker_is_started = False
        self._global_step: GlobalStepLike | None = None

    def begin(self) -> None:
        """Find the global step; the next ``before_run`` waits again.

        Raises:
            RuntimeError: ``"Global step should be created to use _GlobalStepWaiterHook."``.

        TF name: ``tf.compat.v1.train.GlobalStepWaiterHook.begin``.
        """
        self._worker_is_started = False
        self._global_step = require_global_step("_GlobalStepWaiterHook")

    def after_create_session(self, session: SessionLike, coord: Coordinator) -> None:
        """Use the global step of the session's state.

        TF name: ``tf.compat.v1.train.GlobalStepWaiterHook.after_create_session`` (the
        inherited no-op there: TF reads the graph's global step tensor).
        """
        del coord
        self._global_step = session_global_step(session, self._global_step)

    def before_run(self, run_context: SessionRunContext) -> None:
        """Block until the global step reached ``wait_until_step`` (first run only).

        Polls every ``poll_secs`` on the clock, with no timeout and no stop check: if the step
        never moves, it waits forever.

        Returns:
            None: the hook adds no fetches.

        TF name: ``tf.compat.v1.train.GlobalStepWaiterHook.before_run``.
        """
        del run_context
        if self._worker_is_started:
            return
        if self._wait_until_step <= 0:
            self._worker_is_started = True
            return
        logger.info("Waiting for global step %d before starting training.", self._wait_until_step)
        last_logged_step = 0
        while True:
            current = read_step(self._global_step)
            if current >= self._wait_until_step:
                self._worker_is_started = True
                return
            if current - last_logged_step >= _WAIT_LOG_EVERY_STEPS:
                logger.info(
                    "Waiting for global step %d before starting training. Current step is %d.",
                    self._wait_until_step,
                    current,
                )
                last_logged_step = current
            self._clock.sleep(self._poll_secs)
