"""A TF 1 style input pipeline (slice_input_producer -> shuffle_batch) resumes exactly.

The worker (``tests/workers/input_pipeline_worker.py``) prints the example ids of the batch
trained at each step. A run stopped with SIGTERM (final checkpoint) or SIGKILL (the last
periodic checkpoint) and started again must train on exactly the batches of an uninterrupted
run from the restored step on: same examples, same order (one enqueue thread). With three
enqueue threads the order is timing-dependent, but no example is lost or seen twice.
"""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import time

import pytest
from repo_paths import worker

from torchsupervisor import latest_checkpoint

WORKER = worker("input_pipeline_worker.py")
STEPS = 1000  # More than the input holds: runs end at the end of the input (38 batches).


def _start(logdir, tmp_path, *args):
    stderr = open(tmp_path / "stderr.txt", "a")  # noqa: SIM115 (closed by the process's end)
    return subprocess.Popen(
        [sys.executable, WORKER, str(logdir), str(STEPS), *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def _read_until(proc, prefix, tmp_path):
    lines = []
    while True:
        line = proc.stdout.readline()
        assert line, (
            f"worker ended before {prefix!r}: {lines} {(tmp_path / 'stderr.txt').read_text()}"
        )
        lines.append(line.strip())
        if line.startswith(prefix):
            return lines


def _finish(proc, tmp_path):
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, (tmp_path / "stderr.txt").read_text()
    return out.splitlines()


def _batches(lines):
    return {int(x.split()[1]): x.split()[2:] for x in lines if x.startswith("BATCH")}


def _committed_step(logdir):
    latest = latest_checkpoint(str(logdir))
    return -1 if latest is None else int(latest.rsplit("-", 1)[1])


def _wait_for_a_commit(logdir):
    """Wait for a checkpoint after step 0 (the worker holds after step 12 meanwhile)."""
    deadline = time.monotonic() + 120
    while _committed_step(logdir) < 1:
        assert time.monotonic() < deadline, "no checkpoint after step 0 committed in 120 s"
        time.sleep(0.05)


def _ready(lines):
    (ready,) = [x for x in lines if x.startswith("READY")]
    return int(ready.split()[1])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    lines = _finish(_start(tmp / "logdir", tmp), tmp)
    batches = _batches(lines)
    assert sorted(batches) == list(range(38)) and lines[-1] == "DONE 38"
    return batches


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_pipeline_resumes_with_exactly_the_batches_of_an_uninterrupted_run(
    tmp_path, reference, sig
):
    logdir = tmp_path / "logdir"
    first = _start(logdir, tmp_path, "--step-delay", "0.05", "--hold-after", "12")
    lines = _read_until(first, "BATCH 12", tmp_path)
    _wait_for_a_commit(logdir)  # The writer thread runs at idle priority: on a busy machine
    first.send_signal(sig)  # nothing may be committed yet by step 12.
    lines += first.communicate(timeout=300)[0].splitlines()
    second = _finish(_start(logdir, tmp_path), tmp_path)
    restored = _ready(second)
    assert restored >= 1  # A checkpoint was committed before the signal.
    trained_first = {s: b for s, b in _batches(lines).items() if s < restored}
    trained = {**trained_first, **_batches(second)}
    assert sorted(trained) == list(range(38))
    assert trained == reference
    if sig == signal.SIGTERM:
        assert max(_batches(lines)) == restored - 1  # The final checkpoint lost no step.


def test_a_pipeline_of_record_files_resumes_exactly_after_sigterm(tmp_path):
    # CIFAR-10's shape: files of fixed-length records, read by a reader whose position in its
    # file is saved. Its port through a py_func lost the records it had buffered.
    records = str(tmp_path / "records")
    whole = tmp_path / "whole"
    whole.mkdir()
    uninterrupted = _batches(_finish(_start(whole / "logdir", whole, "--records", records), whole))
    assert sorted(uninterrupted) == list(range(38))
    logdir = tmp_path / "logdir"
    first = _start(
        logdir, tmp_path, "--records", records, "--step-delay", "0.05", "--hold-after", "12"
    )
    lines = _read_until(first, "BATCH 12", tmp_path)
    first.send_signal(signal.SIGTERM)
    lines += first.communicate(timeout=300)[0].splitlines()
    second = _finish(_start(logdir, tmp_path, "--records", records), tmp_path)
    restored = _ready(second)
    assert max(_batches(lines)) == restored - 1  # The final checkpoint lost no step.
    trained = {**{s: b for s, b in _batches(lines).items() if s < restored}, **_batches(second)}
    assert trained == uninterrupted


def test_with_several_enqueue_threads_no_example_is_lost_or_repeated(tmp_path):
    logdir = tmp_path / "logdir"
    first = _start(logdir, tmp_path, "--step-delay", "0.05", "--threads", "3", "--hold-after", "12")
    lines = _read_until(first, "BATCH 12", tmp_path)
    first.send_signal(signal.SIGTERM)
    lines += first.communicate(timeout=300)[0].splitlines()
    second = _finish(_start(logdir, tmp_path, "--threads", "3"), tmp_path)
    batches = {**_batches(lines), **_batches(second)}
    counts = collections.Counter(i for batch in batches.values() for i in batch)
    assert counts == {str(i): 3 for i in range(100)}
