"""Hooks that look at values: ``NanTensorHook`` (stop on a NaN loss), ``LoggingTensorHook``.

Both take what to watch as fetches: a tensor, a callable, or (eager addition) a string naming
an entry of the mapping the step function returned, e.g. ``NanTensorHook("loss")`` with
``sess.run(step_fn)`` where ``step_fn`` returns ``{"loss": loss}``.

TF names: ``tf.compat.v1.train.NanTensorHook``, ``NanLossDuringTrainingError``,
``tf.compat.v1.train.LoggingTensorHook``.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torchsupervisor.core.checks import check_bool, check_number
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.session import evaluate_fetches
from torchsupervisor.core.timers import NeverTriggerTimer, SecondOrStepTimer
from torchsupervisor.errors import NanLossDuringTrainingError
from torchsupervisor.hooks.session_run_hook import (
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)

if TYPE_CHECKING:
    from torchsupervisor.core.session import SessionLike

__all__ = ["LoggingTensorHook", "NanLossDuringTrainingError", "NanTensorHook"]

logger = logging.getLogger("torchsupervisor")


def _is_nan(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return math.isnan(value.item())
        return bool(torch.isnan(value.detach()).any())
    if isinstance(value, (np.ndarray, np.generic)):
        return bool(np.isnan(value).any())
    return math.isnan(float(value))


class NanTensorHook(SessionRunHook):
    """Check the loss after every run; on NaN, raise or stop.

    Reading the loss synchronizes with its device once per step (as TF's fetch did).

    Args:
        loss_tensor: The loss fetch: a tensor, a callable, or the name of an entry of the
            caller's result mapping (``"loss"``).
        fail_on_nan_loss: Raise ``NanLossDuringTrainingError`` (after logging ``"Model
            diverged with loss = NaN."`` as an error); otherwise log it as a warning and request
            a stop.

    Raises:
        NanLossDuringTrainingError: From ``after_run``, on a NaN loss with
            ``fail_on_nan_loss``.

    Thread safety: used on the training thread only.

    TF name: ``tf.compat.v1.train.NanTensorHook``.
    """

    def __init__(self, loss_tensor: Any, fail_on_nan_loss: bool = True) -> None:
        fail_on_nan_loss = check_bool("fail_on_nan_loss", fail_on_nan_loss)
        self._loss_tensor = loss_tensor
        self._fail_on_nan_loss = fail_on_nan_loss
        self._args = SessionRunArgs(loss_tensor)

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        """Fetch the loss.

        Returns:
            ``SessionRunArgs`` whose fetches are the loss fetch.

        TF name: ``tf.compat.v1.train.NanTensorHook.before_run``.
        """
        del run_context
        return self._args

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """Raise or stop when the loss is NaN (any NaN element of a tensor or array).

        Raises:
            NanLossDuringTrainingError: On a NaN loss with ``fail_on_nan_loss``.
            TypeError: If the fetched loss is not a number, tensor or array (e.g. None).

        TF name: ``tf.compat.v1.train.NanTensorHook.after_run``.
        """
        if _is_nan(run_values.results):
            message = "Model diverged with loss = NaN."
            if self._fail_on_nan_loss:
                logger.error(message)
                raise NanLossDuringTrainingError
            logger.warning(message)
            run_context.request_stop()


def _printable(value: object) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return value


class LoggingTensorHook(SessionRunHook):
    """Log values every N local iterations or seconds, and/or at the end.

    The timer counts the runs of this session (0, N, 2N, ...), not the global step. A log line
    is ``"tag1 = value1, tag2 = value2"`` (tags in sorted order for a dict, in the given order
    for a list), followed by ``" (%.3f sec)"`` from the second line on; ``formatter`` replaces
    that line. Values are printed with numpy's ``suppress=True``.

    Args:
        tensors: A dict ``{tag: fetch}``, or an iterable of fetches (each its own tag). A fetch
            is a tensor, a callable, a ``GlobalStep``, or the name of an entry of the caller's
            result mapping.
        every_n_iter: Log every this many runs; None: use ``every_n_secs``.
        every_n_secs: Log every this many seconds (monotonic clock); None: use
            ``every_n_iter``.
        at_end: Also log at the end of the session (named entries of the caller's result are
            then their values of the last run; other fetches are evaluated at the end).
        formatter: ``formatter(values_by_tag) -> str``; None: the default line.
        clock: Time source; None means the real clock.

    Raises:
        ValueError: ``"either at_end and/or exactly one of every_n_iter and every_n_secs must
            be provided."``, or ``"invalid every_n_iter=<n>."`` for ``every_n_iter <= 0``.

    Thread safety: used on the training thread only.

    TF name: ``tf.compat.v1.train.LoggingTensorHook``.
    """

    def __init__(
        self,
        tensors: Mapping[Any, Any] | Iterable[Any],
        every_n_iter: int | None = None,
        every_n_secs: float | None = None,
        at_end: bool = False,
        formatter: Callable[[dict[Any, Any]], str] | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        if every_n_iter is not None and (
            isinstance(every_n_iter, bool) or not isinstance(every_n_iter, numbers.Integral)
        ):
            raise TypeError(f"every_n_iter must be an integer or None, got {every_n_iter!r}")
        every_n_secs = check_number("every_n_secs", every_n_secs, allow_none=True)
        at_end = check_bool("at_end", at_end)
        if formatter is not None and not callable(formatter):
            raise TypeError(f"formatter must be callable or None, got {formatter!r}")
        only_log_at_end = at_end and every_n_iter is None and every_n_secs is None
        if not only_log_at_end and (every_n_iter is None) == (every_n_secs is None):
            raise ValueError(
                "either at_end and/or exactly one of every_n_iter and every_n_secs must be "
                "provided."
            )
        if every_n_iter is not None and every_n_iter <= 0:
            raise ValueError(f"invalid every_n_iter={every_n_iter}.")
        if isinstance(tensors, Mapping):
            self._tag_order = sorted(tensors)
            self._tensors = dict(tensors)
        else:
            self._tag_order = list(tensors)
            self._tensors = {item: item for item in self._tag_order}
        self._named = {tag: f for tag, f in self._tensors.items() if isinstance(f, str)}
        self._formatter = formatter
        self._log_at_end = at_end
        self._timer: Any = (
            NeverTriggerTimer()
            if only_log_at_end
            else SecondOrStepTimer(every_secs=every_n_secs, every_steps=every_n_iter, clock=clock)
        )
        self._iter_count = 0
        self._should_trigger = False
        self._last_named: dict[Any, Any] = {}
        self._all_args = SessionRunArgs(self._tensors)
        self._named_args = SessionRunArgs(self._named) if self._named else None

    def begin(self) -> None:
        """Start counting iterations from 0 and reset the timer.

        TF name: ``tf.compat.v1.train.LoggingTensorHook.begin``.
        """
        self._timer.reset()
        self._iter_count = 0
        self._last_named = {}

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs | None:
        """Fetch the values when a log line is due (and named values when logging at end).

        Returns:
            ``SessionRunArgs`` of every watched value when due; otherwise, with ``at_end``,
            of the named entries of the caller's result (None if there are none); else None.

        TF name: ``tf.compat.v1.train.LoggingTensorHook.before_run``.
        """
        del run_context
        self._should_trigger = self._timer.should_trigger_for_step(self._iter_count)
        if self._should_trigger:
            return self._all_args
        if self._log_at_end:
            return self._named_args
        return None

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """Log the fetched values when due; count the iteration.

        TF name: ``tf.compat.v1.train.LoggingTensorHook.after_run``.
        """
        del run_context
        results = run_values.results
        if self._log_at_end and results is not None:
            self._last_named = {tag: results[tag] for tag in self._named}
        if self._should_trigger:
            self._log_tensors(results)
        self._iter_count += 1

    def end(self, session: SessionLike) -> None:
        """Log once more at the end if ``at_end``.

        Named entries of the caller's result give their values of the last run (absent if no
        run fetched them); other fetches are evaluated now.

        TF name: ``tf.compat.v1.train.LoggingTensorHook.end``.
        """
        del session
        if not self._log_at_end:
            return
        others = {tag: f for tag, f in self._tensors.items() if tag not in self._named}
        values = dict(evaluate_fetches(others)) if others else {}
        values.update(self._last_named)
        self._log_tensors(values)

    def _log_tensors(self, values: Mapping[Any, Any]) -> None:
        elapsed_secs, _ = self._timer.update_last_triggered_step(self._iter_count)
        with np.printoptions(suppress=True):
            if self._formatter is not None:
                logger.info("%s", self._formatter(dict(values)))
                return
            line = ", ".join(
                f"{tag} = {_printable(values[tag])!s}" for tag in self._tag_order if tag in values
            )
            if elapsed_secs is not None:
                logger.info("%s (%.3f sec)", line, elapsed_secs)
            else:
                logger.info("%s", line)
