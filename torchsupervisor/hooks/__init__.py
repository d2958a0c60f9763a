"""Hooks of ``MonitoredSession``: the base class and its values, and the standard hooks.

Layout (one hook, or one family of hooks, per module)::

    session_run_hook.py  SessionRunHook, SessionRunArgs, SessionRunContext, SessionRunValues
    stop_at_step.py      StopAtStepHook
    checkpoint_saver.py  CheckpointSaverHook, CheckpointSaverListener
    sharded_checkpoint_saver.py  ShardedCheckpointSaverHook (every rank of a sharded state)
    step_counter.py      StepCounterHook
    summary_saver.py     SummarySaverHook
    logging_hooks.py     NanTensorHook, NanLossDuringTrainingError, LoggingTensorHook
    global_step_waiter.py  GlobalStepWaiterHook
    final_ops.py         FinalOpsHook
    feed_fn.py           FeedFnHook
    progress.py          Progress, ProgressHook (a live progress line)
    system_metrics.py    SystemMetricsHook (CPU, memory, disk, network, GPU use)

TF names: ``tf.compat.v1.train.SessionRunHook`` and the hooks of ``basic_session_run_hooks``.
"""

from __future__ import annotations

from torchsupervisor.hooks.checkpoint_saver import CheckpointSaverHook, CheckpointSaverListener
from torchsupervisor.hooks.feed_fn import FeedFnHook
from torchsupervisor.hooks.final_ops import FinalOpsHook
from torchsupervisor.hooks.global_step_waiter import GlobalStepWaiterHook
from torchsupervisor.hooks.logging_hooks import (
    LoggingTensorHook,
    NanLossDuringTrainingError,
    NanTensorHook,
)
from torchsupervisor.hooks.progress import Progress, ProgressHook
from torchsupervisor.hooks.session_run_hook import (
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)
from torchsupervisor.hooks.sharded_checkpoint_saver import ShardedCheckpointSaverHook
from torchsupervisor.hooks.step_counter import StepCounterHook
from torchsupervisor.hooks.stop_at_step import StopAtStepHook
from torchsupervisor.hooks.summary_saver import SummarySaverHook
from torchsupervisor.hooks.system_metrics import SystemMetricsHook

__all__ = [
    "CheckpointSaverHook",
    "CheckpointSaverListener",
    "FeedFnHook",
    "FinalOpsHook",
    "GlobalStepWaiterHook",
    "LoggingTensorHook",
    "NanLossDuringTrainingError",
    "NanTensorHook",
    "Progress",
    "ProgressHook",
    "SessionRunArgs",
    "SessionRunContext",
    "SessionRunHook",
    "SessionRunValues",
    "ShardedCheckpointSaverHook",
    "StepCounterHook",
    "StopAtStepHook",
    "SummarySaverHook",
    "SystemMetricsHook",
]
