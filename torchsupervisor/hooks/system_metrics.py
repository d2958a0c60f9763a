"""``SystemMetricsHook``: the run's CPU, memory, disk, network (and GPU) use, in TensorBoard.

TF name: none (TF 1 had no system metrics).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchsupervisor.core.checks import check_number, check_path
from torchsupervisor.hooks._global_step import require_global_step, session_global_step
from torchsupervisor.hooks.session_run_hook import SessionRunHook
from torchsupervisor.summary.system_metrics import SVSystemMetricsThread
from torchsupervisor.summary.writer_cache import SummaryWriterCache

if TYPE_CHECKING:
    from torchsupervisor.core.coordinator import Coordinator
    from torchsupervisor.core.global_step import GlobalStepLike
    from torchsupervisor.core.session import SessionLike
    from torchsupervisor.driver.checkpoint_driver import EventSink
    from torchsupervisor.summary.system_metrics import SystemMetrics

__all__ = ["SystemMetricsHook"]


class SystemMetricsHook(SessionRunHook):
    """Every ``every_n_secs``, write the ``system/*`` metrics (``summary/system_metrics.py``)
    at the current step, from a thread of the session's coordinator: the training thread
    pays nothing per step, and the thread stops when the session closes.

    Args:
        every_n_secs: Seconds between two samples.
        output_dir: Directory whose shared writer (``SummaryWriterCache``) receives them.
        summary_writer: The writer to use instead of the cached one.
        metrics: The sampler (tests pass one with a fake clock); None: a ``SystemMetrics``.

    Raises:
        ValueError: ``every_n_secs`` is not positive, or neither ``output_dir`` nor
            ``summary_writer`` is given.
        RuntimeError: From ``begin()``, when there is no global step.

    Thread safety: the sampling thread only reads the global step and writes to the writer
    (thread-safe).

    TF name: none.
    """

    def __init__(
        self,
        every_n_secs: float = 15.0,
        output_dir: str | None = None,
        summary_writer: EventSink | None = None,
        metrics: SystemMetrics | None = None,
    ) -> None:
        self._every_n_secs = check_number("every_n_secs", every_n_secs, positive=True)
        check_path("output_dir", output_dir)
        if output_dir is None and summary_writer is None:
            raise ValueError("SystemMetricsHook needs an output_dir or a summary_writer")
        self._output_dir = output_dir
        self._summary_writer = summary_writer
        self._metrics = metrics
        self._global_step: GlobalStepLike | None = None

    def begin(self) -> None:
        """Find the writer and the global step.

        Raises:
            RuntimeError: ``"Global step should be created to use SystemMetricsHook."``.
        """
        if self._summary_writer is None and self._output_dir:
            self._summary_writer = SummaryWriterCache.get(self._output_dir)
        self._global_step = require_global_step("SystemMetricsHook")

    def after_create_session(self, session: SessionLike, coord: Coordinator) -> None:
        """Start sampling on a thread of ``coord`` (joined when the session closes)."""
        self._global_step = session_global_step(session, self._global_step)
        assert self._summary_writer is not None
        SVSystemMetricsThread(
            coord, self._every_n_secs, self._global_step, self._summary_writer, self._metrics
        ).start()
