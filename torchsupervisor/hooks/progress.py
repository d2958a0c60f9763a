"""The progress of a training run: a live line on a terminal, log lines elsewhere.

The line shows the step of the last step, steps per second, the last loss, the time left,
and the time since the last checkpoint and until the next::

    step 1200/3000  52.3 steps/s  loss 0.1234  ETA 34s  checkpoint 8s ago, next in 2s

On a terminal it is a ``tqdm`` bar, redrawn at most every ``refresh_secs``, with the library's
own log lines printed above it (never glued to it); when the output is not a terminal (a log
file, a scheduler's capture) the same facts are written every ``log_every_secs`` instead of
drawing a bar into a file: logged (logger ``torchsupervisor``, INFO) where INFO logging is on,
else printed on the stream, so that a batch job shows its progress without any set-up.

``ProgressHook`` updates it from a ``MonitoredSession``; with a Supervisor, call
``Progress.update`` in the loop (``Progress.for_supervisor`` finds its checkpoint timing).

TF name: none (TF 1 logged ``global_step/sec`` and tensors, ``LoggingTensorHook``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any, TextIO

from torchsupervisor.core.checks import check_clock, check_duck, check_int, check_number
from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.global_step import read_step
from torchsupervisor.hooks._global_step import require_global_step
from torchsupervisor.hooks.session_run_hook import SessionRunHook

if TYPE_CHECKING:
    from torchsupervisor.core.global_step import GlobalStepLike
    from torchsupervisor.core.session import SessionLike

__all__ = ["Progress", "ProgressHook"]

logger = logging.getLogger("torchsupervisor")


def _duration(secs: float) -> str:
    secs = max(0, round(secs))
    if secs < 60:
        return f"{secs}s"
    if secs < 3600:
        return f"{secs // 60}m{secs % 60:02d}s"
    return f"{secs // 3600}h{secs % 3600 // 60:02d}m"


class Progress:
    """What the progress line shows, and the line (see the module docstring).

    Args:
        last_step: The step training ends at (the total); None: unknown (no ETA, no bar).
        stream: Where the bar is drawn; None: ``sys.stderr``. A stream that is not a
            terminal gets log lines instead.
        refresh_secs: Seconds between two redraws of the bar (>= 0).
        log_every_secs: Seconds between two log lines when not on a terminal (> 0).
        checkpoint_driver: Where the checkpoint timing comes from (a ``CheckpointDriver``:
            ``last_commit_time``), or a callable returning it (it may not exist yet); None:
            no checkpoint timing.
        checkpoint_every_secs: The checkpoint interval, for "next in"; None: not shown.
        clock: Time source; None: the real clock.

    Raises:
        ValueError: ``refresh_secs`` < 0 or ``log_every_secs`` <= 0 (naming both).

    Thread safety: ``update``, ``write`` and ``close`` from one thread (the training thread).

    TF name: none.
    """

    def __init__(
        self,
        last_step: int | None = None,
        *,
        stream: TextIO | None = None,
        refresh_secs: float = 0.5,
        log_every_secs: float = 30.0,
        checkpoint_driver: Any = None,
        checkpoint_every_secs: float | None = None,
        clock: Clock | None = None,
    ) -> None:
        last_step = check_int("last_step", last_step, allow_none=True)
        refresh_secs = check_number("refresh_secs", refresh_secs)
        log_every_secs = check_number("log_every_secs", log_every_secs, positive=True)
        checkpoint_every_secs = check_number(
            "checkpoint_every_secs", checkpoint_every_secs, positive=True, allow_none=True
        )
        check_duck("stream", stream, ("write", "flush"), "a text stream")
        check_clock("clock", clock)
        self.last_step = last_step
        self._stream = stream if stream is not None else sys.stderr
        self._refresh_secs = refresh_secs
        self._log_every_secs = log_every_secs
        self._driver = checkpoint_driver
        self._checkpoint_every_secs = checkpoint_every_secs
        self._clock = clock or REAL_CLOCK
        self._terminal = bool(getattr(self._stream, "isatty", lambda: False)())
        self._bar: Any = None
        self._first: tuple[float, int] | None = None  # (time, step) of the first update
        self._next_show = 0.0
        self._loss: Any = None  # A number, a one-element tensor, or a callable giving one.
        self._step: int | None = None  # The last step given to update.
        self._log_handler: logging.Handler | None = None  # Prints log lines above the bar.

    @classmethod
    def for_supervisor(cls, sv: Any, last_step: int | None = None, **kwargs: object) -> Progress:
        """A ``Progress`` that shows the checkpoints of ``sv`` (a ``Supervisor``)."""

        kwargs.setdefault("checkpoint_every_secs", sv.save_model_secs or None)
        return cls(last_step, checkpoint_driver=lambda: sv.checkpoint_driver, **kwargs)

    def update(self, step: int, loss: Any = None) -> None:
        """Record the step reached and the loss (a number, a one-element tensor, or a callable
        giving one); redraw or log when it is time. Between two redraws it costs a clock read:
        a tensor loss is read (``item()``, a GPU synchronization) only when the line is drawn.
        """
        if loss is not None:
            self._loss = loss
        self._step = step
        now = self._clock.monotonic()
        if self._first is None:
            self._first = (now, step)
        if now < self._next_show:
            return
        if self._terminal:
            self._next_show = now + self._refresh_secs
            self._draw(step, now)
        else:
            self._next_show = now + self._log_every_secs
            line = self.describe(step, now)
            if logger.isEnabledFor(logging.INFO):
                logger.info("%s", line)
            else:  # Logging is not set up (WARNING, Python's default): shown all the same.
                print(line, file=self._stream, flush=True)

    def describe(self, step: int, now: float | None = None) -> str:
        """The progress line for ``step``, as text."""
        now = self._clock.monotonic() if now is None else now
        parts = [f"step {step}/{self.last_step}" if self.last_step else f"step {step}"]
        rate = self._rate(step, now)
        if rate is not None:
            parts.append(f"{rate:.1f} steps/s")
        loss = self._loss() if callable(self._loss) else self._loss
        if loss is not None:
            if hasattr(loss, "detach"):  # A tensor that requires grad: no torch warning.
                loss = loss.detach().item()
            parts.append(f"loss {float(loss):.4g}")
        if rate and self.last_step is not None and step < self.last_step:
            parts.append(f"ETA {_duration((self.last_step - step) / rate)}")
        checkpoint = self._checkpoint(now)
        if checkpoint:
            parts.append(checkpoint)
        return "  ".join(parts)

    def write(self, line: str) -> None:
        """Print ``line`` on stdout: above the bar when one is drawn (it is redrawn below)."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def close(self) -> None:
        """Draw the last step given and end the bar (its line stays on the terminal)."""
        if self._bar is not None:
            if self._step is not None:
                self._draw(self._step, self._clock.monotonic())
            self._bar.close()
            self._bar = None
            if self._log_handler is not None:
                logger.removeHandler(self._log_handler)
                self._log_handler = None

    def _rate(self, step: int, now: float) -> float | None:
        if self._first is None:
            return None
        start, first_step = self._first
        if now - start <= 0 or step <= first_step:
            return None
        return (step - first_step) / (now - start)

    def _checkpoint(self, now: float) -> str:
        driver = self._driver() if callable(self._driver) else self._driver
        committed = getattr(driver, "last_commit_time", None)
        if committed is None:
            return ""
        since = now - committed
        text = f"checkpoint {_duration(since)} ago"
        every = self._checkpoint_every_secs
        if every and since < every:
            text += f", next in {_duration(every - since)}"
        elif every:  # A save that falls behind its interval (a busy machine): say so.
            saving = ", saving" if getattr(driver, "in_flight", False) else ""
            text += f"{saving}, {_duration(since - every)} overdue"
        return text

    def _draw(self, step: int, now: float) -> None:
        if self._bar is None:
            sized = _sized(self._stream)
            self._bar = _bar_class()(
                total=self.last_step,
                initial=step,
                file=self._stream,
                # The line as the bar's description: tqdm puts ", " before a postfix.
                bar_format="{percentage:3.0f}%|{bar}| {desc}" if self.last_step else "{desc}",
                # The terminal's size as it changes; 100x24 where it reports none (a pty
                # without a size, where tqdm would draw nothing).
                dynamic_ncols=sized,
                ncols=None if sized else 100,
                nrows=None if sized else 24,
                leave=True,
            )
            self._log_handler = _handler_above(self._bar)
        self._bar.n = step
        self._bar.set_description_str(self.describe(step, now), refresh=False)
        self._bar.refresh()


def _sized(stream: Any) -> bool:
    """Whether ``stream`` is a terminal that reports its size."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return size.columns > 0 and size.lines > 0


class _AboveBar(logging.Handler):
    """Print log records above a ``tqdm`` bar (``tqdm.write``), which is then redrawn."""

    def __init__(self, bar: object) -> None:
        super().__init__(logging.WARNING)
        self._bar = bar

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._bar.write(self.format(record), file=self._bar.fp)
        except Exception:
            self.handleError(record)


def _handler_above(bar: object) -> logging.Handler | None:
    """Route the library's log lines above ``bar`` where nobody set up logging (they would
    go to Python's last-resort handler on stderr, glued to the bar's line)."""
    root = logging.getLogger()
    if logger.handlers or root.handlers:
        return None
    handler = _AboveBar(bar)
    logger.addHandler(handler)
    return handler


def _bar_class() -> type:
    """``tqdm`` without its monitor thread (a thread per process that outlives the bar)."""
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0

    return Bar


class ProgressHook(SessionRunHook):
    """Show the progress of a ``MonitoredSession`` (``Progress``) after every run.

    Args:
        last_step: The step training ends at; None: unknown.
        loss: A callable returning the last loss (a number or a one-element tensor), read
            when the line is redrawn; None: no loss shown.
        checkpoint_saver_hook: The session's ``CheckpointSaverHook``, for the checkpoint
            timing; None: not shown.
        **progress_options: ``stream``, ``refresh_secs``, ``log_every_secs``,
            ``checkpoint_every_secs``, ``clock`` (see ``Progress``).

    Raises:
        RuntimeError: From ``begin()``, without a global step.

    TF name: none.
    """

    def __init__(
        self,
        last_step: int | None = None,
        loss: Any = None,
        checkpoint_saver_hook: Any = None,
        **progress_options: Any,
    ) -> None:
        driver = getattr(checkpoint_saver_hook, "checkpoint_driver", None)
        self.progress = Progress(last_step, checkpoint_driver=driver, **progress_options)
        self._loss = loss
        self._global_step: GlobalStepLike | None = None

    def begin(self) -> None:
        self._global_step = require_global_step("ProgressHook")

    def after_run(self, run_context: Any, run_values: object) -> None:
        self.progress.update(read_step(self._global_step), self._loss)

    def end(self, session: SessionLike) -> None:
        self.progress.close()
