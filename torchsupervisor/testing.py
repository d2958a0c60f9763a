"""Test doubles for code built on torchsupervisor: a fake clock and a fault-injecting file system.

Not imported by ``torchsupervisor/__init__.py``: import it as ``torchsupervisor.testing``.

* ``FakeClock``: time moves only when the test advances it, or when the code under test sleeps
  or waits with a timeout (the wait then returns at once, its timeout used up), so timers,
  budgets and polling loops run through their schedule without real waiting.
* ``FaultyFileSystem``: the checkpoint code's file-system seam (``checkpoint.storage.FileSystem``)
  with faults injected by rule: fail the n-th call of one operation (optionally on paths that
  contain a given text) with an ``OSError`` of any errno, once or every time, and a record of
  every call. Every test that checks "a failed save never damages an older checkpoint" uses it.

TF name: none (TF's tests used their own fakes).
"""

from __future__ import annotations

import errno as errno_module
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchsupervisor.checkpoint.storage import FileSystem
from torchsupervisor.core.clock import Clock

__all__ = ["OPERATIONS", "FakeClock", "Fault", "FaultyFileSystem"]


class FakeClock(Clock):
    """A clock whose time moves only when a test advances it, or something sleeps or waits.

    ``sleep(secs)`` and a ``wait(event, timeout)`` that times out advance the time by the
    requested amount at once. ``monotonic()`` starts at ``start_secs`` and ``time()`` is
    ``epoch_secs`` plus the same offset, so both move together.

    Args:
        start_secs: The first value of ``monotonic()``, in seconds.
        epoch_secs: ``time()`` minus ``monotonic()``, in seconds.

    Attributes:
        sleeps: Every ``sleep`` duration asked for, in seconds, in order.

    Thread safety: every method may be called from any thread.
    """

    def __init__(self, start_secs: float = 1_000.0, epoch_secs: float = 1_700_000_000.0):
        self._lock = threading.Lock()
        self._now = float(start_secs)
        self._epoch = float(epoch_secs)
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        """Return the fake monotonic time in seconds."""
        with self._lock:
            return self._now

    def time(self) -> float:
        """Return the fake wall-clock time in seconds since the epoch."""
        with self._lock:
            return self._epoch + self._now

    def advance(self, secs: float) -> None:
        """Move both times forward by ``secs`` seconds."""
        with self._lock:
            self._now += secs

    def sleep(self, secs: float) -> None:
        """Record the sleep and advance the time by ``secs`` at once."""
        self.sleeps.append(secs)
        if secs > 0:
            self.advance(secs)

    def wait(self, event: threading.Event, timeout_secs: float | None) -> bool:
        """Return at once: True if ``event`` is set, else advance by the timeout and re-check.

        ``timeout_secs=None`` waits for the event for real (there is no deadline to skip to).
        """
        if event.is_set():
            return True
        if timeout_secs is None:
            return event.wait()
        if timeout_secs > 0:
            self.advance(timeout_secs)
        return event.is_set()


OPERATIONS = (
    "makedirs",
    "open",
    "write",
    "fsync",
    "close",
    "rename",
    "remove",
    "fsync_dir",
    "listdir",
    "read",
)
"""The operations of ``FaultyFileSystem`` a fault can target (``read`` is ``open_for_read``)."""


@dataclass
class Fault:
    """One injected fault: see ``FaultyFileSystem.fail``.

    Attributes:
        operation: One of ``OPERATIONS``.
        nth: The first matching call that fails (1 = the first).
        errno: The ``OSError``'s errno.
        path_contains: Only calls whose path contains this text match; None: every call.
        times: How many matching calls fail from the n-th on; None: all of them.
        before: Called with the path just before the failure is raised (to kill, block, ...).
        seen: Matching calls so far.
        raised: Failures raised so far.
    """

    operation: str
    nth: int = 1
    errno: int = errno_module.EIO
    path_contains: str | None = None
    times: int | None = 1
    before: Callable[[str], Any] | None = None
    seen: int = 0
    raised: int = 0


@dataclass
class _Record:
    calls: list[tuple[str, str]] = field(default_factory=list)


class FaultyFileSystem(FileSystem):
    """The local file system with faults injected by rule, and every call recorded.

    Example::

        fs = FaultyFileSystem()
        fs.fail("write", nth=2, errno=errno.ENOSPC)      # the second write: disk full
        fs.fail("rename", path_contains="checkpoint", errno=errno.EPERM, times=None)
        saver = Saver(fs=fs)

    Attributes:
        calls: ``(operation, path)`` of every call, in order (the path of a ``write``,
            ``fsync`` or ``close`` is the file's).
        faults: The faults armed, in the order given.

    Thread safety: calls from several threads are recorded and matched under a lock.

    TF name: none.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._paths: dict[int, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.faults: list[Fault] = []

    def fail(
        self,
        operation: str,
        *,
        nth: int = 1,
        errno: int = errno_module.EIO,
        path_contains: str | None = None,
        times: int | None = 1,
        before: Callable[[str], Any] | None = None,
    ) -> Fault:
        """Arm a fault: the ``nth`` matching call of ``operation`` raises ``OSError(errno)``.

        Args:
            operation: One of ``OPERATIONS``.
            nth: The first matching call to fail (1 = the next one).
            errno: The error number (``errno.ENOSPC``, ``errno.EIO``, ``errno.EPERM``, ...).
            path_contains: Match only calls on paths containing this text.
            times: How many calls fail from the ``nth`` on; None: every one after it.
            before: Called with the path just before raising.

        Returns:
            The ``Fault`` (its ``raised`` counts the failures so far).

        Raises:
            ValueError: For an unknown operation or ``nth`` below 1.
        """
        if operation not in OPERATIONS:
            raise ValueError(f"operation must be one of {OPERATIONS}, got {operation!r}")
        if nth < 1:
            raise ValueError(f"nth must be at least 1, got {nth}")
        fault = Fault(operation, nth, errno, path_contains, times, before)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Disarm every fault (the record of calls is kept)."""
        with self._lock:
            self.faults.clear()

    def operations(self, operation: str) -> list[str]:
        """Return the paths of the recorded calls of ``operation``, in order."""
        with self._lock:
            return [path for op, path in self.calls if op == operation]

    def _check(self, operation: str, path: str) -> None:
        failing = None
        with self._lock:
            self.calls.append((operation, path))
            for fault in self.faults:
                if fault.operation != operation:
                    continue
                if fault.path_contains is not None and fault.path_contains not in path:
                    continue
                fault.seen += 1
                if fault.seen < fault.nth:
                    continue
                if fault.times is not None and fault.raised >= fault.times:
                    continue
                fault.raised += 1
                failing = fault
                break
        if failing is not None:
            if failing.before is not None:
                failing.before(path)
            raise OSError(failing.errno, os.strerror(failing.errno), path)

    def _path(self, fd: int) -> str:
        with self._lock:
            return self._paths.get(fd, f"<fd {fd}>")

    def makedirs(self, path: str) -> None:
        self._check("makedirs", path)
        super().makedirs(path)

    def open_for_write(self, path: str, *, direct: bool = False) -> int:
        self._check("open", path)
        fd = super().open_for_write(path, direct=direct)
        with self._lock:
            self._paths[fd] = path
        return fd

    def write(self, fd: int, data: memoryview | bytes) -> None:
        self._check("write", self._path(fd))
        super().write(fd, data)

    def fsync(self, fd: int) -> None:
        self._check("fsync", self._path(fd))
        super().fsync(fd)

    def close(self, fd: int) -> None:
        path = self._path(fd)
        with self._lock:
            self._paths.pop(fd, None)
        try:
            self._check("close", path)
        finally:
            super().close(fd)

    def rename(self, src: str, dst: str) -> None:
        self._check("rename", dst)
        super().rename(src, dst)

    def remove(self, path: str) -> None:
        self._check("remove", path)
        super().remove(path)

    def fsync_dir(self, path: str) -> None:
        self._check("fsync_dir", path)
        super().fsync_dir(path)

    def listdir(self, path: str) -> list[str]:
        self._check("listdir", path)
        return super().listdir(path)

    def open_for_read(self, path: str):
        self._check("read", path)
        return super().open_for_read(path)
