"""``SummarySaverHook``: evaluate the summary ops every N steps or seconds and write them.

TF name: ``tf.compat.v1.train.SummarySaverHook``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchsupervisor.core.checks import check_int, check_number, check_path
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.global_step import read_step
from torchsupervisor.core.timers import SecondOrStepTimer
from torchsupervisor.hooks._global_step import require_global_step, session_global_step
from torchsupervisor.hooks.session_run_hook import (
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)
from torchsupervisor.summary.writer import write_start
from torchsupervisor.summary.writer_cache import SummaryWriterCache

if TYPE_CHECKING:
    from torchsupervisor.core.coordinator import Coordinator
    from torchsupervisor.core.global_step import GlobalStepLike
    from torchsupervisor.core.session import Op, SessionLike
    from torchsupervisor.driver.checkpoint_driver import EventSink

__all__ = ["SummarySaverHook"]


class SummarySaverHook(SessionRunHook):
    """Write the summaries of the summary op(s) every N steps or seconds.

    The summary ops are fetched only on the runs whose resulting step is due (evaluated after
    the caller's fetches, so they describe the state after the step) and written at that step.
    The first run of the hook also writes ``SessionLog.START`` at its step, so TensorBoard drops
    what a crashed run wrote past its last checkpoint. With ``save_steps=8`` and one step per
    run, summaries land at steps 1, 9, 17, 25, ...

    Args:
        save_steps: Steps between two summaries; None: use ``save_secs``.
        save_secs: Seconds between two summaries (monotonic clock); None: use ``save_steps``.
        output_dir: Directory whose shared writer (``SummaryWriterCache``) is used.
        summary_writer: The writer to use instead of the cached one.
        scaffold: A ``Scaffold`` whose ``summary_op`` (set by ``finalize()``) is evaluated.
        summary_op: A summary op (a callable returning a ``Summary`` or its bytes, e.g. from
            ``summary.scalar``/``summary.merge_all``), or a list of them.
        clock: Time source; None means the real clock.

    Raises:
        ValueError: ``"Exactly one of scaffold or summary_op must be provided."``; the timer's
            errors (``"Either every_secs or every_steps should be provided."``, ...).
        RuntimeError: From ``begin()``, ``"Global step should be created to use
            SummarySaverHook."``.

    Thread safety: used on the training thread only (the writer is thread-safe).

    TF name: ``tf.compat.v1.train.SummarySaverHook``.
    """

    def __init__(
        self,
        save_steps: int | None = None,
        save_secs: float | None = None,
        output_dir: str | None = None,
        summary_writer: EventSink | None = None,
        scaffold: Any = None,
        summary_op: Op | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        if (scaffold is None) == (summary_op is None):
            raise ValueError("Exactly one of scaffold or summary_op must be provided.")
        save_steps = check_int("save_steps", save_steps, allow_none=True)
        save_secs = check_number("save_secs", save_secs, allow_none=True)
        output_dir = check_path("output_dir", output_dir)
        self._summary_op = summary_op
        self._summary_writer = summary_writer
        self._output_dir = output_dir
        self._scaffold = scaffold
        self._timer = SecondOrStepTimer(every_secs=save_secs, every_steps=save_steps, clock=clock)
        self._global_step: GlobalStepLike | None = None
        self._next_step: int | None = None
        self._start_step: int | None = None  # The step of the first run (before it).
        self._request_summary = False

    def begin(self) -> None:
        """Find the writer (from ``output_dir`` if none was given) and the global step.

        Without a writer the hook does nothing. The next run writes ``SessionLog.START``.

        Raises:
            RuntimeError: ``"Global step should be created to use SummarySaverHook."``.

        TF name: ``tf.compat.v1.train.SummarySaverHook.begin``.
        """
        if self._summary_writer is None and self._output_dir:
            self._summary_writer = SummaryWriterCache.get(self._output_dir)
        self._next_step = None
        self._global_step = require_global_step("SummarySaverHook")

    def after_create_session(self, session: SessionLike, coord: Coordinator) -> None:
        """Use the global step of the session's state.

        TF name: ``tf.compat.v1.train.SummarySaverHook.after_create_session`` (the inherited no-op
        there: TF reads the graph's global step tensor).
        """
        del coord
        self._global_step = session_global_step(session, self._global_step)

    def _summary_ops(self) -> list[Any]:
        op = self._scaffold.summary_op if self._scaffold is not None else self._summary_op
        if op is None:
            return []
        return list(op) if isinstance(op, (list, tuple)) else [op]

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs | None:
        """Fetch the summary ops when the step this run produces is due.

        Returns:
            ``SessionRunArgs({"summary": [ops]})`` when due, the hook's first run included;
            None otherwise, without a writer, or when there is no summary op.

        TF name: ``tf.compat.v1.train.SummarySaverHook.before_run``.
        """
        del run_context
        if self._summary_writer is None:
            self._request_summary = False
            return None
        if self._next_step is None:
            self._start_step = read_step(self._global_step)
        self._request_summary = self._next_step is None or self._timer.should_trigger_for_step(
            self._next_step
        )
        if self._request_summary:
            ops = self._summary_ops()
            if ops:
                return SessionRunArgs({"summary": ops})
        return None

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """Write START at the first run and the fetched summaries at this step.

        TF name: ``tf.compat.v1.train.SummarySaverHook.after_run``.
        """
        del run_context
        writer = self._summary_writer
        if writer is None:
            return
        step = read_step(self._global_step)
        if self._next_step is None:
            # TF's placement: after the first step. The restart record names the step the
            # session resumed at (read in before_run), not this one.
            write_start(writer, self._start_step, step)
        if self._request_summary:
            self._timer.update_last_triggered_step(step)
            results = run_values.results
            if results is not None:
                for summary in results["summary"]:
                    if summary is not None:
                        writer.add_summary(summary, step)
        self._next_step = step + 1

    def end(self, session: SessionLike) -> None:
        """Flush the writer.

        TF name: ``tf.compat.v1.train.SummarySaverHook.end``.
        """
        del session
        if self._summary_writer is not None:
            self._summary_writer.flush()
