"""Helpers of the hook, MonitoredSession and queue tests: a small state, recording hooks, gates."""

from __future__ import annotations

import errno
import threading

import torch

from torchsupervisor import GlobalStep
from torchsupervisor.hooks import CheckpointSaverListener, SessionRunArgs, SessionRunHook
from torchsupervisor.testing import FaultyStorage, GatedStorage

JOIN_SECS = 10.0


class Counter:
    """A state in which one step adds 1 to ``w`` and to the global step."""

    def __init__(self, start: int = 0) -> None:
        self.w = torch.zeros(())
        self.global_step = GlobalStep(start)
        self.calls = 0

    @property
    def state(self) -> dict:
        return {"w": self.w, "global_step": self.global_step}

    def step(self) -> dict:
        self.calls += 1
        self.w.add_(1.0)
        self.global_step.increment()
        return {"loss": self.w.clone()}


class RecordingHook(SessionRunHook):
    """Records every call (name, details) and optionally asks for fetches/feeds."""

    def __init__(self, fetches=None, feed_dict=None, name: str = "hook") -> None:
        self.calls: list[tuple] = []
        self.results: list = []
        self.contexts: list = []
        self.sessions: list = []
        self.fetches = fetches
        self.feed_dict = feed_dict
        self.name = name
        self.stop_after: int | None = None

    def begin(self):
        self.calls.append(("begin",))

    def after_create_session(self, session, coord):
        self.sessions.append(session)
        self.calls.append(("after_create_session",))

    def before_run(self, run_context):
        self.calls.append(("before_run",))
        self.contexts.append(run_context)
        if self.fetches is None and self.feed_dict is None:
            return None
        return SessionRunArgs(self.fetches, self.feed_dict)

    def after_run(self, run_context, run_values):
        self.calls.append(("after_run",))
        self.results.append(run_values.results)
        if self.stop_after is not None and len(self.results) >= self.stop_after:
            run_context.request_stop()

    def end(self, session):
        self.calls.append(("end",))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class RecordingListener(CheckpointSaverListener):
    """Records listener calls with the step and the calling thread."""

    def __init__(self, stop_at_step: int | None = None) -> None:
        self.calls: list[tuple[str, int | None]] = []
        self.threads: list[int] = []
        self.stop_at_step = stop_at_step

    def begin(self):
        self.calls.append(("begin", None))

    def before_save(self, session, global_step_value):
        self.calls.append(("before_save", global_step_value))
        self.threads.append(threading.get_ident())

    def after_save(self, session, global_step_value):
        self.calls.append(("after_save", global_step_value))
        self.threads.append(threading.get_ident())
        return self.stop_at_step is not None and global_step_value >= self.stop_at_step

    def end(self, session, global_step_value):
        self.calls.append(("end", global_step_value))

    def steps(self, kind: str) -> list[int | None]:
        return [step for name, step in self.calls if name == kind]


def slow_storage(delay_secs: float = 0.02) -> FaultyStorage:
    """Every fsync of a file takes ``delay_secs`` more: saves take longer than the steps."""
    storage = FaultyStorage()
    storage.delay("fsync", delay_secs)
    return storage


def gated_storage(operation: str = "fsync", path_contains: str | None = None):
    """A storage whose ``operation`` calls (on matching paths) wait until ``gate.open()``.

    Returns:
        ``(storage, gate)``: ``gate.reached`` is set once a save waits at the gate.
    """
    storage = GatedStorage()
    gate = storage.hold(operation, path_contains=path_contains, times=None, timeout_secs=JOIN_SECS)
    return storage, gate


def fill_disk(storage: FaultyStorage) -> None:
    """Make every write of ``storage`` fail with ENOSPC until ``storage.clear()``."""
    storage.fail("write", errno=errno.ENOSPC, times=None)
