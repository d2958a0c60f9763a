"""Tests of Coordinator and LooperThread (TF: coordinator_test.py, the LooperThread parts)."""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

import pytest

from torchsupervisor import errors
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.coordinator import Coordinator, LooperThread

JOIN_TIMEOUT_SECS = 10.0


class ManualClock(Clock):
    """A clock whose time moves only when a test (or the code under test) advances it.

    Unlike the ``FakeClock`` of conftest.py, a wait with a timeout does not jump ahead: it
    blocks until the time is advanced, so a test controls every tick of a schedule.

    ``sleep`` advances the time at once. ``wait`` returns at once when the event is set or the
    timeout is <= 0; otherwise it blocks (for real) until the event is set or another thread
    advances the time past the deadline. ``blocked_waits`` counts the waits that blocked, so
    a test can wait until a looper is parked in its timer before advancing the time.
    """

    def __init__(self, start_secs: float = 100.0) -> None:
        self._now = start_secs
        self._cond = threading.Condition()
        self.sleeps: list[float] = []
        self.wait_timeouts: list[float | None] = []
        self.blocked_waits = 0
        self.on_sleep: Callable[[float], None] | None = None

    def monotonic(self) -> float:
        with self._cond:
            return self._now

    def time(self) -> float:
        return 1_500_000_000.0 + self.monotonic()

    def advance(self, secs: float) -> None:
        with self._cond:
            self._now += secs
            self._cond.notify_all()

    def sleep(self, secs: float) -> None:
        with self._cond:
            self.sleeps.append(secs)
            if secs > 0:
                self._now += secs
            self._cond.notify_all()
        if self.on_sleep is not None:
            self.on_sleep(secs)

    def wait(self, event: threading.Event, timeout_secs: float | None) -> bool:
        with self._cond:
            self.wait_timeouts.append(timeout_secs)
            if event.is_set() or (timeout_secs is not None and timeout_secs <= 0):
                return event.is_set()
            deadline = None if timeout_secs is None else self._now + timeout_secs
            self.blocked_waits += 1
            self._cond.notify_all()
            give_up = time.monotonic() + 30.0  # only against hanging the test run
            while not event.is_set() and (deadline is None or self._now < deadline):
                if time.monotonic() > give_up:
                    raise AssertionError("ManualClock.wait: nobody advanced the time")
                # event.set() does not notify this condition: look again every few ms.
                self._cond.wait(0.005)
            return event.is_set()

    def wait_for_blocked_waits(self, count: int) -> None:
        """Block (for real, bounded) until ``count`` waits have blocked in total."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self.blocked_waits >= count, JOIN_TIMEOUT_SECS)
        assert ok, f"expected {count} blocked waits, saw {self.blocked_waits}"


@pytest.fixture
def stuck_thread() -> Iterator[Callable[[str], threading.Thread]]:
    """Make started threads that ignore the coordinator until the test ends."""
    release = threading.Event()
    made: list[threading.Thread] = []

    def make(name: str) -> threading.Thread:
        t = threading.Thread(target=release.wait, name=name, daemon=True)
        t.start()
        made.append(t)
        return t

    yield make
    release.set()
    for t in made:
        t.join(timeout=JOIN_TIMEOUT_SECS)
        assert not t.is_alive()


def _join_thread(t: threading.Thread) -> None:
    t.join(timeout=JOIN_TIMEOUT_SECS)
    assert not t.is_alive(), f"thread {t.name} did not finish"


def _fail(message: str) -> None:
    raise RuntimeError(message)


# --------------------------------------------------------------------------------------------
# Coordinator: stop flag, waiting


def test_request_stop_sets_should_stop_and_wakes_wait_for_stop() -> None:
    coord = Coordinator()
    assert coord.should_stop() is False
    assert coord.wait_for_stop(0) is False
    assert coord.joined is False
    coord.request_stop()
    assert coord.should_stop() is True
    assert coord.wait_for_stop(0) is True
    assert coord.wait_for_stop() is True
    coord.join()  # nothing recorded, no threads: returns
    assert coord.joined is True


def test_wait_for_stop_uses_the_clock_and_returns_false_on_timeout() -> None:
    clock = ManualClock()
    coord = Coordinator(clock=clock)
    assert coord.clock is clock
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(coord.wait_for_stop(2.5)))
    waiter.start()
    clock.wait_for_blocked_waits(1)
    clock.advance(2.5)
    _join_thread(waiter)
    assert results == [False]
    assert clock.wait_timeouts == [2.5]

    waiter = threading.Thread(target=lambda: results.append(coord.wait_for_stop()))
    waiter.start()
    clock.wait_for_blocked_waits(2)
    coord.request_stop()
    _join_thread(waiter)
    assert results == [False, True]


def test_should_stop_does_not_take_the_lock() -> None:
    coord = Coordinator()
    holding, release = threading.Event(), threading.Event()

    def hold_lock() -> None:
        with coord._lock:
            holding.set()
            release.wait(6 * JOIN_TIMEOUT_SECS)  # longer than the reader is given below

    holder = threading.Thread(target=hold_lock)
    holder.start()
    try:
        assert holding.wait(JOIN_TIMEOUT_SECS)
        answers: list[bool] = []
        reader = threading.Thread(target=lambda: answers.append(coord.should_stop()))
        reader.start()
        reader.join(timeout=JOIN_TIMEOUT_SECS)
        assert answers == [False]
    finally:
        release.set()
        _join_thread(holder)


# --------------------------------------------------------------------------------------------
# Coordinator: recording exceptions


def test_exception_is_reraised_by_join_with_its_traceback(caplog) -> None:
    caplog.set_level(logging.INFO, logger="torchsupervisor")
    coord = Coordinator()
    try:
        _fail("boom")
    except RuntimeError as e:
        recorded = e
        coord.request_stop(e)
    assert coord.should_stop()
    assert "Error reported to Coordinator: RuntimeError: boom" in caplog.text
    with pytest.raises(RuntimeError, match=r"^boom$") as excinfo:
        coord.join()
    assert excinfo.value is recorded
    frames = [f.name for f in traceback.extract_tb(excinfo.value.__traceback__)]
    assert "_fail" in frames
    assert coord.joined


def test_exc_info_tuple_is_recorded() -> None:
    coord = Coordinator()
    try:
        _fail("from tuple")
    except RuntimeError:
        coord.request_stop(sys.exc_info())
    with pytest.raises(RuntimeError, match=r"from tuple") as excinfo:
        coord.join()
    assert "_fail" in [f.name for f in traceback.extract_tb(excinfo.value.__traceback__)]


def test_first_exception_wins() -> None:
    coord = Coordinator()
    try:
        raise RuntimeError("first")
    except RuntimeError as e:
        coord.request_stop(e)
    try:
        raise ValueError("second")
    except ValueError as e:
        coord.request_stop(e)
    with pytest.raises(RuntimeError, match=r"^first$"):
        coord.join()


def test_exception_after_a_plain_stop_is_dropped() -> None:
    coord = Coordinator()
    coord.request_stop()
    try:
        raise RuntimeError("too late")
    except RuntimeError as e:
        coord.request_stop(e)
    coord.join()  # nothing raised
    coord.raise_requested_exception()  # nothing recorded


@pytest.mark.parametrize(
    "make_error",
    [
        lambda: errors.OutOfRangeError("end of input"),
        lambda: StopIteration(),
        lambda: type("EndOfQueue", (errors.OutOfRangeError,), {})("subclass"),
    ],
    ids=["OutOfRangeError", "StopIteration", "subclass"],
)
@pytest.mark.parametrize("as_tuple", [False, True], ids=["instance", "exc_info"])
def test_default_clean_stop_types_stop_without_error(make_error, as_tuple) -> None:
    coord = Coordinator()
    assert coord.clean_stop_exception_types == (errors.OutOfRangeError, StopIteration)
    try:
        raise make_error()
    except BaseException as e:
        coord.request_stop(sys.exc_info() if as_tuple else e)
    assert coord.should_stop()
    coord.raise_requested_exception()
    coord.join()


def test_clean_stop_exception_does_not_hide_a_later_error_only_stops() -> None:
    coord = Coordinator()
    try:
        raise errors.OutOfRangeError("end")
    except errors.OutOfRangeError as e:
        coord.request_stop(e)
    try:
        raise RuntimeError("after clean stop")
    except RuntimeError as e:
        coord.request_stop(e)  # stop already requested: ignored, as in TF
    coord.join()


def test_explicit_empty_clean_stop_types_make_out_of_range_an_error() -> None:
    coord = Coordinator(clean_stop_exception_types=[])
    assert coord.clean_stop_exception_types == ()
    try:
        raise errors.OutOfRangeError("end of input")
    except errors.OutOfRangeError as e:
        coord.request_stop(e)
    with pytest.raises(errors.OutOfRangeError, match=r"end of input"):
        coord.join()


def test_custom_clean_stop_types_replace_the_default() -> None:
    coord = Coordinator(clean_stop_exception_types=[KeyError])
    try:
        raise KeyError("done")
    except KeyError as e:
        coord.request_stop(e)
    coord.join()
    coord.clear_stop()
    try:
        raise StopIteration
    except StopIteration as e:
        coord.request_stop(e)
    with pytest.raises(StopIteration):
        coord.join()


@pytest.mark.parametrize(
    "bad", [errors.OutOfRangeError, "OutOfRangeError", [1], (KeyError, "x")], ids=repr
)
def test_clean_stop_types_must_be_exception_classes(bad) -> None:
    with pytest.raises(TypeError, match=r"clean_stop_exception_types must be None or a sequence"):
        Coordinator(clean_stop_exception_types=bad)


def test_exception_outside_except_block_records_value_error() -> None:
    coord = Coordinator()
    coord.request_stop(RuntimeError("not being handled"))
    assert coord.should_stop()
    expected = "ex must be a tuple or sys.exc_info must return the current exception: "
    with pytest.raises(ValueError) as excinfo:
        coord.join()
    assert str(excinfo.value) == expected + "(None, None, None)"


def test_empty_exc_info_tuple_records_value_error() -> None:
    coord = Coordinator()
    coord.request_stop(sys.exc_info())  # (None, None, None): no exception is being handled
    with pytest.raises(ValueError, match=r"^ex must be a tuple or sys.exc_info must return"):
        coord.raise_requested_exception()


def test_request_stop_after_join_raises_at_once() -> None:
    coord = Coordinator()
    coord.request_stop()
    coord.join()

    coord.request_stop()  # a plain stop after join is fine
    try:
        raise errors.OutOfRangeError("end")
    except errors.OutOfRangeError as e:
        coord.request_stop(e)  # so is a clean stop
    try:
        raise RuntimeError("late instance")
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match=r"late instance") as excinfo:
            coord.request_stop(e)
        assert excinfo.value is e
    try:
        raise RuntimeError("late tuple")
    except RuntimeError:
        with pytest.raises(RuntimeError, match=r"late tuple"):
            coord.request_stop(sys.exc_info())
    try:
        raise KeyError("being handled")
    except KeyError:
        with pytest.raises(KeyError, match=r"being handled"):
            coord.request_stop(RuntimeError("other"))  # TF raises the handled exception
    with pytest.raises(RuntimeError, match=r"outside"):
        coord.request_stop(RuntimeError("outside"))  # nothing handled: the instance itself
    with pytest.raises(ValueError, match=r"^ex must be a tuple"):
        coord.request_stop((None, None, None))


def test_clear_stop_resets_flag_exception_and_joined() -> None:
    coord = Coordinator()
    try:
        raise RuntimeError("old")
    except RuntimeError as e:
        coord.request_stop(e)
    with pytest.raises(RuntimeError, match=r"old"):
        coord.join()
    assert coord.joined
    coord.clear_stop()
    assert coord.should_stop() is False
    assert coord.wait_for_stop(0) is False
    assert coord.joined is False
    coord.raise_requested_exception()  # the old exception is gone
    try:
        raise ValueError("new")
    except ValueError as e:
        coord.request_stop(e)  # recorded again (not raised: no longer joined)
    with pytest.raises(ValueError, match=r"new"):
        coord.join()


def test_clear_stop_keeps_registered_threads(stuck_thread) -> None:
    clock = ManualClock()
    coord = Coordinator(clock=clock)
    coord.register_thread(stuck_thread("kept"))
    coord.clear_stop()
    coord.request_stop()
    with pytest.raises(RuntimeError, match=r"running: kept$"):
        coord.join(stop_grace_period_secs=1)


def test_raise_requested_exception_keeps_it_recorded() -> None:
    coord = Coordinator()
    coord.raise_requested_exception()  # nothing recorded yet
    try:
        raise RuntimeError("kept")
    except RuntimeError as e:
        coord.request_stop(e)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"kept"):
            coord.raise_requested_exception()
    with pytest.raises(RuntimeError, match=r"kept"):
        coord.join()


# --------------------------------------------------------------------------------------------
# Coordinator: stop_on_exception


def test_stop_on_exception_swallows_and_records() -> None:
    coord = Coordinator()
    reached_end = False
    with coord.stop_on_exception() as entered:
        assert entered is None
        _fail("in body")
        reached_end = True
    assert reached_end is False
    assert coord.should_stop()
    with pytest.raises(RuntimeError, match=r"in body") as excinfo:
        coord.join()
    assert "_fail" in [f.name for f in traceback.extract_tb(excinfo.value.__traceback__)]


def test_stop_on_exception_without_exception_does_not_stop() -> None:
    coord = Coordinator()
    with coord.stop_on_exception():
        pass
    assert coord.should_stop() is False


class _Interrupt(BaseException):
    """Like KeyboardInterrupt: not an Exception."""


@pytest.mark.parametrize("error_type", [_Interrupt, SystemExit])
def test_stop_on_exception_catches_base_exceptions(error_type) -> None:
    coord = Coordinator()
    with coord.stop_on_exception():
        raise error_type("interrupted")
    assert coord.should_stop()
    with pytest.raises(error_type):
        coord.join()


def test_stop_on_exception_clean_stop_type_is_not_an_error() -> None:
    coord = Coordinator()
    with coord.stop_on_exception():
        next(iter([]))
    assert coord.should_stop()
    coord.join()


# --------------------------------------------------------------------------------------------
# Coordinator: join


def test_join_names_stragglers_after_the_grace_period(stuck_thread) -> None:
    clock = ManualClock()
    coord = Coordinator(clock=clock)
    coord.register_thread(stuck_thread("stuck-a"))
    coord.register_thread(stuck_thread("stuck-b"))
    coord.request_stop()
    with pytest.raises(RuntimeError) as excinfo:
        coord.join(stop_grace_period_secs=5)
    assert str(excinfo.value) == "Coordinator stopped with threads still running: stuck-a stuck-b"
    # Doubling sleeps from 1 ms, capped by what remains of the 5 s.
    assert clock.sleeps[:4] == [0.001, 0.002, 0.004, 0.008]
    assert all(b == pytest.approx(2 * a) for a, b in zip(clock.sleeps[:10], clock.sleeps[1:10]))
    assert 5.0 <= sum(clock.sleeps) <= 5.0 + 0.001 + 1e-9
    assert coord.joined


def test_join_straggler_with_real_clock(stuck_thread) -> None:
    coord = Coordinator()
    coord.request_stop()
    with pytest.raises(
        RuntimeError, match=r"^Coordinator stopped with threads still running: lazy$"
    ):
        coord.join([stuck_thread("lazy")], stop_grace_period_secs=0.05)


def test_join_ignore_live_threads_logs_instead(stuck_thread, caplog) -> None:
    caplog.set_level(logging.INFO, logger="torchsupervisor")
    coord = Coordinator(clock=ManualClock())
    coord.register_thread(stuck_thread("sleepy"))
    coord.request_stop()
    coord.join(stop_grace_period_secs=2, ignore_live_threads=True)
    assert coord.joined
    records = [r for r in caplog.records if r.name == "torchsupervisor"]
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.INFO, "Coordinator stopped with threads still running: sleepy")
    ]


def test_recorded_exception_has_priority_over_stragglers(stuck_thread) -> None:
    coord = Coordinator(clock=ManualClock())
    coord.register_thread(stuck_thread("straggler"))
    try:
        raise KeyError("the real problem")
    except KeyError as e:
        coord.request_stop(e)
    with pytest.raises(KeyError, match=r"the real problem"):
        coord.join(stop_grace_period_secs=1)


def test_thread_that_stops_within_the_grace_period_is_fine() -> None:
    clock = ManualClock()
    coord = Coordinator(clock=clock)
    release = threading.Event()
    slow = threading.Thread(target=release.wait, name="slow", daemon=True)
    slow.start()
    coord.register_thread(slow)

    def finish_thread_on_first_sleep(secs: float) -> None:
        release.set()
        _join_thread(slow)

    clock.on_sleep = finish_thread_on_first_sleep
    coord.request_stop()
    coord.join(stop_grace_period_secs=120)  # no RuntimeError
    assert clock.sleeps == [0.001]  # stopped polling as soon as the thread was gone
    assert coord.joined


def test_join_waits_for_a_stop_request_while_threads_run() -> None:
    coord = Coordinator()
    gate = threading.Event()

    def worker() -> None:
        gate.wait(JOIN_TIMEOUT_SECS)
        coord.request_stop()

    t = threading.Thread(target=worker, name="worker")
    t.start()
    coord.register_thread(t)
    outcome: list[object] = []
    joiner = threading.Thread(target=lambda: outcome.append(coord.join()))
    joiner.start()
    joiner.join(timeout=0.2)
    assert joiner.is_alive()  # no stop yet and the worker still runs: join keeps waiting
    assert outcome == []
    gate.set()
    _join_thread(joiner)
    assert outcome == [None]
    assert not t.is_alive()


def test_join_returns_when_threads_end_without_stop() -> None:
    coord = Coordinator()
    gate = threading.Event()
    t = threading.Thread(target=gate.wait, args=(JOIN_TIMEOUT_SECS,), name="short")
    t.start()
    coord.register_thread(t)
    joiner = threading.Thread(target=coord.join)
    joiner.start()
    gate.set()
    _join_thread(joiner)
    assert not t.is_alive()
    assert coord.should_stop() is False  # join never requests a stop itself
    assert coord.joined


def test_join_includes_threads_passed_in_addition_to_registered(stuck_thread) -> None:
    coord = Coordinator(clock=ManualClock())
    done = threading.Thread(target=lambda: None, name="done")
    done.start()
    _join_thread(done)
    registered = stuck_thread("registered")
    coord.register_thread(registered)
    coord.register_thread(done)
    extra = stuck_thread("extra")
    coord.request_stop()
    with pytest.raises(RuntimeError) as excinfo:
        coord.join([extra, registered, done], stop_grace_period_secs=1)
    assert str(excinfo.value) == (
        "Coordinator stopped with threads still running: registered extra"
    )


def test_register_thread_and_join_forgets_registered_threads(stuck_thread) -> None:
    coord = Coordinator(clock=ManualClock())
    t = stuck_thread("once")
    coord.register_thread(t)
    coord.register_thread(t)  # twice: still named once
    coord.request_stop()
    with pytest.raises(RuntimeError, match=r"running: once$"):
        coord.join(stop_grace_period_secs=1)
    # The registry was cleared by join: the still-running thread is no longer waited for.
    coord.join(stop_grace_period_secs=1)


# --------------------------------------------------------------------------------------------
# LooperThread: construction


def _target() -> None:
    pass


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: LooperThread("coord", 1.0), "'coord' argument must be a Coordinator: coord"),
        (lambda c: LooperThread(None, None), "'coord' argument must be a Coordinator: None"),
        (
            lambda c: LooperThread(c, 1.0, args=(1,)),
            "'args' and 'kwargs' argument require that you also pass 'target'",
        ),
        (
            lambda c: LooperThread(c, 1.0, kwargs={"a": 1}),
            "'args' and 'kwargs' argument require that you also pass 'target'",
        ),
        (lambda c: LooperThread(c, -1.0, _target), "'timer_interval_secs' must be None or a"),
        (lambda c: LooperThread(c, math.nan, _target), "'timer_interval_secs' must be None or a"),
        (lambda c: LooperThread(c, "5", _target), "'timer_interval_secs' must be None or a"),
    ],
    ids=["coord-str", "coord-none", "args", "kwargs", "negative", "nan", "str"],
)
def test_looper_argument_errors(call, message) -> None:
    with pytest.raises(ValueError) as excinfo:
        call(Coordinator())
    assert str(excinfo.value).startswith(message)


def test_looper_is_a_daemon_named_after_its_target() -> None:
    coord = Coordinator()

    def save_checkpoint() -> None:
        pass

    class SummaryService(LooperThread):
        pass

    looper = LooperThread(coord, 60, save_checkpoint)
    assert looper.daemon is True
    assert looper.name == "save_checkpoint"
    assert SummaryService(coord, 60).name == "SummaryService"
    assert LooperThread(coord, None, lambda: None, args=()).name == "<lambda>"


def test_looper_registers_itself_in_the_constructor() -> None:
    coord = Coordinator()
    release = threading.Event()
    looper = LooperThread(coord, None, release.wait, args=(JOIN_TIMEOUT_SECS,))
    looper.start()
    try:
        coord.request_stop()
        with pytest.raises(
            RuntimeError, match=r"^Coordinator stopped with threads still running: wait$"
        ):
            coord.join(stop_grace_period_secs=0.05)  # not passed to join: it registered itself
    finally:
        release.set()
        _join_thread(looper)


# --------------------------------------------------------------------------------------------
# LooperThread: schedule


def test_fixed_schedule_first_call_immediate_then_no_drift() -> None:
    clock = ManualClock(start_secs=100.0)
    coord = Coordinator(clock=clock)
    calls: list[float] = []

    def tick() -> None:
        calls.append(clock.monotonic())
        clock.advance(3.0)  # each call takes 3 fake seconds

    looper = LooperThread.loop(coord, 10.0, tick)
    try:
        clock.wait_for_blocked_waits(1)
        assert calls == [100.0]  # immediate
        clock.advance(7.0)
        clock.wait_for_blocked_waits(2)
        assert calls == [100.0, 110.0]  # not 113: the schedule does not drift
        clock.advance(7.0)
        clock.wait_for_blocked_waits(3)
        assert calls == [100.0, 110.0, 120.0]
        assert clock.wait_timeouts == [0.0, 7.0, 7.0, 7.0]
    finally:
        coord.request_stop()
        _join_thread(looper)
    coord.join()


def test_fixed_schedule_catches_up_after_an_overrun() -> None:
    # The clock is given to the looper directly; the coordinator keeps the real clock.
    clock = ManualClock(start_secs=100.0)
    coord = Coordinator()
    calls: list[float] = []

    def tick() -> None:
        calls.append(clock.monotonic())
        if len(calls) == 2:
            clock.advance(25.0)  # the call due at 110 runs until 135

    looper = LooperThread(coord, 10.0, tick, clock=clock)
    looper.start()
    try:
        clock.wait_for_blocked_waits(1)
        assert calls == [100.0]
        clock.advance(10.0)
        clock.wait_for_blocked_waits(2)
        # The calls due at 120 and 130 run at once; the next one is due at 140 again.
        assert calls == [100.0, 110.0, 135.0, 135.0]
        assert clock.wait_timeouts == [0.0, 10.0, -15.0, -5.0, 5.0]
        clock.advance(5.0)
        clock.wait_for_blocked_waits(3)
        assert calls == [100.0, 110.0, 135.0, 135.0, 140.0]
    finally:
        coord.request_stop()
        _join_thread(looper)
    coord.join()


class _Recorder(LooperThread):
    """Records its hooks; raises from run_loop on call ``fail_at`` and stops on ``stop_at``."""

    def __init__(self, coord, interval, *, fail_at=None, stop_at=None, fail_start=False, **kw):
        super().__init__(coord, interval, **kw)
        self.events: list[str] = []
        self.calls = 0
        self.fail_at, self.stop_at, self.fail_start = fail_at, stop_at, fail_start

    def start_loop(self) -> None:
        self.events.append("start")
        if self.fail_start:
            raise RuntimeError("start failed")

    def run_loop(self) -> None:
        self.calls += 1
        self.events.append("run")
        if self.calls == self.fail_at:
            raise RuntimeError(f"failed on call {self.calls}")
        if self.calls == self.stop_at:
            self._coord.request_stop()

    def stop_loop(self) -> None:
        self.events.append("stop")


def test_stop_interrupts_the_timer_and_calls_stop_loop() -> None:
    clock = ManualClock()
    coord = Coordinator(clock=clock)
    looper = _Recorder(coord, 3600.0)
    looper.start()
    clock.wait_for_blocked_waits(1)
    coord.request_stop()
    _join_thread(looper)
    assert looper.events == ["start", "run", "stop"]
    assert clock.monotonic() == 100.0  # no fake time had to pass
    coord.join()


def test_back_to_back_when_interval_is_none() -> None:
    clock = ManualClock()
    coord = Coordinator(clock=clock)
    looper = _Recorder(coord, None, stop_at=5)
    looper.start()
    _join_thread(looper)
    assert looper.events == ["start", "run", "run", "run", "run", "run", "stop"]
    assert clock.wait_timeouts == []  # never waited
    coord.join()


def test_interval_zero_behaves_as_back_to_back() -> None:
    clock = ManualClock()
    coord = Coordinator(clock=clock)
    looper = _Recorder(coord, 0, stop_at=5)
    looper.start()
    _join_thread(looper)
    assert looper.calls == 5
    assert looper.events[-1] == "stop"
    assert clock.blocked_waits == 0
    assert all(t is not None and t <= 0 for t in clock.wait_timeouts)
    coord.join()


# --------------------------------------------------------------------------------------------
# LooperThread: errors and hooks


def test_run_loop_exception_reaches_coordinator_and_skips_stop_loop() -> None:
    coord = Coordinator()
    looper = _Recorder(coord, None, fail_at=3)
    looper.start()
    _join_thread(looper)
    assert coord.should_stop()
    assert looper.events == ["start", "run", "run", "run"]  # no "stop"
    with pytest.raises(RuntimeError, match=r"^failed on call 3$"):
        coord.join()


def test_start_loop_exception_reaches_coordinator() -> None:
    coord = Coordinator()
    looper = _Recorder(coord, 1.0, fail_start=True)
    looper.start()
    _join_thread(looper)
    assert looper.events == ["start"]
    with pytest.raises(RuntimeError, match=r"^start failed$"):
        coord.join()


def test_error_in_one_looper_stops_the_others() -> None:
    coord = Coordinator()
    timed_calls: list[int] = []
    quiet = LooperThread.loop(coord, 3600.0, lambda: timed_calls.append(1))
    failing = LooperThread.loop(coord, None, _fail, args=("service failed",))
    _join_thread(failing)
    _join_thread(quiet)  # its hour-long wait was interrupted by the stop request
    assert timed_calls == [1]
    with pytest.raises(RuntimeError, match=r"^service failed$"):
        coord.join(stop_grace_period_secs=JOIN_TIMEOUT_SECS)


def test_loop_starts_a_looper_calling_target_with_args_and_kwargs() -> None:
    coord = Coordinator()
    received: list[tuple] = []

    def record(a, b, *, c) -> None:
        received.append((a, b, c))
        if len(received) == 3:
            coord.request_stop()

    looper = LooperThread.loop(coord, None, record, args=[1, 2], kwargs={"c": 3})
    assert isinstance(looper, LooperThread)
    assert looper.name == "record"
    coord.join(stop_grace_period_secs=JOIN_TIMEOUT_SECS)  # registered: joined without being passed
    assert not looper.is_alive()
    assert received == [(1, 2, 3)] * 3


@pytest.mark.parametrize("end", ["iterator", "out_of_range"])
def test_exhausted_input_in_a_looper_is_a_clean_stop(end) -> None:
    coord = Coordinator()
    items = iter([1, 2, 3])
    seen: list[int] = []

    def consume() -> None:
        if end == "iterator":
            seen.append(next(items))
        else:
            item = next(items, None)
            if item is None:
                raise errors.OutOfRangeError("queue closed")
            seen.append(item)

    looper = LooperThread.loop(coord, None, consume)
    _join_thread(looper)
    assert seen == [1, 2, 3]
    assert coord.should_stop()
    coord.join()  # no error
