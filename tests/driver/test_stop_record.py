"""The record of how a session ended (``driver/stop_record.py``), written by the Supervisor's
chief and read by ``torchsupervisor preempted``."""

from __future__ import annotations

import json
import os

import pytest
import torch
from supervisor_helpers import Counter

from torchsupervisor import GlobalStep, Supervisor
from torchsupervisor.cli import main
from torchsupervisor.driver.stop_record import (
    STOP_RECORD,
    StopRecord,
    read_stop_record,
    write_stop_record,
)
from torchsupervisor.errors import DataLossError
from torchsupervisor.storage import storage_for


def _record(logdir) -> dict:
    with open(os.path.join(logdir, STOP_RECORD)) as f:
        return json.load(f)


def test_a_clean_end_an_error_and_a_kill_are_told_apart(tmp_path, capsys):
    logdir = str(tmp_path)
    c = Counter()
    with Supervisor(logdir=logdir, state=c.state, save_model_secs=3600).managed_session() as s:
        s.run(c.step)
    record = _record(logdir)
    assert (record["reason"], record["step"], record["checkpoint"]) == ("end", 1, "model.ckpt-1")
    assert record["final_checkpoint"] and record["signal"] is None
    assert main(["preempted", logdir]) == 1  # Not a preemption: nothing to requeue.
    assert "ended cleanly at step 1; its final checkpoint model.ckpt-1 committed" in (
        capsys.readouterr().out
    )

    sv = Supervisor(logdir=logdir, state=c.state, save_model_secs=3600)
    with pytest.raises(ValueError), sv.managed_session() as s:
        s.run(c.step)
        raise ValueError("diverged")
    record = _record(logdir)
    assert record["reason"] == "error" and record["error"] == "ValueError: diverged"
    assert not record["final_checkpoint"]  # No final checkpoint after an error.

    # A session in progress (or killed) has no record: the start removed the last one.
    sv = Supervisor(logdir=logdir, state=c.state, save_model_secs=3600)
    sv.prepare_or_wait_for_session()
    assert read_stop_record(storage_for(logdir), logdir) is None
    assert main(["preempted", logdir]) == 1
    assert "No record of how the last session" in capsys.readouterr().out
    sv.stop()


def test_a_preemption_whose_final_checkpoint_committed_means_requeue(tmp_path, capsys):
    logdir = str(tmp_path)
    record = write_stop_record(
        storage_for(logdir),
        logdir,
        reason="preemption",
        signal="SIGTERM",
        step=120,
        checkpoint=os.path.join(logdir, "model.ckpt-120"),
        error=None,
        wall_time=1.0,
    )
    assert record.requeue and read_stop_record(storage_for(logdir), logdir) == record
    assert main(["preempted", logdir]) == 0
    assert capsys.readouterr().out == (
        "The last session stopped by SIGTERM at step 120; its final checkpoint "
        "model.ckpt-120 committed.\n"
    )
    lost = StopRecord("preemption", "SIGTERM", 130, "model.ckpt-120", False, None, 2.0)
    assert not lost.requeue  # Its final checkpoint failed: work was lost.


def test_a_damaged_record_is_named(tmp_path, capsys):
    with open(tmp_path / STOP_RECORD, "w") as f:
        f.write('{"reason": "end"')
    with pytest.raises(DataLossError, match=f"Damaged stop record .*{STOP_RECORD}"):
        read_stop_record(storage_for(str(tmp_path)), str(tmp_path))
    assert main(["preempted", str(tmp_path)]) == 1
    assert "Damaged stop record" in capsys.readouterr().err


def test_the_stop_event_says_how_the_session_ended(tmp_path):
    from supervisor_helpers import event_files, read_events

    step = GlobalStep()
    sv = Supervisor(logdir=str(tmp_path), state={"w": torch.zeros(1), "global_step": step})
    with sv.managed_session():
        step.increment()
    (stop,) = [e for e in read_events(event_files(tmp_path)[0]) if e.session_log.status == 2]
    assert stop.session_log.msg == "end"
