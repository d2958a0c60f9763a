"""The Supervisor's standard services: summaries, steps per second, checkpoints, and (when
asked for) system metrics.

Each service is a ``LooperThread`` on the Supervisor's coordinator, so its first run is
immediate, it runs on a fixed schedule, and its errors stop training and are re-raised by
``Supervisor.stop()``.

The checkpoint timer differs from TF on purpose: it never reads the state. It asks the
``CheckpointDriver``, which takes the snapshot at the training thread's next step boundary and
has it written in the background (``driver/checkpoint_driver.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tensorboard.compat.proto.summary_pb2 import Summary

from torchsupervisor.core.coordinator import Coordinator, LooperThread
from torchsupervisor.core.global_step import GlobalStep, read_step
from torchsupervisor.core.session import Session, call_op
from torchsupervisor.driver.checkpoint_driver import CheckpointDriver
from torchsupervisor.summary.system_metrics import SVSystemMetricsThread

if TYPE_CHECKING:
    from torchsupervisor.core.global_step import GlobalStepLike
    from torchsupervisor.core.session import Op
    from torchsupervisor.driver.checkpoint_driver import EventSink

__all__ = [
    "SVStepCounterThread",
    "SVSummaryThread",
    "SVTimerCheckpointThread",
    "standard_threads",
]

logger = logging.getLogger("torchsupervisor")

_STEP_RATE_LOGS = 10


class SVSummaryThread(LooperThread):
    """Every ``interval_secs``: evaluate the summary op and write it at the current step.

    TF name: ``tf.compat.v1.train.Supervisor``'s ``SVSummaryThread``.
    """

    def __init__(
        self,
        coord: Coordinator,
        interval_secs: float,
        sess: Session,
        summary_op: Op,
        global_step: GlobalStepLike,
        writer: EventSink,
    ) -> None:
        super().__init__(coord, interval_secs)
        self._sess = sess
        self._summary_op = summary_op
        self._global_step = global_step
        self._writer = writer

    def run_loop(self) -> None:
        summary = call_op(self._summary_op, self._sess)
        step = None if self._global_step is None else read_step(self._global_step)
        if self._writer is not None and summary is not None:
            logger.info("Recording summary at step %s.", step)
            self._writer.add_summary(summary, step)


class SVStepCounterThread(LooperThread):
    """Every ``interval_secs``: write the training speed as ``<global step name>/sec``.

    Nothing is written until a step has run in this session. TF wrote a value at once,
    always 0.0 (nothing trained yet): after every resume, and at every start of a run that had
    already reached its last step, the curve dropped to zero for no reason. Once training has
    stepped, an interval in which no step ran is written as 0.0: a stalled run shows.

    TF name: ``tf.compat.v1.train.Supervisor``'s ``SVStepCounterThread``.
    """

    def __init__(
        self,
        coord: Coordinator,
        interval_secs: float,
        global_step: GlobalStepLike,
        writer: EventSink,
    ) -> None:
        super().__init__(coord, interval_secs)
        self._global_step = global_step
        self._writer = writer
        self._clock = coord.clock
        name = global_step.name if isinstance(global_step, GlobalStep) else "global_step"
        self._tag = f"{name}/sec"
        self._last_time = 0.0
        self._last_step = 0
        self._logged = 0
        self._stepped = False  # A step ran since the session started.

    def start_loop(self) -> None:
        self._last_time = self._clock.monotonic()
        self._last_step = read_step(self._global_step)

    def run_loop(self) -> None:
        now = self._clock.monotonic()
        step = read_step(self._global_step)
        added, elapsed = step - self._last_step, now - self._last_time
        self._last_time, self._last_step = now, step
        self._stepped = self._stepped or added > 0
        if not self._stepped:  # Not a stall: training has not begun (or had already ended).
            return
        rate = added / elapsed if elapsed > 0.0 else float("inf")
        summary = Summary(value=[Summary.Value(tag=self._tag, simple_value=rate)])
        self._writer.add_summary(summary, step)
        if self._logged < _STEP_RATE_LOGS:
            self._logged += 1
            logger.info("%s: %g", self._tag, rate)


class SVTimerCheckpointThread(LooperThread):
    """Every ``interval_secs``: ask the ``CheckpointDriver`` for a checkpoint.

    The driver takes it at the training thread's next step boundary (this thread never reads
    the state). A save that falls behind the interval is hurried, and reported once the newest
    checkpoint is twice the interval old (``CheckpointDriver.keep_up``).

    TF name: ``tf.compat.v1.train.Supervisor``'s ``SVTimerCheckpointThread``.
    """

    def __init__(
        self, coord: Coordinator, interval_secs: float, driver: CheckpointDriver, sess: Session
    ):
        super().__init__(coord, interval_secs)
        self._driver = driver
        self._sess = sess
        self._interval_secs = interval_secs

    def run_loop(self) -> None:
        self._driver.request(self._sess)
        self._driver.keep_up(self._interval_secs)


def standard_threads(settings: Any, coord: Coordinator, sess: Session) -> list[LooperThread]:
    """The summary, step-counter and system-metrics services of a chief's session (not
    started).

    Args:
        settings: The Supervisor's ``Settings`` (``save_summaries_secs``, ``summary_op``,
            ``global_step``, ``summary_writer``, ``system_metrics_secs``).
        coord: The coordinator the threads belong to.
        sess: The session the summary op reads.
    """
    writer = settings.summary_writer
    if writer is None:
        return []
    threads: list[LooperThread] = []
    if settings.system_metrics_secs:
        threads.append(
            SVSystemMetricsThread(coord, settings.system_metrics_secs, settings.global_step, writer)
        )
    if not settings.save_summaries_secs:
        return threads
    if settings.summary_op is not None:
        threads.append(
            SVSummaryThread(
                coord,
                settings.save_summaries_secs,
                sess,
                settings.summary_op,
                settings.global_step,
                writer,
            )
        )
    if settings.global_step is not None:
        threads.append(
            SVStepCounterThread(coord, settings.save_summaries_secs, settings.global_step, writer)
        )
    return threads
