"""``StepCounterHook``: write the training speed (``global_step/sec``) to TensorBoard.

TF name: ``tf.compat.v1.train.StepCounterHook``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tensorboard.compat.proto.summary_pb2 import Summary

from torchsupervisor.core.checks import check_int, check_number, check_path
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.global_step import read_step
from torchsupervisor.core.timers import SecondOrStepTimer
from torchsupervisor.hooks._global_step import (
    require_global_step,
    session_global_step,
    step_name,
)
from torchsupervisor.hooks.session_run_hook import (
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)
from torchsupervisor.summary.writer_cache import SummaryWriterCache

if TYPE_CHECKING:
    from torchsupervisor.core.coordinator import Coordinator
    from torchsupervisor.core.global_step import GlobalStepLike
    from torchsupervisor.core.session import SessionLike
    from torchsupervisor.driver.checkpoint_driver import EventSink

__all__ = ["StepCounterHook"]

logger = logging.getLogger("torchsupervisor")

_STALE_STEP_WARNINGS = 5


class StepCounterHook(SessionRunHook):
    """Every N steps or seconds, write ``<global step name>/sec`` at the current step.

    The first trigger (the first run of a session) only records the time and step; with
    ``every_n_steps=10`` and one step per run, rates are written at steps 11, 21, 31, ...
    The rate is also logged (``"global_step/sec: %g"``). If the global step did not move
    during a run, a warning is logged (the first 5 times).

    Args:
        every_n_steps: Steps between two rates; pass None to use ``every_n_secs``.
        every_n_secs: Seconds between two rates (on the clock's monotonic time).
        output_dir: Directory whose shared writer (``SummaryWriterCache``) receives the
            rates; None: only log (unless ``summary_writer`` is given).
        summary_writer: The writer to use instead of the cached one.
        clock: Time source; None means the real clock.

    Raises:
        ValueError: ``"exactly one of every_n_steps and every_n_secs should be provided."``.
        RuntimeError: From ``begin()``, ``"Global step should be created to use
            StepCounterHook."``.

    Thread safety: used on the training thread only (the writer is thread-safe).

    TF name: ``tf.compat.v1.train.StepCounterHook``.
    """

    def __init__(
        self,
        every_n_steps: int | None = 100,
        every_n_secs: float | None = None,
        output_dir: str | None = None,
        summary_writer: EventSink | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        if (every_n_steps is None) == (every_n_secs is None):
            raise ValueError("exactly one of every_n_steps and every_n_secs should be provided.")
        every_n_steps = check_int("every_n_steps", every_n_steps, minimum=1, allow_none=True)
        every_n_secs = check_number("every_n_secs", every_n_secs, allow_none=True)
        check_path("output_dir", output_dir)
        self._timer = SecondOrStepTimer(
            every_steps=every_n_steps, every_secs=every_n_secs, clock=clock
        )
        self._output_dir = output_dir
        self._summary_writer = summary_writer
        self._global_step: GlobalStepLike | None = None
        self._summary_tag = "global_step/sec"
        self._last_step: int | None = None
        self._stale_warnings = 0

    def begin(self) -> None:
        """Find the writer (from ``output_dir`` if none was given) and the global step.

        Raises:
            RuntimeError: ``"Global step should be created to use StepCounterHook."``.

        TF name: ``tf.compat.v1.train.StepCounterHook.begin``.
        """
        if self._summary_writer is None and self._output_dir:
            self._summary_writer = SummaryWriterCache.get(self._output_dir)
        self._global_step = require_global_step("StepCounterHook")
        self._summary_tag = step_name(self._global_step) + "/sec"

    def after_create_session(self, session: SessionLike, coord: Coordinator) -> None:
        """Take the session state's global step and start counting afresh.

        The timer is reset, since after a recovery the step may have moved back.

        TF name: ``tf.compat.v1.train.StepCounterHook.after_create_session`` (the inherited
        no-op there: TF reads the graph's global step tensor).
        """
        del coord
        self._global_step = session_global_step(session, self._global_step)
        self._summary_tag = step_name(self._global_step) + "/sec"
        self._timer.reset()
        self._last_step = None

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """Write and log the steps/sec rate when the timer triggers.

        The rate is the steps since the last trigger over the seconds since it (``inf`` if no
        time passed); nothing is written at a session's first trigger.

        TF name: ``tf.compat.v1.train.StepCounterHook.after_run``.
        """
        del run_context, run_values
        step = read_step(self._global_step)
        if step == self._last_step and self._stale_warnings < _STALE_STEP_WARNINGS:
            self._stale_warnings += 1
            logger.warning(
                "It seems that global step (torchsupervisor.get_global_step) has not been "
                "increased. Current value (could be stable): %s vs previous value: %s. You "
                "could increase the global step by binding it to the optimizer "
                "(global_step.bind(optimizer)) or by calling global_step.increment().",
                step,
                self._last_step,
            )
        self._last_step = step
        if self._timer.should_trigger_for_step(step):
            elapsed_secs, elapsed_steps = self._timer.update_last_triggered_step(step)
            if elapsed_secs is not None:
                rate = elapsed_steps / elapsed_secs if elapsed_secs > 0 else float("inf")
                if self._summary_writer is not None:
                    summary = Summary(
                        value=[Summary.Value(tag=self._summary_tag, simple_value=rate)]
                    )
                    self._summary_writer.add_summary(summary, step)
                logger.info("%s: %g", self._summary_tag, rate)
