"""Helpers of the Supervisor tests: small real models, event readers, polling with a deadline."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto.event_pb2 import Event, SessionLog

from torchsupervisor import CheckpointReader, GlobalStep, summary_iterator
from torchsupervisor.storage import is_temporary_name

START, STOP, CHECKPOINT = SessionLog.START, SessionLog.STOP, SessionLog.CHECKPOINT

DEADLINE_SECS = 60.0
"""How long ``wait_until`` waits: a bound for a busy 2-core machine (the S3 and GCS servers
under load take seconds per checkpoint), not a timing; a passing wait returns at once."""


class Trainer:
    """A linear model trained by SGD on fixed data; the global step is bound to the optimizer."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.model = torch.nn.Linear(3, 1)
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.global_step = GlobalStep()
        self.global_step.bind(self.optimizer)
        self.x = torch.randn(16, 3, generator=gen)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3

    @property
    def state(self) -> dict:
        return {"model": self.model, "optimizer": self.optimizer, "global_step": self.global_step}

    def train_step(self) -> float:
        self.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


class Counter:
    """A state whose consistency is easy to check: one step adds 1 to ``w`` and to the step.

    ``pause_secs`` sleeps between the two updates, so a snapshot taken in the middle of a step
    (instead of at a step boundary) would see ``w == step + 1``.
    """

    def __init__(self, pause_secs: float = 0.0) -> None:
        self.w = torch.zeros(())
        self.global_step = GlobalStep()
        self.pause_secs = pause_secs

    @property
    def state(self) -> dict:
        return {"w": self.w, "global_step": self.global_step}

    def half_step(self) -> None:
        self.w.add_(1.0)

    def step(self) -> None:
        self.w.add_(1.0)
        if self.pause_secs:
            time.sleep(self.pause_secs)
        self.global_step.increment()


def wait_until(
    predicate: Callable[[], bool],
    *,
    poll: Callable[[], object] | None = None,
    timeout_secs: float = DEADLINE_SECS,
    what: str = "condition",
) -> None:
    """Poll ``predicate`` (calling ``poll`` in between) until it is true or the deadline passes."""
    deadline = time.monotonic() + timeout_secs
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_secs} s")
        if poll is not None:
            poll()
        time.sleep(0.002)


def wait_for_checkpoint(sv, step: int) -> None:
    """Serve step boundaries (``should_stop()``) until the checkpoint at ``step`` is committed."""
    prefix = f"{sv.save_path}-{step}"
    wait_until(
        lambda: os.path.exists(prefix + ".index"),
        poll=sv.should_stop,
        what=f"checkpoint {prefix}",
    )
    # Let the service finish its bookkeeping (state file, CHECKPOINT event): at the same step
    # checkpoint() saves nothing but waits for the save in flight.
    assert sv.checkpoint() is None


def wait_for_tag(sv, tag: str) -> None:
    """Wait until an event with a summary value ``tag`` is in the supervisor's events file."""

    def written():
        sv.summary_writer.flush()
        return any(scalars(all_events(sv.summary_writer.get_logdir()), tag))

    wait_until(written, what=f"a {tag!r} summary")


def event_files(logdir) -> list[str]:
    logdir = os.fspath(logdir)
    return sorted(os.path.join(logdir, f) for f in os.listdir(logdir) if "tfevents" in f)


def read_events(path) -> list[Event]:
    """All events of one file after its ``file_version`` record (checked to be the first)."""
    events = list(summary_iterator(path))
    assert events[0].file_version == "brain.Event:2"
    return events[1:]


def all_events(logdir) -> list[Event]:
    return [e for path in event_files(logdir) for e in read_events(path)]


def session_logs(events) -> list[tuple[int, int, str]]:
    """``(step, status, checkpoint_path)`` of every session-log event, in order."""
    return [
        (e.step, e.session_log.status, e.session_log.checkpoint_path)
        for e in events
        if e.HasField("session_log")
    ]


def scalars(events, tag: str) -> list[tuple[int, float]]:
    return [
        (e.step, v.simple_value)
        for e in events
        if e.HasField("summary")
        for v in e.summary.value
        if v.tag == tag
    ]


def accumulator(logdir) -> event_accumulator.EventAccumulator:
    """TensorBoard's own reader of a run directory, keeping every event."""
    acc = event_accumulator.EventAccumulator(
        os.fspath(logdir), size_guidance=event_accumulator.STORE_EVERYTHING_SIZE_GUIDANCE
    )
    acc.Reload()
    return acc


def checkpoint_steps(logdir) -> list[int]:
    """Steps of the committed checkpoints in ``logdir`` (those with an index), sorted."""
    steps = []
    for name in os.listdir(logdir):
        if name.endswith(".index") and not is_temporary_name(name) and "-" in name:
            steps.append(int(name[: -len(".index")].rsplit("-", 1)[1]))
    return sorted(steps)


def read_checkpoint(prefix) -> dict:
    """The state tree of a checkpoint, every checksum verified."""
    reader = CheckpointReader(os.fspath(prefix))
    reader.verify()
    return reader.read_tree()


def temporary_files(logdir) -> list[str]:
    return [name for name in os.listdir(logdir) if is_temporary_name(name)]


def committed_steps(logdir: str) -> list[int]:
    """Steps of the committed checkpoints of ``logdir``, each verified byte by byte."""
    steps = []
    for name in os.listdir(logdir):
        if name.endswith(".index") and not is_temporary_name(name):
            reader = CheckpointReader(os.path.join(logdir, name[: -len(".index")]))
            reader.verify()
            steps.append(reader.global_step)
    return sorted(steps)
