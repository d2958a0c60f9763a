"""A restart removes the lost segment from the events files and records itself, so that
neither of TensorBoard's loaders shows a point the resumed run does not stand behind."""

from __future__ import annotations

import os
import re
import time
import urllib.error

import pytest
from tensorboard.compat.proto.event_pb2 import SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard_server import get_json, serve

from torchsupervisor import SummaryWriter, summary_iterator
from torchsupervisor.storage import storage_for
from torchsupervisor.summary.restarts import drop_lost_segment
from torchsupervisor.summary.writer import write_start
from torchsupervisor.testing import events_worker_of

KILLED_AFTER, RESTORED = 29, 20


def _crashed_run(logdir, first: int = 0) -> None:
    """Run 1: steps ``first``-29 logged (loss every step, a rare tag once, at 25), no
    checkpoint after step 20, no STOP: what a SIGKILL leaves."""
    w = SummaryWriter(logdir)
    w.add_session_log(SessionLog(status=SessionLog.START), first)
    for step in range(first, KILLED_AFTER + 1):
        w.add_scalar("loss", 1000.0 + step, step)
    w.add_scalar("eval/rare", 0.5, 25)
    w.close()


def _resumed_run(logdir, until: int, first: int = RESTORED) -> None:
    """Run 2: resumes at step 20, logs the loss of steps ``first``..``until - 1`` and stops
    again before step 25. The START is written as the Supervisor does, at the first step the
    session produces."""
    w = SummaryWriter(logdir)
    write_start(w, RESTORED)
    for step in range(first, until):
        w.add_scalar("loss", 2000.0 + step, step)
    w.close()


def _points(logdir, tag: str) -> list[tuple[int, float]]:
    points = []
    for name in sorted(n for n in os.listdir(logdir) if ".tfevents." in n):
        for event in summary_iterator(os.path.join(logdir, name)):
            for value in event.summary.value:
                if value.tag == tag:
                    points.append((event.step, value.simple_value))
    return points


def _restart_texts(logdir) -> list[str]:
    return [
        v.tensor.string_val[0].decode()
        for name in sorted(n for n in os.listdir(logdir) if ".tfevents." in n)
        for e in summary_iterator(os.path.join(logdir, name))
        for v in e.summary.value
        if v.tag == "torchsupervisor/restart"
    ]


def test_a_summarys_step_counts_the_steps_done_and_the_restored_steps_points_stay(tmp_path):
    # The README's loop: the loss of the s-th step is logged after it, at step s. The
    # checkpoint at 20 stands behind the point at 20; the resumed session logs 21 first.
    logdir = str(tmp_path)
    _crashed_run(logdir, first=1)
    _resumed_run(logdir, 26, first=RESTORED + 1)
    loss = _points(logdir, "loss")
    assert loss == [(s, 1000.0 + s) for s in range(1, 21)] + [
        (s, 2000.0 + s) for s in range(21, 26)
    ]
    assert _points(logdir, "eval/rare") == []  # Logged only in the lost segment.
    assert _points(logdir, "torchsupervisor/steps_lost") == [(RESTORED, 9.0)]
    assert _restart_texts(logdir) == [
        "Resumed at step 20 after a stop at step 29: 9 logged steps were not checkpointed "
        "and are trained again (10 events after step 20 removed)."
    ]


def test_a_point_logged_again_at_the_restored_step_replaces_the_earlier_one(tmp_path):
    # A loop that labels a step's loss with the step count before it logs the restored step
    # again: the resumed session's point replaces the lost segment's.
    logdir = str(tmp_path)
    _crashed_run(logdir)
    _resumed_run(logdir, 25)
    loss = _points(logdir, "loss")
    assert loss == [(s, 1000.0 + s) for s in range(20)] + [(s, 2000.0 + s) for s in range(20, 25)]
    assert _points(logdir, "eval/rare") == []
    assert _points(logdir, "torchsupervisor/steps_lost") == [(RESTORED, 9.0)]
    assert _restart_texts(logdir) == [
        "Resumed at step 20 after a stop at step 29: 9 logged steps were not checkpointed "
        "and are trained again (10 events after step 20 removed). 1 point at step 20 was "
        "logged again and replaced."
    ]


def test_only_the_tags_logged_again_are_replaced_in_a_merged_event(tmp_path):
    logdir = str(tmp_path)
    w = SummaryWriter(logdir)
    w.add_session_log(SessionLog(status=SessionLog.START), 0)
    merged = Summary(
        value=[Summary.Value(tag="a", simple_value=1.0), Summary.Value(tag="b", simple_value=2.0)]
    )
    w.add_summary(merged, RESTORED)
    w.close()
    w = SummaryWriter(logdir)
    write_start(w, RESTORED)
    w.add_scalar("a", 3.0, RESTORED)
    w.close()
    assert _points(logdir, "a") == [(RESTORED, 3.0)]
    assert _points(logdir, "b") == [(RESTORED, 2.0)]
    assert _points(logdir, "torchsupervisor/steps_lost") == [(RESTORED, 0.0)]


def test_a_fresh_start_records_no_restart_and_a_clean_resume_loses_nothing(tmp_path):
    logdir = str(tmp_path)
    w = SummaryWriter(logdir)
    write_start(w, 0)  # A fresh directory.
    w.add_scalar("loss", 1.0, 1)
    w.close()
    assert _points(logdir, "torchsupervisor/steps_lost") == []
    _resumed_run(logdir, 24, first=21)  # Resumes at 20 > everything logged: nothing removed.
    assert _points(logdir, "torchsupervisor/steps_lost") == [(RESTORED, 0.0)]
    assert _restart_texts(logdir) == ["Resumed at step 20; no logged step was lost."]
    assert [s for s, _ in _points(logdir, "loss")] == [1, 21, 22, 23]


def test_files_open_in_this_process_and_damaged_tails(tmp_path):
    logdir = str(tmp_path)
    live = SummaryWriter(logdir)  # Another writer of this process, still open.
    live.add_scalar("other", 1.0, 50)
    live.flush()
    _crashed_run(logdir)
    crashed_file = next(
        os.path.join(logdir, n)
        for n in sorted(os.listdir(logdir))
        if any(
            v.tag == "eval/rare"
            for e in summary_iterator(os.path.join(logdir, n))
            for v in e.summary.value
        )
    )
    with open(crashed_file, "ab") as f:
        f.write(b"\x07\x00\x00")  # A torn record: the writer was killed mid-write.
    lost = drop_lost_segment(storage_for(logdir), logdir, RESTORED, {events_worker_of(live).path})
    assert lost.files == [crashed_file] and lost.last_step == KILLED_AFTER
    assert lost.events_dropped == 10 and lost.steps_lost == 9 and lost.points_replaced == 0
    assert _points(logdir, "other") == [(50, 1.0)]  # The open file was left alone.
    steps = [e.step for e in summary_iterator(crashed_file)]
    assert max(steps) == RESTORED  # Readable to the end: the torn tail went too.
    live.close()


def test_on_an_object_store(memory_url):
    _crashed_run(memory_url)
    _resumed_run(memory_url, 25)
    st = storage_for(memory_url)
    steps = []
    for name in st.list(memory_url):
        if ".tfevents." in name:
            data = st.read_bytes(f"{memory_url}/{name}", max_bytes=1 << 20)
            path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tsv-{os.getpid()}-{name}")
            with open(path, "wb") as f:
                f.write(data)
            steps += [e.step for e in summary_iterator(path)]
            os.remove(path)
    assert max(steps) == 24 and 29 not in steps


# ----------------------------------------------------------- a real TensorBoard server


@pytest.mark.parametrize(
    "load_fast, first",  # The data server, the legacy loader (which purges at START).
    [("true", RESTORED + 1), ("false", RESTORED + 1), ("false", RESTORED)],
    ids=["data-server", "legacy", "legacy-step-before"],
)
def test_both_tensorboard_loaders_show_no_point_of_the_lost_segment(tmp_path, load_fast, first):
    # ``first``: the resumed session's first point, 21 where a summary's step counts the steps
    # done (the README's loop), 20 where it is labelled with the step before.
    logdir = str(tmp_path / "run")
    _crashed_run(logdir, first=first - RESTORED)
    _resumed_run(logdir, 25, first=first)
    with serve(logdir, str(tmp_path), f"--load_fast={load_fast}") as server:
        deadline = time.monotonic() + 540  # A busy machine starts TensorBoard slowly.
        tags: dict = {}
        while time.monotonic() < deadline:
            assert server.process.poll() is None, server.log()
            try:
                tags = get_json(f"{server.base}/data/plugin/scalars/tags").get(".", {})
                if "torchsupervisor/steps_lost" in tags and len(server.scalars("loss")) >= 24:
                    break
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass  # Not listening, or not loaded yet.
            time.sleep(0.5)
        assert "eval/rare" not in tags  # Its only point was in the lost segment.
        old, new = range(first - RESTORED, first), range(first, 25)
        expected = [(s, 1000.0 + s) for s in old] + [(s, 2000.0 + s) for s in new]
        assert server.scalars("loss") == expected
        assert server.scalars("torchsupervisor/steps_lost") == [(RESTORED, 9.0)]


def test_after_a_clean_stop_nothing_is_removed_not_even_the_restored_steps_summaries(tmp_path):
    logdir = str(tmp_path)
    w = SummaryWriter(logdir)
    w.add_session_log(SessionLog(status=SessionLog.START), 0)
    for step in range(RESTORED + 1):  # Up to the restored step itself, then a clean stop.
        w.add_scalar("loss", 1000.0 + step, step)
    w.add_session_log(SessionLog(status=SessionLog.CHECKPOINT), RESTORED)
    w.close()
    lost = drop_lost_segment(storage_for(logdir), logdir, RESTORED, set())
    assert (lost.files, lost.events_dropped, lost.steps_lost) == ([], 0, 0)
    assert _points(logdir, "loss")[-1] == (RESTORED, 1000.0 + RESTORED)


def test_a_monitored_training_session_killed_and_resumed_shows_each_step_once(tmp_path):
    # MonitoredTrainingSession's SummarySaverHook writes START at its first run, as TF's;
    # the killed run's points after the restored step are removed and the restart recorded
    # at the restored step.
    import signal
    import subprocess
    import sys

    from repo_paths import worker

    logdir = str(tmp_path)
    script = worker("monitored_preemption_worker.py")
    options = ["--save-steps", "10", "--summaries"]
    first = subprocess.Popen(
        [sys.executable, script, logdir, "1000", *options, "--step-delay", "0.03"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    for _ in range(10_000):
        line = first.stdout.readline()
        assert line, "the first run ended early"
        if line.startswith("LOSS 25 "):
            break
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    second = subprocess.run(
        [sys.executable, script, logdir, "40", *options],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0, second.stderr
    steps = [step for step, _ in _points(logdir, "loss")]
    assert steps == list(range(1, 41))  # Every step once: the lost segment is gone.
    (marker,) = _points(logdir, "torchsupervisor/steps_lost")
    restored = int(second.stdout.split()[1])  # "READY <step>"
    # At the START (TF's placement: after the first step), naming the step it resumed at and
    # counting the lost steps from there (the killed run's last logged step, on disk then).
    (text,) = _restart_texts(logdir)
    match = re.match(
        rf"Resumed at step {restored} after a stop at step (\d+): (\d+) logged steps ", text
    )
    assert match, text
    stopped, lost = map(int, match.groups())
    assert marker == (restored, float(lost)) and lost == stopped - restored > 0


def test_a_crafted_record_length_in_an_older_file_costs_a_restart_no_memory(tmp_path):
    # A 1 GiB file whose record claims 900 MiB (a valid length checksum): the restart's read
    # of the older files peaked at 2.1 GB.
    import tracemalloc

    from torchsupervisor.summary.records import masked_crc32c

    logdir = str(tmp_path)
    _crashed_run(logdir)
    (path,) = [os.path.join(logdir, n) for n in os.listdir(logdir) if ".tfevents." in n]
    with open(path, "ab") as f:
        header = (900 << 20).to_bytes(8, "little")
        f.write(header + masked_crc32c(header).to_bytes(4, "little"))
        f.truncate(1 << 30)  # Sparse.
    tracemalloc.start()
    try:
        lost = drop_lost_segment(storage_for(logdir), logdir, RESTORED, set())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20
    # What precedes the damage is kept (the lost segment removed), the damage is cut off.
    assert lost.files == [path] and lost.steps_lost == KILLED_AFTER - RESTORED
    assert os.path.getsize(path) < 1 << 20
    assert [s for s, _ in _points(logdir, "loss")] == list(range(RESTORED + 1))
