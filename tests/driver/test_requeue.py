"""Requeue after a preemption stop: which stops requeue, ``scontrol``'s outcome logged, and a
Supervisor that requeues once everything is saved (a fake ``scontrol`` here; the real SLURM
in ``tests/slurm``)."""

from __future__ import annotations

import logging
import os
import signal
import stat
import time

import pytest
from monitored_helpers import Counter

from torchsupervisor import (
    MonitoredTrainingSession,
    PreemptionNotice,
    SlurmRequeue,
    SlurmTimeLimit,
    Supervisor,
    latest_checkpoint,
)
from torchsupervisor.driver.requeue import check_requeue


def _fake_scontrol(tmp_path, code: int = 0, message: str = "") -> tuple[str, object]:
    path = tmp_path / "scontrol"
    log = tmp_path / "scontrol.log"
    path.write_text(
        f'#!/bin/sh\necho "$*" >> {log}\n'
        + (f"echo '{message}' >&2\n" if message else "")
        + f"exit {code}\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path), log


def test_which_stops_requeue():
    requeue = SlurmRequeue("12")
    assert requeue.wants(signal.SIGUSR1, None) and requeue.wants(signal.SIGUSR2, None)
    assert not requeue.wants(signal.SIGTERM, None)  # scancel: the user cancels the job.
    assert not requeue.wants(signal.SIGINT, None)
    limit = PreemptionNotice(SlurmTimeLimit.name, time.time(), "job 12", scheduled=True)
    assert requeue.wants(None, limit)
    assert not requeue.wants(None, PreemptionNotice("AWS spot", time.time()))
    assert not requeue.wants(None, None)
    assert SlurmRequeue("12", signals=[signal.SIGTERM]).wants(signal.SIGTERM, None)


def test_requeue_runs_scontrol_and_logs_what_slurm_says(tmp_path, caplog):
    scontrol, log = _fake_scontrol(tmp_path)
    caplog.set_level(logging.WARNING, logger="torchsupervisor")
    assert SlurmRequeue("31", scontrol=scontrol).requeue()
    assert log.read_text() == "requeue 31\n"
    assert "Requeued SLURM job 31" in caplog.text
    (tmp_path / "refusing").mkdir()
    refused, _ = _fake_scontrol(
        tmp_path / "refusing", code=1, message="Requested operation is presently disabled"
    )
    assert not SlurmRequeue("31", scontrol=refused).requeue()
    assert (
        "Could not requeue SLURM job 31: Requested operation is presently disabled" in caplog.text
    )
    assert not SlurmRequeue("31", scontrol=str(tmp_path / "absent")).requeue()


def test_check_requeue(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    assert check_requeue("r", "auto") is None and check_requeue("r", None) is None
    _fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert check_requeue("r", "auto").job_id == "77"
    with pytest.raises(TypeError, match="preemption_requeue must be 'auto', None or"):
        Supervisor(state=Counter().state, preemption_requeue="slurm")


@pytest.mark.parametrize(("sig", "requeued"), [(signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_supervisor_requeues_after_the_final_checkpoint(tmp_path, sig, requeued):
    scontrol, log = _fake_scontrol(tmp_path)
    counter = Counter()
    logdir = str(tmp_path / "logdir")
    sv = Supervisor(
        logdir=logdir,
        state=counter.state,
        save_model_secs=3600,
        save_summaries_secs=0,
        preemption_sources=None,
        preemption_requeue=SlurmRequeue("5", scontrol=scontrol),
    )
    with sv.managed_session() as sess:
        for _ in range(3):
            sess.run(counter.step)
        os.kill(os.getpid(), sig)
        assert sv.should_stop()
        assert not log.exists()  # Not before the session closed.
    assert latest_checkpoint(logdir).endswith("-3")
    assert log.exists() == requeued
    assert sv._preemption.requeued == requeued


def test_monitored_session_requeues_then_exits_with_its_code(tmp_path):
    scontrol, log = _fake_scontrol(tmp_path)
    counter = Counter()
    with (
        pytest.raises(SystemExit) as leaving,
        MonitoredTrainingSession(
            checkpoint_dir=str(tmp_path / "ckpt"),
            state=counter.state,
            preemption_exit_code=3,
            preemption_signals=(signal.SIGTERM, signal.SIGUSR2),
            preemption_sources=None,
            preemption_requeue=SlurmRequeue("6", scontrol=scontrol),
        ) as sess,
    ):
        sess.run(counter.step)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert sess.should_stop()
    assert leaving.value.code == 3
    assert log.read_text() == "requeue 6\n"
