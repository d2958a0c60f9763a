"""Small hooks: wait for a global step, evaluate final ops at the end, feed every run.

TF names: ``tf.compat.v1.train.GlobalStepWaiterHook``, ``FinalOpsHook``, ``FeedFnHook``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from torchsupervisor.core.checks import check_int, check_number
from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.global_step import read_step
from torchsupervisor.errors import OutOfRangeError
from torchsupervisor.hooks._global_step import require_global_step, session_global_step
from torchsupervisor.hooks.session_run_hook import (
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
)

__all__ = ["FeedFnHook", "FinalOpsHook", "GlobalStepWaiterHook"]

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
        self._global_step: Any = None

    def begin(self) -> None:
        """Find the global step; the next ``before_run`` waits again.

        Raises:
            RuntimeError: ``"Global step should be created to use _GlobalStepWaiterHook."``.

        TF name: ``tf.compat.v1.train.GlobalStepWaiterHook.begin``.
        """
        self._worker_is_started = False
        self._global_step = require_global_step("_GlobalStepWaiterHook")

    def after_create_session(self, session: Any, coord: Any) -> None:
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


class FinalOpsHook(SessionRunHook):
    """Evaluate fetches once, at the end of the session; the values are kept.

    Args:
        final_ops: A fetch structure (as ``Session.run``) evaluated by ``end()``.
        final_ops_feed_dict: Keyword arguments for the fetched callables.

    Raises:
        OutOfRangeError, StopIteration: From ``end()``, re-raised after a warning: a final op
            should not read from the input.

    Thread safety: used on the training thread only.

    TF name: ``tf.compat.v1.train.FinalOpsHook``.
    """

    def __init__(
        self, final_ops: Any, final_ops_feed_dict: Mapping[str, Any] | None = None
    ) -> None:
        self._final_ops = final_ops
        self._final_ops_feed_dict = final_ops_feed_dict
        self._final_ops_values: Any = None

    @property
    def final_ops_values(self) -> Any:
        """The values of the final ops, shaped like them (None before ``end()``).

        TF name: ``tf.compat.v1.train.FinalOpsHook.final_ops_values``.
        """
        return self._final_ops_values

    def end(self, session: Any) -> None:
        """Evaluate the final ops on ``session`` (nothing if ``final_ops`` is None).

        Raises:
            OutOfRangeError, StopIteration: Re-raised after a warning.

        TF name: ``tf.compat.v1.train.FinalOpsHook.end``.
        """
        if self._final_ops is None:
            return
        try:
            self._final_ops_values = session.run(
                self._final_ops, feed_dict=self._final_ops_feed_dict
            )
        except (OutOfRangeError, StopIteration):
            logger.warning(
                "An OutOfRangeError or StopIteration was raised by the final ops of a "
                "FinalOpsHook. A final op should not have a dependency back to some input "
                "source: it should only read values (metrics computed during the run), not "
                "read another batch from an input that is now exhausted."
            )
            raise


class FeedFnHook(SessionRunHook):
    """Feed the result of ``feed_fn()`` to every run.

    Args:
        feed_fn: Returns the ``feed_dict`` (keyword arguments of the fetched callables) of the
            coming run.

    Raises:
        RuntimeError: From the run, if a key is also fed by the caller or another hook.

    Thread safety: used on the training thread only.

    TF name: ``tf.compat.v1.train.FeedFnHook``.
    """

    def __init__(self, feed_fn: Callable[[], Mapping[str, Any]]) -> None:
        if not callable(feed_fn):
            raise TypeError(f"feed_fn must be callable, got {feed_fn!r}")
        self.feed_fn = feed_fn

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        """Return ``feed_fn()`` as this run's feeds (no fetches).

        Returns:
            ``SessionRunArgs(fetches=None, feed_dict=feed_fn())``.

        TF name: ``tf.compat.v1.train.FeedFnHook.before_run``.
        """
        del run_context
        return SessionRunArgs(fetches=None, feed_dict=self.feed_fn())
