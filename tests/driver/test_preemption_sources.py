"""Preemptions announced without a signal: SLURM's time limit (a fake ``squeue`` here; the real
SLURM in the slow tests), and AWS, GCE and Azure notices from fake metadata services on
127.0.0.1; the watcher's timing, and a Supervisor and a MonitoredTrainingSession stopping at a
notice with a final checkpoint."""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time

import pytest
import torch
from metadata_server import FakeMetadata
from monitored_helpers import Counter

from torchsupervisor import (
    AwsSpotNotice,
    AzureScheduledEvents,
    GcePreemptedNotice,
    MonitoredTrainingSession,
    PreemptionNotice,
    SlurmTimeLimit,
    Supervisor,
    latest_checkpoint,
)
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.driver.preemption import EXIT_MARGIN_SECS, Preemption
from torchsupervisor.driver.preemption_sources import (
    PreemptionWatcher,
    check_sources,
    detect_sources,
)

DEADLINE_SECS = 30.0  # Bound of every wait below (a busy 2-core machine), never a timing.

AWS_TOKEN = "/latest/api/token"
AWS_ACTION = "/latest/meta-data/spot/instance-action"
GCE_PREEMPTED = "/computeMetadata/v1/instance/preempted"
AZURE_EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
AZURE_NAME = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"


@pytest.fixture
def metadata():
    server = FakeMetadata()
    yield server
    server.close()


def _iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def _rfc1123(epoch: float) -> str:
    return time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(epoch))


# AWS -------------------------------------------------------------------------------------------


def test_aws_spot_notice_with_a_session_token(metadata):
    metadata.set(AWS_TOKEN, 200, b"tok-1", method="PUT")
    source = AwsSpotNotice(metadata.url)
    assert source.poll() is None  # 404: no interruption scheduled.
    end = int(time.time()) + 120
    action = json.dumps({"action": "terminate", "time": _iso(end)}).encode()
    metadata.set(AWS_ACTION, 200, action, needs={"X-aws-ec2-metadata-token": "tok-1"})
    notice = source.poll()
    assert notice == PreemptionNotice("AWS spot", float(end), "instance-action terminate")
    # One token for both polls, asked for with its lifetime.
    tokens = [r for r in metadata.requests if r[1] == AWS_TOKEN]
    assert len(tokens) == 1 and tokens[0][0] == "PUT"
    assert tokens[0][2]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"


def test_aws_falls_back_to_imdsv1_and_renews_a_refused_token(metadata):
    source = AwsSpotNotice(metadata.url)
    end = int(time.time()) + 120
    action = json.dumps({"action": "stop", "time": _iso(end)}).encode()
    metadata.set(AWS_ACTION, 200, action)  # No token service: IMDSv1.
    assert source.poll().detail == "instance-action stop"
    metadata.set(AWS_TOKEN, 200, b"tok-2", method="PUT")
    metadata.set(AWS_ACTION, 401)  # A token it no longer takes: asked again next time.
    assert source.poll() is None
    metadata.set(AWS_ACTION, 200, action, needs={"X-aws-ec2-metadata-token": "tok-2"})
    assert source.poll().deadline == end


def test_aws_answers_it_does_not_understand_raise(metadata):
    source = AwsSpotNotice(metadata.url)
    metadata.set(AWS_ACTION, 200, b'{"action": "terminate"}')
    with pytest.raises(ValueError, match="instance-action"):
        source.poll()
    metadata.set(AWS_ACTION, 500)
    with pytest.raises(OSError, match="HTTP 500"):
        source.poll()


# GCE -------------------------------------------------------------------------------------------


def test_gce_preempted_notice(metadata):
    source = GcePreemptedNotice(metadata.url, poll_every_secs=1.0)
    metadata.set(GCE_PREEMPTED, 200, b"FALSE", needs={"Metadata-Flavor": "Google"})
    assert source.poll() is None
    metadata.set(GCE_PREEMPTED, 200, b"TRUE", needs={"Metadata-Flavor": "Google"})
    before = time.time()
    first = source.poll()
    # 30 s from the notice, counted from one poll interval before it was seen.
    assert before + 29.0 - 1.0 <= first.deadline <= time.time() + 29.0
    assert first.source == "GCE" and not first.scheduled
    assert source.poll().deadline == first.deadline  # The same notice: the same deadline.


def test_gce_without_the_header_is_refused(metadata):
    metadata.set(GCE_PREEMPTED, 200, b"TRUE", needs={"Metadata-Flavor": "Google"})
    metadata.set("/other", 200, b"")
    source = GcePreemptedNotice(metadata.url)
    assert source.poll() is not None
    assert metadata.requests[-1][2]["metadata-flavor"] == "Google"


# Azure -----------------------------------------------------------------------------------------


def _azure_events(*events: dict) -> bytes:
    return json.dumps({"DocumentIncarnation": 3, "Events": list(events)}).encode()


def test_azure_scheduled_events_of_this_vm(metadata):
    metadata.set(AZURE_NAME, 200, b"vm-a", needs={"Metadata": "true"})
    now = int(time.time())
    events = _azure_events(
        {"EventId": "e1", "EventType": "Freeze", "Resources": ["vm-a"], "NotBefore": ""},
        {"EventId": "e2", "EventType": "Preempt", "Resources": ["vm-b"],
         "NotBefore": _rfc1123(now + 10)},
        {"EventId": "e3", "EventType": "Preempt", "Resources": ["vm-a"],
         "NotBefore": _rfc1123(now + 40)},
        {"EventId": "e4", "EventType": "Reboot", "Resources": ["vm-a"],
         "NotBefore": _rfc1123(now + 300)},
    )  # fmt: skip
    metadata.set(AZURE_EVENTS, 200, _azure_events(), needs={"Metadata": "true"})
    source = AzureScheduledEvents(metadata.url)
    assert source.poll() is None
    metadata.set(AZURE_EVENTS, 200, events, needs={"Metadata": "true"})
    notice = source.poll()
    # A Freeze does not stop the process; another VM's preemption is not this one's.
    assert notice == PreemptionNotice("Azure", float(now + 40), "Preempt e3")
    assert source.vm_name == "vm-a"


def test_azure_event_that_has_started_is_due_now(metadata):
    events = _azure_events({"EventId": "e9", "EventType": "Terminate", "NotBefore": ""})
    metadata.set(AZURE_EVENTS, 200, events, needs={"Metadata": "true"})
    source = AzureScheduledEvents(metadata.url, vm_name="vm-a")
    notice = source.poll()
    assert notice.detail == "Terminate e9" and notice.deadline <= time.time()
    metadata.set(AZURE_EVENTS, 200, b'{"Events": "no"}', needs={"Metadata": "true"})
    with pytest.raises(ValueError, match="Events"):
        source.poll()


# SLURM (a fake squeue; the real one in tests/slurm) --------------------------------------------


def _fake_squeue(tmp_path, output: str, code: int = 0) -> str:
    """An ``squeue`` that records its arguments and ``$SLURM_TIME_FORMAT`` and prints
    ``output``."""
    path = tmp_path / "squeue"
    log = tmp_path / "squeue.log"
    path.write_text(
        "#!/bin/sh\n"
        f'echo "$* | $SLURM_TIME_FORMAT" >> {log}\n'
        f"printf '%s\\n' '{output}'\n"
        f"exit {code}\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_slurm_time_limit_from_squeue(tmp_path):
    end = int(time.time()) + 3600
    source = SlurmTimeLimit("417", squeue=_fake_squeue(tmp_path, str(end)))
    notice = source.poll()
    assert notice.source == "SLURM time limit" and notice.scheduled
    assert notice.deadline == end and notice.detail.startswith("job 417 ends at ")
    assert (tmp_path / "squeue.log").read_text().split("\n")[0] == "-h -j 417 -o %e | %s"


@pytest.mark.parametrize("output", ["N/A", "Unknown", ""])
def test_slurm_job_without_an_end_time(tmp_path, output):
    assert SlurmTimeLimit("5", squeue=_fake_squeue(tmp_path, output)).poll() is None


def test_slurm_squeue_failure_raises(tmp_path):
    source = SlurmTimeLimit("5", squeue=_fake_squeue(tmp_path, "Invalid job id", code=1))
    with pytest.raises(OSError, match="failed"):
        source.poll()
    with pytest.raises(OSError):
        SlurmTimeLimit("5", squeue=str(tmp_path / "absent")).poll()


def test_slurm_iso_end_time_is_read_as_local_time(tmp_path):
    end = int(time.time()) + 600
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(end))
    assert SlurmTimeLimit("5", squeue=_fake_squeue(tmp_path, text)).poll().deadline == end


# Detection and arguments -----------------------------------------------------------------------


def test_detect_sources_from_the_environment_and_dmi(tmp_path, monkeypatch):
    dmi = tmp_path / "dmi"
    dmi.mkdir()
    assert detect_sources({}, str(dmi)) == []
    (dmi / "sys_vendor").write_text("Amazon EC2\n")
    assert [type(s) for s in detect_sources({}, str(dmi))] == [AwsSpotNotice]
    (dmi / "sys_vendor").write_text("Google\n")
    (dmi / "product_name").write_text("Google Compute Engine\n")
    assert [type(s) for s in detect_sources({}, str(dmi))] == [GcePreemptedNotice]
    (dmi / "sys_vendor").write_text("Microsoft Corporation\n")
    (dmi / "product_name").write_text("Virtual Machine\n")
    (dmi / "chassis_asset_tag").write_text("7783-7084-3265-9085-8269-3286-77\n")
    assert [type(s) for s in detect_sources({}, str(dmi))] == [AzureScheduledEvents]
    (dmi / "chassis_asset_tag").write_text("none\n")
    # SLURM's time limit needs a job and squeue.
    _fake_squeue(tmp_path, "N/A")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    (found,) = detect_sources({"SLURM_JOB_ID": "88"}, str(dmi))
    assert isinstance(found, SlurmTimeLimit) and found.job_id == "88"
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert detect_sources({"SLURM_JOB_ID": "88"}, str(dmi)) == []


def test_check_sources():
    gce = GcePreemptedNotice("http://127.0.0.1:9")
    assert check_sources("s", None) == () and check_sources("s", [gce]) == (gce,)
    assert isinstance(check_sources("s", "auto"), tuple)
    with pytest.raises(TypeError, match="'auto', None or a list"):
        check_sources("preemption_sources", "aws")
    with pytest.raises(TypeError, match="not a preemption source"):
        check_sources("preemption_sources", [object()])
    with pytest.raises(ValueError, match="poll_every_secs must be > 0"):
        check_sources("preemption_sources", [GcePreemptedNotice(poll_every_secs=0)])
    with pytest.raises(TypeError, match="preemption_sources"):
        Supervisor(state={"w": torch.zeros(1)}, preemption_sources=3)


# The watcher -----------------------------------------------------------------------------------


class _Scripted:
    """A source answering from a list, one answer per poll (the last one repeated)."""

    def __init__(self, name, answers, every=0.01):
        self.name, self.poll_every_secs = name, every
        self._answers = list(answers)
        self.polls = 0

    def poll(self):
        self.polls += 1
        answer = self._answers[min(self.polls, len(self._answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer


def _watch(sources, lead_secs):
    got: list[PreemptionNotice] = []
    done = threading.Event()

    def on_notice(notice):
        got.append(notice)
        done.set()

    watcher = PreemptionWatcher(sources, lead_secs, on_notice)
    watcher.start()
    return watcher, got, done


def test_watcher_hands_over_a_notice_at_once_and_logs_a_failing_source_once(caplog):
    notice = PreemptionNotice("cloud", time.time() + 60, "soon")
    failing = _Scripted("broken", [OSError("unreachable")] * 3 + [None])
    cloud = _Scripted("cloud", [None, None, None, None, notice])
    caplog.set_level(logging.DEBUG, logger="torchsupervisor")
    watcher, got, done = _watch([failing, cloud], lead_secs=30.0)
    assert done.wait(DEADLINE_SECS)
    watcher.stop()
    assert got == [notice] and cloud.polls == 5
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "Cannot poll broken for a preemption notice: unreachable"
    ]
    assert any("works again" in r.getMessage() for r in caplog.records)


def test_watcher_hands_over_a_scheduled_end_lead_secs_before_it():
    end = time.time() + 1.5
    limit = _Scripted("limit", [PreemptionNotice("limit", end, scheduled=True)], every=60)
    watcher, got, done = _watch([limit], lead_secs=1.0)
    assert done.wait(DEADLINE_SECS)
    handed = time.time()
    watcher.stop()
    # Not before its time (no upper bound: a busy machine).
    assert got[0].deadline == end and handed >= end - 1.0
    assert limit.polls == 1  # Waited for the time, not polled again meanwhile.


def test_watcher_follows_a_moved_end_and_stops_without_a_notice():
    far = PreemptionNotice("limit", time.time() + 3600, scheduled=True)
    limit = _Scripted("limit", [far], every=0.01)
    watcher, got, done = _watch([limit], lead_secs=30.0)
    deadline = time.monotonic() + DEADLINE_SECS
    while limit.polls < 3 and time.monotonic() < deadline:  # Polled again and again...
        time.sleep(0.01)
    watcher.stop()
    assert got == [] and limit.polls >= 3  # ... and never handed over: not due.
    # Moved closer (scontrol update TimeLimit=): due at the next poll.
    near = PreemptionNotice("limit", time.time() + 10, scheduled=True)
    watcher, got, done = _watch([_Scripted("limit", [far, near])], lead_secs=30.0)
    assert done.wait(DEADLINE_SECS)
    watcher.stop()
    assert got == [near]


def test_preemption_budget_is_the_time_left_less_the_exit_margin():
    notice = PreemptionNotice("cloud", time.time() + 40.0, "x")
    preemption = Preemption((), 30.0, sources=[_Scripted("cloud", [notice])])
    preemption.install()
    try:
        deadline = time.monotonic() + DEADLINE_SECS
        while not preemption.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert preemption.requested and preemption.describe() == "cloud"
        assert preemption.received is None and preemption.announced == notice
        assert preemption.notice() and not preemption.notice()
        assert 40.0 - EXIT_MARGIN_SECS - 5 < preemption.budget() <= 40.0 - EXIT_MARGIN_SECS
    finally:
        preemption.uninstall()


# Front ends ------------------------------------------------------------------------------------


def test_supervisor_stops_at_a_gce_notice_with_a_final_checkpoint(tmp_path, metadata, caplog):
    metadata.set(GCE_PREEMPTED, 200, b"FALSE", needs={"Metadata-Flavor": "Google"})
    counter = Counter()
    sv = Supervisor(
        logdir=str(tmp_path),
        state=counter.state,
        save_model_secs=3600,
        save_summaries_secs=0,
        preemption_sources=[GcePreemptedNotice(metadata.url, poll_every_secs=0.02)],
    )
    caplog.set_level(logging.WARNING, logger="torchsupervisor")
    steps = 0
    with sv.managed_session() as sess:
        deadline = time.monotonic() + DEADLINE_SECS
        while not sv.should_stop() and time.monotonic() < deadline:
            sess.run(counter.step)
            steps += 1
            if steps == 5:
                metadata.set(GCE_PREEMPTED, 200, b"TRUE", needs={"Metadata-Flavor": "Google"})
    assert sv.preempted == "GCE"
    step = int(counter.global_step)
    assert step >= 5
    path = latest_checkpoint(str(tmp_path))
    assert path.endswith(f"-{step}")
    assert CheckpointReader(path).get_tensor("global_step") == step
    (line,) = [r.getMessage() for r in caplog.records if "Preemption notice" in r.getMessage()]
    assert line.startswith("Preemption notice from GCE (instance/preempted TRUE; ")
    assert f"s left): stopping at step {step} with a final checkpoint" in line
    assert not [t for t in threading.enumerate() if "preemption-watcher" in t.name]


def test_monitored_training_session_stops_at_an_aws_notice(tmp_path, metadata):
    counter = Counter()
    source = AwsSpotNotice(metadata.url, poll_every_secs=0.02)
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path),
        state=counter.state,
        save_summaries_steps=None,
        save_checkpoint_secs=None,
        save_checkpoint_steps=1000,
        preemption_sources=[source],
    ) as sess:
        deadline = time.monotonic() + DEADLINE_SECS
        while not sess.should_stop() and time.monotonic() < deadline:
            sess.run(counter.step)
            if int(counter.global_step) == 3:
                end = json.dumps({"action": "terminate", "time": _iso(time.time() + 120)})
                metadata.set(AWS_ACTION, 200, end.encode())
        assert sess.preempted == "AWS spot"
    step = int(counter.global_step)
    assert step >= 3 and latest_checkpoint(str(tmp_path)).endswith(f"-{step}")


def test_supervisor_stops_grace_secs_before_the_slurm_end_time(tmp_path, caplog):
    # The final checkpoint gets the time left less 2 s: a grace of 5 s leaves it 3 s, enough
    # on a busy machine (with 3 s, 1 s was left, and an fsync behind the suite's other writes
    # took longer once). squeue's end time is in whole seconds.
    grace = 5.0
    end = int(time.time()) + 8
    source = SlurmTimeLimit("7", squeue=_fake_squeue(tmp_path, str(end)))
    counter = Counter()
    sv = Supervisor(
        logdir=str(tmp_path / "logdir"),
        state=counter.state,
        save_model_secs=3600,
        save_summaries_secs=0,
        preemption_grace_secs=grace,
        preemption_sources=[source],
    )
    caplog.set_level(logging.WARNING, logger="torchsupervisor")
    with sv.managed_session() as sess:
        deadline = time.monotonic() + DEADLINE_SECS
        while not sv.should_stop() and time.monotonic() < deadline:
            sess.run(counter.step)
            time.sleep(0.01)
        stopped = time.time()
    assert sv.preempted == "SLURM time limit"
    assert stopped >= end - grace  # Not before the grace period's start.
    step = int(counter.global_step)
    assert latest_checkpoint(str(tmp_path / "logdir")).endswith(f"-{step}")
    assert "Preemption notice from SLURM time limit (job 7 ends at " in caplog.text
    # The stop record says a preemption stopped it: a requeue script tells it from a failure.
    from torchsupervisor.driver.stop_record import read_stop_record
    from torchsupervisor.storage import storage_for

    record = read_stop_record(storage_for(str(tmp_path / "logdir")), str(tmp_path / "logdir"))
    assert record.reason == "preemption" and record.signal == "SLURM time limit"
    assert record.step == step


def test_detect_sources_from_the_metadata_variables(tmp_path):
    dmi = str(tmp_path)  # No DMI tables: only the variables say where the services are.
    found = detect_sources(
        {
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:1338",
            "GCE_METADATA_HOST": "127.0.0.1:8080",
            "TORCHSUPERVISOR_AZURE_METADATA_ENDPOINT": "http://127.0.0.1:9090/",
        },
        dmi,
    )
    assert [(type(s), s.endpoint) for s in found] == [
        (AwsSpotNotice, "http://127.0.0.1:1338"),
        (GcePreemptedNotice, "http://127.0.0.1:8080"),
        (AzureScheduledEvents, "http://127.0.0.1:9090"),
    ]
    off = {"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://x", "AWS_EC2_METADATA_DISABLED": "true"}
    assert detect_sources(off, dmi) == []


def _worker_losses(text: str) -> dict[int, str]:
    return {
        int(line.split()[1]): line.split()[2] for line in text.splitlines() if line[:5] == "LOSS "
    }


def test_a_run_told_by_the_environment_of_a_fake_gce_stops_and_resumes_exactly(tmp_path, metadata):
    # What a user's program sees on a GCE spot VM, here with the metadata server the
    # environment names (GCE_METADATA_HOST): the notice stops it with a final checkpoint and
    # the restart goes on from that step, as if never stopped.
    import subprocess
    import sys

    from repo_paths import worker

    script, steps = worker("preemption_worker.py"), 60
    run = [sys.executable, "-u", script, str(tmp_path / "run"), str(steps)]
    reference = subprocess.run(
        [sys.executable, script, str(tmp_path / "reference"), str(steps)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr[-3000:]
    metadata.set(GCE_PREEMPTED, 200, b"FALSE", needs={"Metadata-Flavor": "Google"})
    env = {**os.environ, "GCE_METADATA_HOST": metadata.url.removeprefix("http://")}
    first = subprocess.Popen(
        [*run, "--step-delay", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    lines = []
    deadline = time.monotonic() + 120
    while not any(line.startswith("LOSS 10 ") for line in lines):
        line = first.stdout.readline()
        assert line and time.monotonic() < deadline, (lines, first.stderr.read())
        lines.append(line)
    metadata.set(GCE_PREEMPTED, 200, b"TRUE", needs={"Metadata-Flavor": "Google"})
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-3000:]
    assert "Preemption notice from GCE (instance/preempted TRUE; " in err
    stopped = int(err.split("stopping at step ")[1].split()[0])
    assert 10 < stopped < steps
    metadata.set(GCE_PREEMPTED, 200, b"FALSE", needs={"Metadata-Flavor": "Google"})
    second = subprocess.run(run, capture_output=True, text=True, timeout=300, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.startswith(f"READY {stopped}\n")  # No step lost.
    losses = _worker_losses("".join(lines) + out)
    losses.update(_worker_losses(second.stdout))
    assert losses == _worker_losses(reference.stdout)
    assert second.stdout.splitlines()[-1] == reference.stdout.splitlines()[-1]  # DONE, digest.
