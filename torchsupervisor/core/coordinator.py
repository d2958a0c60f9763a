"""Coordinate the termination of a set of threads, and run a function on a timer in a thread.

A ``Coordinator`` is a stop flag shared by the training loop and its helper threads, plus a
record of the first error any of them reported. Threads check ``should_stop()`` regularly;
anyone may call ``request_stop()``; ``join()`` waits for the threads, gives stragglers a grace
period, and re-raises the first recorded error on the joining thread::

    coord = Coordinator()
    threads = [LooperThread.loop(coord, 60, save_checkpoint), ...]
    with coord.stop_on_exception():
        while not coord.should_stop():
            train_step()
    coord.request_stop()
    coord.join(threads)          # re-raises the first error any thread reported

``LooperThread`` runs ``run_loop()`` (by default a target function) back to back or on a fixed,
drift-free schedule until the coordinator is told to stop; its errors go to the coordinator.

TF names: ``tf.train.Coordinator``, ``tf.train.LooperThread``.
"""

from __future__ import annotations

import logging
import numbers
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, NoReturn, TypeAlias

from torchsupervisor import errors
from torchsupervisor.core.checks import check_clock
from torchsupervisor.core.clock import REAL_CLOCK, Clock

__all__ = ["Coordinator", "LooperThread"]

logger = logging.getLogger("torchsupervisor")

ExcInfo: TypeAlias = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]

_DEFAULT_CLEAN_STOP_EXCEPTION_TYPES: tuple[type[BaseException], ...] = (
    errors.OutOfRangeError,
    StopIteration,
)

_INVALID_EX_TEXT = "ex must be a tuple or sys.exc_info must return the current exception: %s"
_STRAGGLERS_TEXT = "Coordinator stopped with threads still running: "

# Grace-period polling: the first sleep, doubled after each poll, never below this.
_MIN_GRACE_SLEEP_SECS = 0.001
# How often join() looks at the threads while no stop has been requested.
_JOIN_POLL_SECS = 1.0


def _is_valid_exc_info(exc_info: Any) -> bool:
    return (
        isinstance(exc_info, tuple)
        and len(exc_info) == 3
        and bool(exc_info[0])
        and isinstance(exc_info[1], BaseException)
    )


def _reraise(exc_info: ExcInfo) -> NoReturn:
    value = exc_info[1]
    assert value is not None
    raise value.with_traceback(exc_info[2])


class Coordinator:
    """Coordinate the termination of a set of threads and keep the first error they report.

    Any thread may call ``request_stop()``; all threads poll ``should_stop()`` (or block in
    ``wait_for_stop()``) and leave their loop when it turns True. The first exception passed to
    ``request_stop()`` (or raised inside ``stop_on_exception()``) is recorded and re-raised by
    ``join()``; later ones are ignored. Exceptions of the clean-stop types only stop, they are
    never recorded: an exhausted input is the normal end of training.

    Args:
        clean_stop_exception_types: Exception types that mean "stop cleanly": reporting one of
            them (or a subclass) behaves like ``request_stop(None)``. ``None`` means
            ``(errors.OutOfRangeError, StopIteration)``, so that both an exhausted queue and an
            exhausted Python iterator end training without an error. An empty sequence means
            every reported exception is an error.
        clock: The clock used by ``wait_for_stop()`` and the grace period of ``join()``.
            ``None`` means ``REAL_CLOCK``.

    Raises:
        TypeError: If ``clean_stop_exception_types`` is not ``None`` or a sequence of exception
            classes.

    Thread safety: every method may be called from any thread. ``should_stop()`` takes no
    lock: it reads one attribute, so it is cheap enough for every training step.

    TF name: ``tf.train.Coordinator`` (TF's default clean-stop types are only
    ``(OutOfRangeError,)``; ``StopIteration`` is added here).
    """

    def __init__(
        self,
        clean_stop_exception_types: Sequence[type[BaseException]] | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        if clean_stop_exception_types is None:
            types = _DEFAULT_CLEAN_STOP_EXCEPTION_TYPES
        else:
            types = _as_exception_types(clean_stop_exception_types)
        self._clean_stop_exception_types: tuple[type[BaseException], ...] = types
        self._clock = REAL_CLOCK if clock is None else check_clock("clock", clock)
        # Reentrant so that a signal handler calling request_stop() on a thread that is
        # already inside request_stop() cannot deadlock.
        self._lock = threading.RLock()
        self._stop_event = threading.Event()
        # Mirrors _stop_event for the lock-free should_stop(); set before the event is set.
        self._stop_requested = False
        self._exc_info_to_raise: ExcInfo | None = None
        self._joined = False
        # A dict used as an insertion-ordered set, so that straggler messages are stable.
        self._registered_threads: dict[threading.Thread, None] = {}

    @property
    def clean_stop_exception_types(self) -> tuple[type[BaseException], ...]:
        """The exception types that cause a clean stop (a tuple of classes).

        TF name: none (TF keeps them private, ``Coordinator._clean_stop_exception_types``).
        """
        return self._clean_stop_exception_types

    @property
    def clock(self) -> Clock:
        """The clock this coordinator waits with (``LooperThread`` schedules on it too).

        TF name: none (TF waits on real time; the clock is injectable here for tests).
        """
        return self._clock

    @property
    def joined(self) -> bool:
        """Whether ``join()`` has completed (reset by ``clear_stop()``).

        TF name: ``tf.train.Coordinator.joined``.
        """
        return self._joined

    def _filter_exception(self, ex: Any) -> Any:
        value = ex[1] if isinstance(ex, tuple) else ex
        if isinstance(value, self._clean_stop_exception_types):
            return None
        return ex

    def request_stop(self, ex: BaseException | ExcInfo | None = None) -> None:
        """Request that the threads stop; optionally record an exception for ``join()``.

        After this call ``should_stop()`` returns True and ``wait_for_stop()`` returns at once.
        Only the first exception reported while no stop was requested is recorded; any later
        one (or one reported after a plain ``request_stop()``) is ignored. An exception of a
        clean-stop type is treated as ``None``.

        Pass an exception instance only from inside the ``except`` block handling it: what is
        recorded is the exception currently being handled (``sys.exc_info()``), which keeps
        its traceback. Called with an exception outside an ``except`` block, the coordinator
        records a ``ValueError`` ("ex must be a tuple or sys.exc_info must return the current
        exception: ...") instead, which ``join()`` then raises.

        Args:
            ex: ``None`` for a plain stop; an exception instance being handled; or an exc_info
                tuple ``(type, value, traceback)`` as returned by ``sys.exc_info()``.

        Raises:
            BaseException: If ``join()`` has already completed and ``ex`` is a non-clean
                exception: it is raised right here, since no ``join()`` will report it. For an
                exc_info tuple its value is raised; for an instance, the exception currently
                being handled (or ``ex`` itself when none is).

        Thread safety: may be called from any thread, concurrently with every other method.

        TF name: ``tf.train.Coordinator.request_stop``.
        """
        with self._lock:
            ex = self._filter_exception(ex)
            if self._joined and ex is not None:
                self._raise_after_join(ex)
            if self._stop_event.is_set():
                return  # The first request wins; later exceptions are dropped.
            if ex is not None and self._exc_info_to_raise is None:
                exc_info = ex if isinstance(ex, tuple) else sys.exc_info()
                if _is_valid_exc_info(exc_info):
                    logger.info(
                        "Error reported to Coordinator: %s: %s",
                        type(exc_info[1]).__name__,
                        exc_info[1],
                        exc_info=exc_info,
                    )
                else:
                    err = ValueError(_INVALID_EX_TEXT % (exc_info,))
                    logger.info("Error reported to Coordinator: ValueError: %s", err)
                    exc_info = (ValueError, err, None)
                self._exc_info_to_raise = exc_info
            self._stop_requested = True
            self._stop_event.set()

    @staticmethod
    def _raise_after_join(ex: Any) -> None:
        if isinstance(ex, tuple):
            exc_info = ex
        else:
            exc_info = sys.exc_info()
            if exc_info[1] is None and isinstance(ex, BaseException):
                exc_info = (type(ex), ex, ex.__traceback__)
        if not _is_valid_exc_info(exc_info):
            raise ValueError(_INVALID_EX_TEXT % (exc_info,))
        _reraise(exc_info)

    def should_stop(self) -> bool:
        """Return True if a stop was requested.

        Returns:
            True once ``request_stop()`` has been called (until ``clear_stop()``).

        Thread safety: lock-free; may be called from any thread on every step.

        TF name: ``tf.train.Coordinator.should_stop``.
        """
        return self._stop_requested

    def clear_stop(self) -> None:
        """Clear the stop flag, the recorded exception and the joined state.

        Registered threads are kept. After this call ``should_stop()`` returns False.

        Thread safety: may be called from any thread; meant for reusing a coordinator after
        ``join()``, when no thread is running.

        TF name: ``tf.train.Coordinator.clear_stop``.
        """
        with self._lock:
            self._joined = False
            self._exc_info_to_raise = None
            self._stop_requested = False
            self._stop_event.clear()

    def stop_on_exception(self) -> _StopOnException:
        """Return a context manager that reports any exception in its body and swallows it.

        Any exception, including ``BaseException`` subclasses such as ``KeyboardInterrupt``,
        ends the body, is passed to ``request_stop()`` as an exc_info tuple, and is not
        re-raised from the ``with`` statement; ``join()`` re-raises it later (unless it is of a
        clean-stop type)::

            with coord.stop_on_exception():
                while not coord.should_stop():
                    work()

        Returns:
            A context manager; entering it yields ``None``.

        Thread safety: may be used by several threads at once.

        TF name: ``tf.train.Coordinator.stop_on_exception``.
        """
        return _StopOnException(self)

    def wait_for_stop(self, timeout: float | None = None) -> bool:
        """Block until a stop is requested or ``timeout`` seconds pass, on this clock.

        Args:
            timeout: The longest wait in seconds; ``None`` waits until a stop is requested;
                zero or less only checks.

        Returns:
            True if a stop was requested, False if the timeout expired first.

        Thread safety: may be called from any thread.

        TF name: ``tf.train.Coordinator.wait_for_stop``.
        """
        return self._clock.wait(self._stop_event, timeout)

    def register_thread(self, thread: threading.Thread) -> None:
        """Register a thread for ``join()`` to wait for (even if not passed to it).

        Registering the same thread twice has no further effect. ``join()`` forgets all
        registered threads when it completes.

        Args:
            thread: A ``threading.Thread`` (started or not; one never started counts as done).

        Thread safety: may be called from any thread.

        TF name: ``tf.train.Coordinator.register_thread``.
        """
        with self._lock:
            self._registered_threads[thread] = None

    def join(
        self,
        threads: Iterable[threading.Thread] | None = None,
        stop_grace_period_secs: float = 120,
        ignore_live_threads: bool = False,
    ) -> None:
        """Wait for the threads to stop, then re-raise the first recorded exception.

        The threads are the registered ones plus ``threads``. In order:

        1. While any thread is alive and no stop was requested, wait (polling
           ``wait_for_stop(1.0)``). ``join()`` never requests a stop itself.
        2. After the stop request, give the live threads up to ``stop_grace_period_secs`` to
           finish, checking after sleeps of 1 ms, 2 ms, 4 ms, ... (capped by what remains).
        3. Mark the coordinator joined and forget the registered threads.
        4. If an exception was recorded, raise it (with its original traceback), even if
           threads are still alive. Otherwise, if threads are still alive, raise
           ``RuntimeError("Coordinator stopped with threads still running: " + names)``
           (names separated by spaces), or only log that at INFO level when
           ``ignore_live_threads`` is True.

        Args:
            threads: Threads to wait for in addition to the registered ones; ``None`` means
                only the registered ones.
            stop_grace_period_secs: Seconds the threads get to finish after the stop request.
            ignore_live_threads: If True, threads still alive after the grace period are only
                logged, not an error.

        Raises:
            BaseException: The first exception recorded by ``request_stop()`` or
                ``stop_on_exception()``, if any (takes priority over stragglers).
            RuntimeError: If threads are still alive after the grace period and
                ``ignore_live_threads`` is False.

        Thread safety: call from one thread (normally the one that started the others).

        TF name: ``tf.train.Coordinator.join``.
        """
        with self._lock:
            to_join = dict(self._registered_threads)
        if threads is not None:
            for thread in threads:
                to_join[thread] = None

        def any_alive() -> bool:
            return any(t.is_alive() for t in to_join)

        while any_alive() and not self.wait_for_stop(_JOIN_POLL_SECS):
            pass

        clock = self._clock
        remaining = stop_grace_period_secs
        deadline = clock.monotonic() + stop_grace_period_secs
        sleep_secs = _MIN_GRACE_SLEEP_SECS
        while any_alive() and remaining >= 0:
            clock.sleep(sleep_secs)
            remaining = deadline - clock.monotonic()
            sleep_secs = max(min(2 * sleep_secs, remaining), _MIN_GRACE_SLEEP_SECS)

        stragglers = [t.name for t in to_join if t.is_alive()]
        message = _STRAGGLERS_TEXT + " ".join(stragglers)
        with self._lock:
            self._joined = True
            self._registered_threads.clear()
            exc_info = self._exc_info_to_raise
        if exc_info is not None:
            if stragglers:
                logger.info("%s", message)
            _reraise(exc_info)
        if stragglers:
            if ignore_live_threads:
                logger.info("%s", message)
            else:
                raise RuntimeError(message)

    def raise_requested_exception(self) -> None:
        """Raise the recorded exception, if any; do nothing otherwise.

        The exception stays recorded (``join()`` raises it again).

        Raises:
            BaseException: The first exception recorded by ``request_stop()``, with its
                original traceback.

        Thread safety: may be called from any thread.

        TF name: ``tf.train.Coordinator.raise_requested_exception``.
        """
        with self._lock:
            exc_info = self._exc_info_to_raise
        if exc_info is not None:
            _reraise(exc_info)


class _StopOnException:
    """The context manager returned by ``Coordinator.stop_on_exception()``."""

    __slots__ = ("_coord",)

    def __init__(self, coord: Coordinator) -> None:
        self._coord = coord

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc_type is None:
            return False
        self._coord.request_stop((exc_type, exc_value, tb))
        return True


def _as_exception_types(value: object) -> tuple[type[BaseException], ...]:
    expected = "None or a sequence of exception classes"
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"clean_stop_exception_types must be {expected}, got {value!r}")
    types = tuple(value)
    for t in types:
        if not (isinstance(t, type) and issubclass(t, BaseException)):
            raise TypeError(
                f"clean_stop_exception_types must be {expected}, got {value!r} "
                f"(item {t!r} is not an exception class)"
            )
    return types


class LooperThread(threading.Thread):
    """A daemon thread that calls ``run_loop()`` repeatedly until the coordinator stops.

    What ``run()`` does, all inside ``coord.stop_on_exception()``::

        start_loop()
        if timer_interval_secs is None:            # back to back
            while not coord.should_stop():
                run_loop()
        else:                                      # fixed schedule, first call at once
            next_secs = clock.monotonic()
            while not <stop requested within next_secs - clock.monotonic() seconds>:
                next_secs += timer_interval_secs
                run_loop()
        stop_loop()                                # only when the loop ended normally

    With an interval, calls are due at ``start + k * timer_interval_secs`` (no drift); a call
    that overruns makes the following due calls run at once to catch up. An interval of 0
    behaves as back to back. The wait is interrupted as soon as a stop is requested. Any
    exception from a hook or from ``run_loop()`` is reported to the coordinator (and ends the
    thread), so ``coord.join()`` re-raises it.

    Subclass and override ``run_loop()`` (and optionally ``start_loop()``/``stop_loop()``), or
    pass ``target``; the default ``run_loop()`` calls ``target(*args, **kwargs)``.

    Args:
        coord: The ``Coordinator`` to watch and report to. The thread registers itself with it
            here, so ``coord.join()`` waits for it without being given it.
        timer_interval_secs: Seconds between the starts of two calls; ``None`` means back to
            back.
        target: The callable for the default ``run_loop()``; ``None`` when a subclass
            overrides ``run_loop()``.
        args: Positional arguments for ``target``; ``None`` means ``()``.
        kwargs: Keyword arguments for ``target``; ``None`` means ``{}``.
        clock: The clock to schedule and wait on; ``None`` means the coordinator's clock.

    Raises:
        ValueError: ``"'coord' argument must be a Coordinator: <coord>"``;
            ``"'args' and 'kwargs' argument require that you also pass 'target'"``; or if
            ``timer_interval_secs`` is not ``None`` or a number >= 0.

    The thread is a daemon and is named after ``target`` (its ``__name__``), or after the
    class when there is no target, so that ``coord.join()`` names it if it will not stop.

    Thread safety: the hooks run on this thread only; ``coord`` is shared as documented there.

    TF name: ``tf.train.LooperThread``.
    """

    def __init__(
        self,
        coord: Coordinator,
        timer_interval_secs: float | None,
        target: Callable[..., Any] | None = None,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        if not isinstance(coord, Coordinator):
            raise ValueError(f"'coord' argument must be a Coordinator: {coord}")
        if target is None and (args or kwargs):
            raise ValueError("'args' and 'kwargs' argument require that you also pass 'target'")
        if timer_interval_secs is not None and not (
            isinstance(timer_interval_secs, numbers.Real) and timer_interval_secs >= 0
        ):
            raise ValueError(
                f"'timer_interval_secs' must be None or a number >= 0, got {timer_interval_secs!r}"
            )
        if target is not None:
            name = getattr(target, "__name__", None) or type(target).__name__
        else:
            name = type(self).__name__
        super().__init__(name=name, daemon=True)
        self._coord = coord
        self._timer_interval_secs = (
            None if timer_interval_secs is None else float(timer_interval_secs)
        )
        self._target = target
        self._args: tuple[Any, ...] = tuple(args) if args else ()
        self._kwargs: dict[str, Any] = dict(kwargs) if kwargs else {}
        self._looper_clock = coord.clock if clock is None else clock
        coord.register_thread(self)

    @staticmethod
    def loop(
        coord: Coordinator,
        timer_interval_secs: float | None,
        target: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> LooperThread:
        """Start a ``LooperThread`` that calls ``target(*args, **kwargs)`` until stop.

        Args:
            coord: The ``Coordinator``; the thread registers with it.
            timer_interval_secs: Seconds between the starts of two calls; ``None`` means back
                to back. The first call is immediate.
            target: The callable to call.
            args: Positional arguments for ``target``; ``None`` means ``()``.
            kwargs: Keyword arguments for ``target``; ``None`` means ``{}``.

        Returns:
            The started ``LooperThread``.

        Raises:
            ValueError: As for the ``LooperThread`` constructor.

        TF name: ``tf.train.LooperThread.loop``.
        """
        looper = LooperThread(coord, timer_interval_secs, target=target, args=args, kwargs=kwargs)
        looper.start()
        return looper

    def _wait_for_stop(self, timeout_secs: float) -> bool:
        # The coordinator's own event, waited on with this thread's clock, so that a clock
        # given here both reads the time and does the waiting.
        return self._looper_clock.wait(self._coord._stop_event, timeout_secs)

    def run(self) -> None:
        """Run the loop described in the class docstring (called by ``start()``).

        Exceptions are not raised here: they are reported to the coordinator.

        TF name: ``tf.train.LooperThread.run``.
        """
        coord = self._coord
        with coord.stop_on_exception():
            self.start_loop()
            interval_secs = self._timer_interval_secs
            if interval_secs is None:
                while not coord.should_stop():
                    self.run_loop()
            else:
                clock = self._looper_clock
                next_secs = clock.monotonic()
                while not self._wait_for_stop(next_secs - clock.monotonic()):
                    next_secs += interval_secs
                    self.run_loop()
            self.stop_loop()

    def start_loop(self) -> None:
        """Run once on this thread before the first ``run_loop()`` (default: nothing).

        TF name: ``tf.train.LooperThread.start_loop``.
        """

    def stop_loop(self) -> None:
        """Run once on this thread after the loop ends normally (default: nothing).

        Not called when ``start_loop()`` or ``run_loop()`` raised.

        TF name: ``tf.train.LooperThread.stop_loop``.
        """

    def run_loop(self) -> None:
        """Do one iteration; by default call ``target(*args, **kwargs)`` (nothing without one).

        TF name: ``tf.train.LooperThread.run_loop``.
        """
        if self._target is not None:
            self._target(*self._args, **self._kwargs)
