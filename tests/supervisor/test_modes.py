"""How the Supervisor's modes start and end: a sharded non-chief does not sleep for nothing;
a rank stopped by another rank's error ends with an error too."""

from __future__ import annotations

import os
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from torchsupervisor import GlobalStep, Supervisor, latest_checkpoint, summary_iterator
from torchsupervisor.supervisor.modes import OPEN_POLL_SECS
from torchsupervisor.testing import FakeClock, run_world


class _SignallingClock(FakeClock):
    """A fake clock that tells the other ranks (a file appears) once this rank waits."""

    def __init__(self, signal_path: str) -> None:
        super().__init__()
        self.signal_path = signal_path

    def sleep(self, secs: float) -> None:
        with open(self.signal_path, "w"):
            pass
        super().sleep(secs)


def _wait_for_file(path: str, timeout_secs: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_secs
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def sharded_start_rank(rank: int, world_size: int, logdir: str) -> list[float]:
    """Rank 1 starts first and must wait for rank 0; return rank 1's sleeps (seconds)."""
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    signal_path = logdir + ".rank1-waits"
    clock = _SignallingClock(signal_path) if rank == 1 else FakeClock()
    if rank == 0:  # Only once rank 1 is surely waiting for the chief.
        _wait_for_file(signal_path)
    sv = Supervisor(
        logdir=logdir,
        state={"model": model, "global_step": GlobalStep()},
        recovery_wait_secs=30,  # TF's default.
        save_model_secs=0,
        save_summaries_secs=0,
        clock=clock,
    )
    with sv.managed_session() as sess:
        assert sess.restored_checkpoint is None
    return clock.sleeps


def test_a_sharded_non_chief_that_starts_first_looks_often_for_the_chief(tmp_path):
    _, sleeps = run_world(sharded_start_rank, str(tmp_path))
    # It waited (the chief had not started), in short looks: not TF's 30 s recovery wait,
    # which is for a model another process initializes, not for the chief's quick clean-up.
    assert sleeps and max(sleeps) <= OPEN_POLL_SECS


def replicated_rank_that_fails(rank: int, world_size: int, logdir: str) -> tuple[str, int]:
    """Rank 1 raises after 3 steps; rank 0 trains alone (no collectives) until told to stop.

    Returns the error each rank's ``managed_session`` raised (``"Type: message"``) and the
    step it stopped at.
    """
    step = GlobalStep()
    sv = Supervisor(
        logdir=logdir,
        state={"w": torch.zeros(2), "global_step": step},
        save_model_secs=3600,  # Only the final checkpoint.
        save_summaries_secs=0,
        recovery_wait_secs=0.1,
    )
    deadline = time.monotonic() + 60
    try:
        with sv.managed_session():
            while not sv.should_stop() and time.monotonic() < deadline:
                if rank == 1 and step.value == 3:
                    raise RuntimeError("boom")
                step.increment()
                time.sleep(0.01)
    except Exception as e:
        return f"{type(e).__name__}: {e}", step.value
    return "no error", step.value


def test_a_rank_stopped_by_another_ranks_error_saves_then_raises_aborted(tmp_path):
    (error0, step0), (error1, _) = run_world(replicated_rank_that_fails, str(tmp_path))
    assert error1 == "RuntimeError: boom"
    # Rank 0 stopped at once (its poller saw the failure), not after its 60 s of training...
    assert error0 == (
        "AbortedError: Stopped because another rank failed: rank 1: RuntimeError: boom"
    )
    # ... and the chief first saved its own state, which is whole: nothing is lost.
    assert latest_checkpoint(str(tmp_path)).endswith(f"model.ckpt-{step0}")


def quickstart_rank(rank: int, world_size: int, logdir: str) -> tuple[str, int]:
    """The quickstart's loop, with DDP, unchanged on every rank."""
    model = DistributedDataParallel(torch.nn.Linear(10, 1))
    optimizer = torch.optim.Adam(model.parameters())
    step = GlobalStep()
    step.bind(optimizer)
    sv = Supervisor(
        logdir=logdir,
        state={"model": model, "optimizer": optimizer, "global_step": step},
        recovery_wait_secs=0.1,
    )
    with sv.managed_session():
        while not sv.should_stop() and step.value < 5:
            optimizer.zero_grad()
            loss = model(torch.randn(32, 10)).pow(2).mean()
            loss.backward()
            optimizer.step()
            sv.summary_writer.add_scalar("loss", loss, step.value)
            sv.summary_writer.add_histogram("w", model.module.weight, step.value)
    return type(sv.summary_writer).__name__, step.value


def test_the_quickstart_loop_runs_on_every_rank_and_only_the_chief_writes(tmp_path):
    # TF's non-chief summary_writer is None: the loop raised AttributeError on rank 1.
    (chief, step0), (replica, step1) = run_world(quickstart_rank, str(tmp_path))
    assert (chief, replica) == ("SummaryWriter", "NullSummaryWriter")
    assert step0 == step1 == 5
    (path,) = [p for p in os.listdir(tmp_path) if "tfevents" in p]  # The chief's only.
    steps = [  # The loop's summaries (the goodput ledger's scalars come at the end).
        e.step
        for e in summary_iterator(str(tmp_path / path))
        if e.summary.value and not e.summary.value[0].tag.startswith(("goodput/", "badput/"))
    ]
    assert [s for s in steps if s] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def both_signalled_rank(rank: int, world_size: int, logdir: str) -> tuple[int, list[str]]:
    """Every rank gets SIGTERM at step 3 (torchrun forwards it to each); return the step the
    rank stopped at and what it logged about the signal."""
    import logging
    import signal

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "Received" in record.getMessage():
                records.append(record.getMessage())

    logging.getLogger("torchsupervisor").addHandler(Keep())
    step = GlobalStep()
    sv = Supervisor(
        logdir=logdir,
        state={"w": torch.zeros(2), "global_step": step},
        save_model_secs=3600,
        save_summaries_secs=0,
        recovery_wait_secs=0.1,
    )
    deadline = time.monotonic() + 60
    with sv.managed_session():
        while not sv.should_stop() and time.monotonic() < deadline:
            step.increment()
            if step.value == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01 * (1 + rank))  # The ranks notice it at different steps.
    return step.value, records


def test_every_rank_logs_the_agreed_stop_step_once(tmp_path):
    # Each rank logged the step at which it noticed the signal (nanoGPT: 46 on both ranks,
    # stop at 47; imagenet: 11 and 14, stop at 11).
    (step0, logs0), (step1, logs1) = run_world(both_signalled_rank, str(tmp_path))
    assert step0 == step1
    expected = [f"Received SIGTERM: stopping at step {step0}"]
    assert [m.split(" with")[0] for m in logs0] == expected
    assert [m.split(" with")[0] for m in logs1] == expected
