"""Test doubles for code built on torchsupervisor: time, storage faults, and process groups.

Not imported by ``torchsupervisor/__init__.py``: import it as ``torchsupervisor.testing``.

* ``FakeClock``: time moves only when the test advances it, or when the code under test sleeps
  or waits with a timeout (the wait then returns at once, its timeout used up), so timers,
  budgets (``core.clock.Deadline``) and polling loops run through their schedule without real
  waiting.
* ``FaultyStorage``: the local storage seam (``storage.LocalStorage``) with faults injected by
  rule at any stage of any operation (``storage.local.OPERATIONS``: ``open``, ``write``,
  ``fsync``, ``rename``, ``fsync_dir``, ``delete``, ``list``, ``read``, ...): fail the n-th
  matching call with an ``OSError`` of any errno, once or every time, optionally only on the
  rank ``R`` of a process group; delay calls; and a record of every call. Every test that
  checks "a failed save never damages an older checkpoint" uses it.
* ``GatedStorage``: a ``FaultyStorage`` that holds one stage until the test opens the gate (a
  save is then surely in flight).
* ``run_world``: run a function on every rank of a real 2-process (gloo) process group.

TF name: none (TF's tests used their own fakes).
"""

from __future__ import annotations

import errno as errno_module
import multiprocessing
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchsupervisor.core.clock import Clock
from torchsupervisor.errors import WorldError
from torchsupervisor.storage.local import OPERATIONS, LocalStorage

__all__ = [
    "OPERATIONS",
    "FakeClock",
    "Fault",
    "FaultyStorage",
    "Gate",
    "GatedStorage",
    "WorldError",
    "events_worker_of",
    "hooks_of",
    "pending_enqueues",
    "raw_session_of",
    "run_world",
    "save_cache_of",
    "timer_of",
    "wait_for_quiet",
]


class FakeClock(Clock):
    """A clock whose time moves only when a test advances it (or, by default, when waited on).

    ``monotonic()`` starts at ``start_secs`` and ``time()`` is ``epoch_secs`` plus the same
    offset, so both move together. Two ways of waiting:

    * ``auto_advance=True`` (default): ``sleep(secs)`` and a ``wait(event, timeout)`` that
      times out advance the time by that amount at once, so a timer or a budget
      (``core.clock.Deadline``) runs through its schedule without real waiting;
    * ``auto_advance=False``: a ``wait(event, timeout)`` blocks until the event is set or a
      call of ``advance`` moves the time past its deadline, so a test can hold a background
      thread at a timed wait and step it on (``timed_wait_started`` tells when a thread
      started waiting; ``timed_waits`` lists the timeouts).

    Args:
        start_secs: The first value of ``monotonic()``, in seconds.
        epoch_secs: ``time()`` minus ``monotonic()``, in seconds.
        auto_advance: See above.

    Attributes:
        sleeps: Every ``sleep`` duration asked for, in seconds, in order.
        timed_waits: Every timeout of a timed ``wait``, in seconds, in order.
        timed_wait_started: Set whenever a timed ``wait`` starts (clear it to watch again).

    Thread safety: every method may be called from any thread.
    """

    def __init__(
        self,
        start_secs: float = 1_000.0,
        epoch_secs: float = 1_700_000_000.0,
        *,
        auto_advance: bool = True,
    ) -> None:
        self._cond = threading.Condition()
        self._now = float(start_secs)
        self._epoch = float(epoch_secs)
        self.auto_advance = auto_advance
        self.sleeps: list[float] = []
        self.timed_waits: list[float] = []
        self.timed_wait_started = threading.Event()

    def monotonic(self) -> float:
        """Return the fake monotonic time in seconds."""
        with self._cond:
            return self._now

    def time(self) -> float:
        """Return the fake wall-clock time in seconds since the epoch."""
        with self._cond:
            return self._epoch + self._now

    def advance(self, secs: float) -> None:
        """Move both times forward by ``secs`` seconds (and wake the timed waits due)."""
        with self._cond:
            self._now += secs
            self._cond.notify_all()

    def set_wall(self, wall_secs: float) -> None:
        """Make ``time()`` return ``wall_secs`` now, without moving ``monotonic()``."""
        with self._cond:
            self._epoch = wall_secs - self._now

    def sleep(self, secs: float) -> None:
        """Record the sleep and advance the time by ``secs`` at once."""
        self.sleeps.append(secs)
        if secs > 0:
            self.advance(secs)

    def wait(self, event: threading.Event, timeout_secs: float | None) -> bool:
        """Wait for ``event`` on fake time; see the class docstring.

        ``timeout_secs=None`` waits for the event for real (there is no deadline to skip to).
        """
        if event.is_set():
            return True
        if timeout_secs is None:
            return event.wait()
        with self._cond:
            self.timed_waits.append(timeout_secs)
            deadline = self._now + timeout_secs
        self.timed_wait_started.set()
        if self.auto_advance:
            if timeout_secs > 0:
                self.advance(timeout_secs)
            return event.is_set()
        while not event.is_set():
            with self._cond:
                if self._now >= deadline:
                    return False
                self._cond.wait(0.005)
        return True


@dataclass
class Fault:
    """One rule of a ``FaultyStorage``: see ``FaultyStorage.fail``.

    Attributes:
        operation: One of ``OPERATIONS``.
        nth: The first matching call that fails (1 = the first).
        errno: The ``OSError``'s errno; None: do not fail (a delay or a gate only).
        path_contains: Only calls whose path contains this text match; None: every call.
        times: How many matching calls fail from the n-th on; None: all of them.
        before: Called with the path before the failure is raised (to kill, block, ...).
        rank: Only match in the process of this rank (``$RANK``, else the process group's,
            else 0); None: every rank.
        seen: Matching calls so far.
        raised: Calls it acted on so far.
    """

    operation: str
    nth: int = 1
    errno: int | None = errno_module.EIO
    path_contains: str | None = None
    times: int | None = 1
    before: Callable[[str], Any] | None = None
    rank: int | None = None
    seen: int = 0
    raised: int = 0


def wait_for_quiet(timeout_secs: float = 10.0) -> None:
    """Wait until torchsupervisor's background machinery is quiet: every checkpoint save in
    flight written, the idle writer and checksum threads ended (a later save starts them
    again). For the end of a test, before it looks for leaked threads.

    Args:
        timeout_secs: How long to wait, for everything together (seconds).

    Raises:
        TimeoutError: Something was still busy at the deadline (named in the message).

    TF name: none.
    """
    from torchsupervisor.core import thread_registry

    busy = thread_registry.wait_for_quiet(timeout_secs)
    if busy:
        raise TimeoutError(f"still busy after {timeout_secs:g} s: {'; '.join(busy)}")


def hooks_of(session: object) -> list[Any]:
    """The hooks a ``MonitoredSession`` runs (``MonitoredTrainingSession``'s standard ones
    included), in the order it runs them.

    TF name: none.
    """
    return list(session._hooks)


def pending_enqueues(queue: object) -> int:
    """How many elements wait to enter a full queue (enqueues blocked on its capacity).

    TF name: none.
    """
    return len(queue._pending)


def raw_session_of(session: object) -> Any:
    """The ``Session`` inside a ``MonitoredSession`` (the current one: a recovered session
    replaces it), or None before it is created.

    TF name: none (TF's ``MonitoredSession._tf_sess``).
    """
    return session._tf_sess()


def events_worker_of(writer: object) -> Any:
    """The ``EventFileWriter`` (queue, thread, file) behind a ``SummaryWriter`` now (a
    ``reopen`` makes a new one).

    TF name: none.
    """
    return writer._holder[0]


def save_cache_of(saver: object) -> Any:
    """The ``SaveCache`` of the writer a ``Saver`` chose for its state (after its first save
    or restore, or at construction for a ``var_list`` mapping); None before.

    TF name: none.
    """
    choice = saver._writers.chosen
    return None if choice is None else choice[1]._cache


def timer_of(hook: object) -> Any:
    """The ``SecondOrStepTimer`` that paces a hook (``every_steps``, ``every_secs``).

    TF name: none.
    """
    return hook._timer


def _this_rank() -> int:
    from torchsupervisor.distributed.env import rank

    return rank()


class FaultyStorage(LocalStorage):
    """The local storage with faults injected by rule, and every system call recorded.

    Example::

        storage = FaultyStorage()
        storage.fail("write", nth=2, errno=errno.ENOSPC)     # the second write: disk full
        storage.fail("rename", path_contains="checkpoint", errno=errno.EPERM, times=None)
        storage.fail("fsync", path_contains=".index", rank=1)  # rank 1's index write
        storage.delay("fsync", 0.05)                          # every fsync is slow
        saver = Saver(storage=storage)

    Attributes:
        calls: ``(operation, path)`` of every system call, in order (a ``write`` or
            ``fsync`` names the file written: a temporary name inside ``put``).
        faults: The rules armed, in the order given.

    Thread safety: calls from several threads are recorded and matched under a lock.

    TF name: none.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: list[tuple[str, str]] = []
        self.faults: list[Fault] = []
        self._delays: list[tuple[str, float, str | None]] = []

    def fail(
        self,
        operation: str,
        *,
        nth: int = 1,
        errno: int | None = errno_module.EIO,
        path_contains: str | None = None,
        times: int | None = 1,
        before: Callable[[str], Any] | None = None,
        rank: int | None = None,
    ) -> Fault:
        """Arm a fault: the ``nth`` matching call of ``operation`` raises ``OSError(errno)``.

        Every armed rule that matches a call acts on it, in the order armed: each runs its
        ``before``, and the first with an ``errno`` raises.

        Args:
            operation: One of ``OPERATIONS``.
            nth: The first matching call to fail (1 = the next one).
            errno: The error number (``errno.ENOSPC``, ``errno.EIO``, ``errno.EPERM``, ...);
                None: do not fail, only run ``before`` (a probe).
            path_contains: Match only calls on paths containing this text.
            times: How many calls fail from the ``nth`` on; None: every one after it.
            before: Called with the path just before raising.
            rank: Fail only on this rank of the process group; None: on every rank.

        Returns:
            The ``Fault`` (its ``raised`` counts the failures so far).

        Raises:
            ValueError: For an unknown operation or ``nth`` below 1.
        """
        return self._arm(Fault(operation, nth, errno, path_contains, times, before, rank))

    def watch(
        self,
        operation: str,
        callback: Callable[[str], Any],
        *,
        path_contains: str | None = None,
    ) -> Fault:
        """Call ``callback(path)`` before every matching call of ``operation`` (no failure).

        Raises:
            ValueError: For an unknown operation.
        """
        return self._arm(Fault(operation, 1, None, path_contains, None, callback))

    def delay(self, operation: str, secs: float, *, path_contains: str | None = None) -> None:
        """Make every matching call of ``operation`` take ``secs`` seconds more (real time).

        Raises:
            ValueError: For an unknown operation.
        """
        _check_operation(operation)
        with self._lock:
            self._delays.append((operation, secs, path_contains))

    def clear(self) -> None:
        """Disarm every fault and delay (the record of calls is kept)."""
        with self._lock:
            self.faults.clear()
            self._delays.clear()

    def operations(self, operation: str) -> list[str]:
        """Return the paths of the recorded calls of ``operation``, in order."""
        with self._lock:
            return [path for op, path in self.calls if op == operation]

    def _arm(self, fault: Fault) -> Fault:
        _check_operation(fault.operation)
        if fault.nth < 1:
            raise ValueError(f"nth must be at least 1, got {fault.nth}")
        with self._lock:
            self.faults.append(fault)
        return fault

    def _before(self, operation: str, path: str) -> None:
        acting = []
        with self._lock:
            self.calls.append((operation, path))
            delays = [s for op, s, text in self._delays if op == operation and _has(path, text)]
            for fault in self.faults:
                if fault.operation != operation or not _has(path, fault.path_contains):
                    continue
                if fault.rank is not None and fault.rank != _this_rank():
                    continue
                fault.seen += 1
                if fault.seen < fault.nth:
                    continue
                if fault.times is not None and fault.raised >= fault.times:
                    continue
                fault.raised += 1
                acting.append(fault)
        for secs in delays:
            time.sleep(secs)
        for fault in acting:  # In the order armed; the first with an errno raises.
            if fault.before is not None:
                fault.before(path)
            if fault.errno is not None:
                raise OSError(fault.errno, os.strerror(fault.errno), path)


class Gate:
    """Where a ``GatedStorage`` holds a stage: ``reached`` is set when a call arrives there.

    Attributes:
        reached: Set once a matching call waits at the gate.
        opened: Set by ``open()``; the held call (and every later one) then goes on.
        timeout_secs: The longest a call waits; it then fails with ``EIO`` (so that a test
            that forgets to open never hangs the run).
    """

    def __init__(self, timeout_secs: float) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()
        self.timeout_secs = timeout_secs

    def open(self) -> None:
        """Let the held call, and every later one, go on."""
        self.opened.set()

    def _hold(self, path: str) -> None:
        self.reached.set()
        if not self.opened.wait(self.timeout_secs):
            raise OSError(errno_module.EIO, "the test never opened the gate", path)


class GatedStorage(FaultyStorage):
    """A ``FaultyStorage`` that can hold a stage until the test opens its gate.

    Example::

        storage = GatedStorage()
        gate = storage.hold("fsync", path_contains="model.ckpt-3")
        ...                       # a save of step 3 starts in the background
        assert gate.reached.wait(10)  # it is in flight now
        gate.open()

    TF name: none.
    """

    def hold(
        self,
        operation: str,
        *,
        path_contains: str | None = None,
        nth: int = 1,
        times: int | None = 1,
        rank: int | None = None,
        timeout_secs: float = 60.0,
    ) -> Gate:
        """Hold the ``nth`` matching call of ``operation`` (and ``times - 1`` more) at a gate.

        Returns:
            The ``Gate``.

        Raises:
            ValueError: For an unknown operation or ``nth`` below 1.
        """
        gate = Gate(timeout_secs)
        self._arm(Fault(operation, nth, None, path_contains, times, gate._hold, rank))
        return gate


def _has(path: str, text: str | None) -> bool:
    return text is None or text in path


def _check_operation(operation: str) -> None:
    if operation not in OPERATIONS:
        raise ValueError(f"operation must be one of {OPERATIONS}, got {operation!r}")


# ------------------------------------------------------------------------------ process groups


def run_world(
    fn: Callable[..., Any],
    *args: object,
    world_size: int = 2,
    timeout_secs: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank of a real gloo process group.

    Each rank is a fresh process (forked from a clean fork server) that joins a process
    group on a free port of 127.0.0.1 (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT`` are set, as ``torchrun`` sets them), calls ``fn`` and destroys the group.

    Args:
        fn: A module-level (picklable) function.
        *args: Its further arguments (picklable).
        world_size: The number of ranks.
        timeout_secs: How long every rank together may take; a rank still running then is
            killed.
        env: Further environment variables for the ranks.

    Returns:
        What ``fn`` returned on each rank, by rank (picklable values).

    Raises:
        WorldError: A rank raised (its traceback is in the message) or timed out.

    TF name: none.
    """
    context = _rank_context()
    results: object = context.Queue()
    port = _free_port()
    processes = [
        context.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, args, dict(env or {}), results),
            name=f"torchsupervisor-rank-{rank}",
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_secs
    outcome: dict[int, tuple[bool, Any]] = {}
    try:
        while len(outcome) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in processes) and results.empty():
                    break
                continue
            outcome[rank] = (ok, value)
    finally:
        for process in processes:
            process.join(max(0.0, min(10.0, deadline - time.monotonic())))
            if process.is_alive():
                process.kill()
                process.join(10)
    failures = {rank: value for rank, (ok, value) in outcome.items() if not ok}
    for rank in range(world_size):
        if rank not in outcome:
            code = processes[rank].exitcode
            failures[rank] = f"no result (exit code {code}; timeout {timeout_secs:g} s)"
    if failures:
        raise WorldError(failures)
    return [outcome[rank][1] for rank in range(world_size)]


def _rank_context() -> Any:
    """Where ranks come from: a fork server that has imported torch and this package once.

    Each rank is then a fork of a process that did nothing else (no threads, no process
    group, no CUDA), as clean as a spawned one, without paying their imports (seconds on a
    busy machine) at every call.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "torchsupervisor"])
    return context


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    results: object,
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():  # ``fn`` may end the group itself (a teardown test).
                dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
