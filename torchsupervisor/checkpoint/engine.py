"""The background writer: persists snapshots off the training thread, at most one in flight.

The training thread hands a job (``commit.persist`` plus the saver's bookkeeping) to
``CheckpointEngine.submit`` and continues; the job runs on the engine's writer thread. The
thread is started at the first save and then waits for work, so later saves do not pay for
starting a thread (``Thread.start`` blocks until the new thread runs: about a millisecond on a
busy machine, most of the stall of a small checkpoint). It ends when the engine is garbage
collected. The returned ``Future`` completes with the job's result or exception: the caller
decides how errors surface (the Supervisor logs them and writes them to the event file).

The writer thread runs at the lowest CPU priority (``nice`` 19 and the ``SCHED_IDLE`` policy,
on Linux, where the priority of a thread can be set on its own: ``torchsupervisor.core.threads``).
On a machine with few cores, checksumming and writing gigabytes at normal priority takes a core
from the training loop's parallel operators, and an operator parallel over all cores runs at the
speed of its slowest thread: measured here, a background CRC pass at normal priority cut
training to 36% of its speed, at nice 19 to 93-98%, under ``SCHED_IDLE`` to 97-99%. The write
then progresses in the gaps the training leaves; when training stops (or a save is synchronous)
it runs at full speed. On a machine that other processes keep busy the idle priority would
starve a save that training waits for (the final checkpoint, the save before a synchronous one):
``wait`` (and the job's future, in ``result``) first raises the writer and its checksum helper to
the waiting thread's priority (``threads.hurry``); the writer lowers itself again before it
reports the job done, and as each job starts unless that job was hurried already (a wait for
another engine's save raises this writer too, idle or not: ``_Save``).

Raising a thread needs ``CAP_SYS_NICE`` (or an ``RLIMIT_NICE`` that allows it), which
containers lack by default; without it a thread under ``SCHED_IDLE`` can never leave it. There
the writer runs at nice 15 under the normal policy instead (``background_priority``): measured
on 2 cores beside two CPU-bound processes, without the capability, a 100 MB save that training
waited for took 4.2 to 7.1 s under ``SCHED_IDLE`` and 0.5 to 0.7 s at nice 15 (1.1 to 1.4 s at
nice 19, 0.2 s at nice 10); on the idle machine training kept 92% of its speed while 500 MB
saves ran back to back (94% at nice 19, 81% at nice 10; 99% under ``SCHED_IDLE``).

The thread is a daemon, but interpreter exit waits for a save being written (the exit drain
of ``core/thread_registry.py``, joined at the first save) rather than abandoning it half-way.
At exit: a program that waits for its last save (``future.result()``) and returns starts the
interpreter's shutdown at once. A tensor freed on the writer thread after that point releases
the GIL in PyTorch's C++ deallocator and cannot take it back: the interpreter ends the thread
with a forced unwind through C++ frames, and the process aborts ("terminate called without an
active exception", exit status 134; 4 runs in 6 here, before the writer was made to free them
first). So every tensor of a job (its snapshot, and the locals of an error's traceback frames,
which hold it) is released before the job's future completes; the writer then holds no tensor.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torchsupervisor.core import collector, thread_registry
from torchsupervisor.core import threads as priority

__all__ = ["BACKGROUND_NICENESS", "UNRAISABLE_NICENESS", "CheckpointEngine", "background_priority"]

logger = logging.getLogger("torchsupervisor")

BACKGROUND_NICENESS = 19
"""The ``nice`` value of writer threads, which also run under ``SCHED_IDLE`` (0: as the caller)."""

UNRAISABLE_NICENESS = 15
"""The ``nice`` value of writer threads where the system would refuse to raise them again
(``threads.raise_permitted``); they then run under the normal policy."""

ABANDONED_EXIT_WAIT_SECS = 5.0
"""How long after it was abandoned the interpreter's exit still waits for a cancelled save to
remove its files (a writer stuck in a system call must not keep the process alive; what it
leaves is cleaned at the next start). Time already spent waiting for it counts."""

ABANDONED_EXIT_MIN_SECS = 1.0
"""The least a cancelled save gets at exit to remove its files, even when a grace period is
spent (a save in a slow but working ``fsync``)."""

_in_flight: weakref.WeakSet[concurrent.futures.Future[Any]] = weakref.WeakSet()
# Each abandoned save, with the monotonic time until which the exit waits for it.
_abandoned: weakref.WeakKeyDictionary[concurrent.futures.Future[Any], float] = (
    weakref.WeakKeyDictionary()
)
_engines: weakref.WeakSet[CheckpointEngine] = weakref.WeakSet()
_unraisable_logged = False  # ``background_priority`` logs its fallback once per process.
_Job = tuple["_Save", Callable[..., Any], tuple]


def wait_for_saves_at_exit() -> None:
    """What the interpreter's exit waits for: every save in flight, and each abandoned one up
    to its deadline (``ABANDONED_EXIT_WAIT_SECS`` after it was abandoned)."""
    concurrent.futures.wait(list(_in_flight))
    for future, until in list(_abandoned.items()):
        concurrent.futures.wait([future], timeout=max(0.0, until - time.monotonic()))


def _quiet(timeout_secs: float) -> list[str]:
    """Wait for the saves in flight, then end every idle writer thread."""
    pending = [future for future in list(_in_flight) if not future.done()]
    _, not_done = concurrent.futures.wait(pending, timeout=timeout_secs)
    if not_done:
        return [f"{len(not_done)} save(s) still being written"]
    _close_all()
    return []


_registered: list[bool] = []


def _register() -> None:
    """Join the thread registry at the first save (its exit drain then runs before the atexit
    hooks registered before it)."""
    if not _registered:
        _registered.append(True)
        thread_registry.register(
            "checkpoint writer",
            order=thread_registry.DRAIN_SAVES,
            drain=wait_for_saves_at_exit,
            quiet=_quiet,
        )


class CheckpointEngine:
    """Run checkpoint jobs on a background writer thread, one at a time.

    Args:
        niceness: CPU priority of the writer thread as a ``nice`` value; above 0 the thread
            also runs under ``SCHED_IDLE`` where a wait can raise it again, and otherwise at
            most ``UNRAISABLE_NICENESS`` under the normal policy (``background_priority``;
            Linux only; 0 keeps the caller's priority).

    Thread safety: ``submit``, ``in_flight`` and ``wait`` may be called from any thread.
    """

    def __init__(self, niceness: int = BACKGROUND_NICENESS) -> None:
        self._niceness = niceness
        self._lock = threading.Lock()
        self._future: _Save | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # The worker holds the queue, not the engine: when the engine goes, the worker ends.
        weakref.finalize(self, self._jobs.put, None)
        _engines.add(self)

    @property
    def in_flight(self) -> bool:
        """True while a submitted job has not finished."""
        future = self._future
        return future is not None and not future.done()

    def submit(self, job: Callable[..., Any], *args: object) -> concurrent.futures.Future[Any]:
        """Run ``job(*args)`` on the writer thread.

        Returns:
            A future for the job's result; its done-callbacks run on the writer thread.

        Raises:
            RuntimeError: If a job is still in flight (callers check ``in_flight`` or call
                ``wait`` first).
        """
        _register()
        with self._lock:
            if self.in_flight:
                raise RuntimeError("A checkpoint is already being written")
            future = _Save()
            future.set_running_or_notify_cancel()
            self._future = future
            _in_flight.add(future)
            if self._thread is None:
                lowered = threading.Event()
                self._thread = threading.Thread(
                    target=_work,
                    args=(self._jobs, self._niceness, lowered),
                    name="torchsupervisor-checkpoint-writer",
                    daemon=True,
                )
                self._thread.start()
                lowered.wait()  # A ``hurry`` from now on is not undone by the first lowering.
            self._jobs.put((future, job, args))
            return future

    def wait(self, timeout_secs: float | None = None) -> bool:
        """Wait until no job is in flight; the job's own errors are not raised here.

        Returns:
            True if nothing is in flight any more, False if ``timeout_secs`` expired.
        """
        future = self._future
        if future is None or future.done():  # The usual case: nothing to wait for.
            return True
        self.hurry()
        done, _ = concurrent.futures.wait([future], timeout=timeout_secs)
        return bool(done)

    def hurry(self) -> None:
        """Raise the writer to the calling thread's CPU priority until its job ends.

        For a caller about to wait for the job in flight (``wait`` does it): under the idle
        priority a busy machine would leave the job almost no CPU. Nothing happens when
        nothing is in flight, or where the system refuses (logged once).
        """
        future = self._future
        if future is not None:
            future.hurry()

    def abandon(self, exit_wait_secs: float | None = None) -> None:
        """Wait at most ``exit_wait_secs`` (and ``ABANDONED_EXIT_WAIT_SECS``) from now for the
        job in flight at exit.

        For a cancelled save: it stops at its next chunk or stage and removes its files, unless
        the writer is stuck in a system call (a hung fsync, a store that does not answer); the
        process must still be able to exit then, within a preemption's grace period (what it
        leaves is cleaned at the next start).

        Args:
            exit_wait_secs: What is left of a grace period (at least
                ``ABANDONED_EXIT_MIN_SECS`` is given); None: no other bound.
        """
        wait = ABANDONED_EXIT_WAIT_SECS
        if exit_wait_secs is not None:  # At least a moment to remove what it wrote.
            wait = min(wait, max(ABANDONED_EXIT_MIN_SECS, exit_wait_secs))
        future = self._future
        if future is not None and not future.done():
            _abandoned.setdefault(future, time.monotonic() + wait)
            _in_flight.discard(future)

    def close(self) -> None:
        """Let the writer thread end after the job in flight (a later ``submit`` restarts it)."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._jobs.put(None)
        if thread is not None:
            thread.join()


class _Save(concurrent.futures.Future):
    """A job's future whose ``result`` and ``exception`` hurry the job before waiting for it.

    A caller waiting for a save (``future.result()``) should not wait for a thread that the
    machine's other processes starve: see ``CheckpointEngine.hurry``. ``threads.hurry`` raises
    every hurriable thread, the idle writers of other engines too, so each writer lowers itself
    again when a job starts, unless that very job was hurried already (``lower_unless_hurried``:
    one lock orders the two, so a hurry is never undone by the lowering it raced with).
    """

    def __init__(self) -> None:
        super().__init__()
        self._hurry_lock = threading.Lock()
        self._hurried = False

    def hurry(self) -> None:
        """Raise the writer to the calling thread's priority until this job ends, if not done."""
        with self._hurry_lock:
            if not self.done():
                self._hurried = True
                priority.hurry()

    def lower_unless_hurried(self, niceness: int, idle: bool) -> None:
        """Lower the calling thread (the writer, as this job starts), unless a caller waits."""
        with self._hurry_lock:
            if not self._hurried:
                priority.lower(niceness, idle=idle, hurriable=idle)

    def result(self, timeout: float | None = None) -> Any:
        self.hurry()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.hurry()
        return super().exception(timeout)


def _close_all() -> None:
    """End the writer threads of every engine (after their saves)."""
    for engine in list(_engines):
        engine.close()


def background_priority(niceness: int) -> tuple[int, bool]:
    """The writer's ``nice`` value and whether it runs under ``SCHED_IDLE``, for ``niceness``.

    ``SCHED_IDLE`` (and ``niceness``) only where a thread that waits for a save can raise the
    writer again (``threads.raise_permitted``). Elsewhere (a container without
    ``CAP_SYS_NICE``) the lowering would be for good: under ``SCHED_IDLE`` a machine that other
    processes keep busy leaves the writer almost no CPU, so a save that training waits for
    (the final one after a preemption signal) could outlast the grace period. The writer then
    runs at ``UNRAISABLE_NICENESS`` (at most ``niceness``) under the normal policy instead,
    which still gets its share of a busy machine, and this is logged once.
    """
    if niceness <= 0 or priority.raise_permitted():
        return niceness, niceness > 0
    global _unraisable_logged
    if not _unraisable_logged:
        _unraisable_logged = True
        logger.info(
            "The checkpoint writer runs at nice %d, not at the idle priority: this process "
            "may not raise a thread's CPU priority (no CAP_SYS_NICE or RLIMIT_NICE), so a "
            "save that training waits for could not be hurried on a busy machine",
            min(niceness, UNRAISABLE_NICENESS),
        )
    return min(niceness, UNRAISABLE_NICENESS), False


def _work(jobs: queue.SimpleQueue[_Job | None], niceness: int, lowered: threading.Event) -> None:
    # No job records autograd history: outside it, reading a DTensor's local shard is an
    # attribute read, not an autograd function (12 us; 756 of them in a save of 1,008
    # tensors). The grad mode is the thread's own.
    torch.set_grad_enabled(False)
    niceness, idle = background_priority(niceness)
    # Hurriable only if idle: a thread lowered for good is not raised (nor warned about).
    priority.lower(niceness, idle=idle, hurriable=idle)
    lowered.set()
    while True:
        item = jobs.get()
        if item is None:
            return
        future, job, args = item
        # Another engine's wait may have raised this thread while it was idle (``_Save``).
        future.lower_unless_hurried(niceness, idle)
        result: object = None
        error: BaseException | None = None
        try:
            with collector.paused():  # No full collections for the job's objects (collector.py).
                result = job(*args)
        except BaseException as e:
            error = e
            _clear_frames(e)  # Their locals would keep the snapshot alive.
        # Every tensor of the job is freed here, before it is reported done (module docstring:
        # "at exit"), and none is kept alive while the thread waits for the next job.
        del item, job, args
        # A wait for this job may have raised the thread (``hurry``): lower it again before
        # the job is reported done, so that no wait for the next job can come in between.
        priority.lower(niceness, idle=idle, hurriable=idle)
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
        del future, result, error


def _clear_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames in ``error``'s tracebacks (and its causes')."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        pending += [e.__cause__, e.__context__]
