"""Timers that decide, at a given global step, whether a periodic action is due.

A hook that acts "every N steps or every N seconds" asks ``should_trigger_for_step(step)`` after
each run and, when it acts, records the step with ``update_last_triggered_step(step)``, which
also returns how much time and how many steps passed since the last action (a steps/sec rate).

The timers hold no thread and never sleep: time is read from the injected clock (its monotonic
time, so wall-clock jumps do not fire or starve a timer), and tests drive them with a fake one.

TF names: ``tf.compat.v1.train.SecondOrStepTimer``, ``NeverTriggerTimer`` (internal in TF).
"""

from __future__ import annotations

from torchsupervisor.core.checks import check_clock, check_int, check_number
from torchsupervisor.core.clock import REAL_CLOCK, Clock

__all__ = ["NeverTriggerTimer", "SecondOrStepTimer"]


class SecondOrStepTimer:
    """Trigger every ``every_secs`` seconds or every ``every_steps`` steps (exactly one).

    The first call of ``should_trigger_for_step`` always triggers; a step equal to the last
    triggered step never does.

    Args:
        every_secs: Seconds between two triggers (on the clock's monotonic time); None: use
            ``every_steps``.
        every_steps: Steps between two triggers; None: use ``every_secs``.
        clock: Time source; None means ``REAL_CLOCK``.

    Raises:
        ValueError: ``"Either every_secs or every_steps should be provided."`` when both are
            None; ``"Can not provide both every_secs and every_steps."`` when both are given.

    Thread safety: not thread-safe; a timer belongs to one hook on the training thread.

    TF name: ``tf.compat.v1.train.SecondOrStepTimer``.
    """

    __slots__ = ("_clock", "_every_secs", "_every_steps", "_last_step", "_last_time")

    def __init__(
        self,
        every_secs: float | None = None,
        every_steps: int | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        every_secs = check_number("every_secs", every_secs, allow_none=True)
        every_steps = check_int("every_steps", every_steps, allow_none=True)
        check_clock("clock", clock)
        if every_secs is None and every_steps is None:
            raise ValueError("Either every_secs or every_steps should be provided.")
        if every_secs is not None and every_steps is not None:
            raise ValueError("Can not provide both every_secs and every_steps.")
        self._every_secs = every_secs
        self._every_steps = every_steps
        self._clock = clock or REAL_CLOCK
        self._last_step: int | None = None
        self._last_time: float | None = None

    @property
    def every_secs(self) -> float | None:
        """The interval in seconds (None: by steps).

        TF name: none (TF keeps it private).
        """
        return self._every_secs

    @property
    def every_steps(self) -> int | None:
        """The interval in steps (None: by seconds).

        TF name: none (TF keeps it private).
        """
        return self._every_steps

    def reset(self) -> None:
        """Forget the last trigger: the next ``should_trigger_for_step`` returns True.

        TF name: ``tf.compat.v1.train.SecondOrStepTimer.reset``.
        """
        self._last_step = None
        self._last_time = None

    def should_trigger_for_step(self, step: int) -> bool:
        """Return True if the action is due at ``step``.

        Args:
            step: The global step (or iteration count) now.

        Returns:
            True if never triggered; False if ``step`` is the last triggered step; otherwise
            True when ``every_secs`` passed since the last trigger or ``step`` is at least
            ``every_steps`` past it.

        TF name: ``tf.compat.v1.train.SecondOrStepTimer.should_trigger_for_step``.
        """
        last_step = self._last_step
        if last_step is None:
            return True
        if step == last_step:
            return False
        if self._every_steps is not None:
            return step >= last_step + self._every_steps
        return self._clock.monotonic() >= self._last_time + self._every_secs

    def update_last_triggered_step(self, step: int) -> tuple[float | None, int | None]:
        """Record a trigger at ``step`` now.

        Args:
            step: The step the action ran at.

        Returns:
            ``(elapsed_secs, elapsed_steps)`` since the previous trigger; ``(None, None)`` at
            the first trigger (or the first after ``reset``).

        TF name: ``tf.compat.v1.train.SecondOrStepTimer.update_last_triggered_step``.
        """
        now = self._clock.monotonic()
        if self._last_time is None:
            elapsed: tuple[float | None, int | None] = (None, None)
        else:
            elapsed = (now - self._last_time, step - self._last_step)
        self._last_time = now
        self._last_step = step
        return elapsed

    def last_triggered_step(self) -> int | None:
        """Return the step of the last trigger, or None.

        TF name: ``tf.compat.v1.train.SecondOrStepTimer.last_triggered_step``.
        """
        return self._last_step


class NeverTriggerTimer:
    """A timer that never triggers (for hooks that act only at the end).

    Thread safety: stateless.

    TF name: ``NeverTriggerTimer`` (``basic_session_run_hooks``).
    """

    __slots__ = ()

    def reset(self) -> None:
        """Do nothing.

        TF name: ``NeverTriggerTimer.reset`` (internal in ``basic_session_run_hooks``).
        """

    def should_trigger_for_step(self, step: int) -> bool:
        """Return False.

        TF name: ``NeverTriggerTimer.should_trigger_for_step`` (internal in TF).
        """
        del step
        return False

    def update_last_triggered_step(self, step: int) -> tuple[None, None]:
        """Return ``(None, None)``.

        TF name: ``NeverTriggerTimer.update_last_triggered_step`` (internal in TF).
        """
        del step
        return (None, None)

    def last_triggered_step(self) -> None:
        """Return None.

        TF name: ``NeverTriggerTimer.last_triggered_step`` (internal in TF).
        """
        return None
