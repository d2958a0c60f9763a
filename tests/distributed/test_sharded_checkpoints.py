"""A sharded (FSDP2) state under the Supervisor with 2 CPU processes (gloo): every rank restores,
checkpoints and stops together, through the process group's store."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from free_ports import free_port
from repo_paths import worker

from torchsupervisor import latest_checkpoint
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.summary.reader import summary_iterator

WORKER = worker("fsdp_worker.py")
STEPS = 40  # Of the first run (at least 0.8 s: the first checkpoint request comes at once).


def _rank(logdir, rank, port, *args, world_size=2):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    env.update(WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, WORKER, str(logdir), *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _outputs(procs, timeout=120):
    return [(*p.communicate(timeout=timeout), p.returncode) for p in procs]


def _run(logdir, *args, world_size=2):
    port = free_port()
    procs = [_rank(logdir, r, port, *args, world_size=world_size) for r in range(world_size)]
    return _outputs(procs)


def _lines(out, kind):
    return [line.split() for line in out.splitlines() if line.startswith(kind + " ")]


def _ok(results):
    assert all(code == 0 for _, _, code in results), [err[-3000:] for _, err, _ in results]


def _committed_steps(logdir):
    names = os.listdir(logdir)
    return sorted(
        int(n[len("model.ckpt-") : -len(".index")]) for n in names if n.endswith(".index")
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """STEPS steps on 2 ranks with a checkpoint every 0.3 s: the logdir and both outputs."""
    logdir = tmp_path_factory.mktemp("fsdp")
    results = _run(logdir, STEPS, "--step-delay", 0.02, "--save-secs", 0.3)
    _ok(results)
    return logdir, results


def test_periodic_checkpoints_are_written_by_both_ranks_at_the_same_steps(trained):
    logdir, results = trained
    saves = [[int(line[2]) for line in _lines(out, "SAVE")] for out, _, _ in results]
    assert saves[0] == saves[1]  # Same agreed steps on both ranks, same order.
    # The first request is immediate: periodic checkpoint(s), then the final one.
    assert len(saves[0]) >= 2 and saves[0][-1] == STEPS
    assert _committed_steps(logdir) == saves[0]
    for step in saves[0]:
        reader = CheckpointReader(os.path.join(logdir, f"model.ckpt-{step}"))
        assert reader.manifest.global_step == step and reader.manifest.world_size == 2
        assert reader.is_sharded
        for shard in ("00000-of-00002", "00001-of-00002"):
            assert os.path.exists(os.path.join(logdir, f"model.ckpt-{step}.data-{shard}"))
    # The chief wrote a CHECKPOINT event for each.
    (events,) = [n for n in os.listdir(logdir) if n.startswith("events.out.tfevents")]
    logged = [
        e.step
        for e in summary_iterator(os.path.join(logdir, events))
        if e.HasField("session_log") and e.session_log.status == e.session_log.CHECKPOINT
    ]
    assert logged == saves[0]


def test_a_restart_resumes_both_ranks_at_the_same_step_with_the_saved_values(trained, tmp_path):
    logdir, first = trained
    shutil.copytree(logdir, tmp_path, dirs_exist_ok=True)
    saved = {_lines(out, "DONE")[0][3] for out, _, _ in first}
    assert len(saved) == 1  # Both ranks hold the same (full) model at the end.
    results = _run(tmp_path, STEPS + 6, "--save-secs", 60)
    _ok(results)
    for rank, (out, _, _) in enumerate(results):
        ready = _lines(out, "READY")[0]
        assert ready == ["READY", str(rank), str(STEPS), f"model.ckpt-{STEPS}", *saved]
        assert _lines(out, "DONE")[0][:3] == ["DONE", str(rank), str(STEPS + 6)]
    assert len({_lines(out, "DONE")[0][3] for out, _, _ in results}) == 1


def test_a_restart_with_one_process_reshards_and_resumes(trained, tmp_path):
    logdir, first = trained
    shutil.copytree(logdir, tmp_path, dirs_exist_ok=True)
    saved = _lines(first[0][0], "DONE")[0][3]
    ((out, err, code),) = _run(tmp_path, STEPS + 3, "--save-secs", 60, world_size=1)
    assert code == 0, err[-3000:]
    assert _lines(out, "READY")[0] == ["READY", "0", str(STEPS), f"model.ckpt-{STEPS}", saved]
    assert _lines(out, "SAVE") == [["SAVE", "0", str(STEPS + 3)]]
    assert CheckpointReader(latest_checkpoint(str(tmp_path))).manifest.world_size == 1


def test_a_corrupt_newest_checkpoint_makes_both_ranks_fall_back_together(trained, tmp_path):
    logdir, _ = trained
    shutil.copytree(logdir, tmp_path, dirs_exist_ok=True)
    *_, older, newest = _committed_steps(tmp_path)
    shard = tmp_path / f"model.ckpt-{newest}.data-00001-of-00002"  # Read by both ranks.
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10
    shard.write_bytes(bytes(data))
    results = _run(tmp_path, older, "--save-secs", 60)
    _ok(results)
    for rank, (out, err, _) in enumerate(results):
        ready = _lines(out, "READY")[0]
        assert ready[:4] == ["READY", str(rank), str(older), f"model.ckpt-{older}"]
        assert f"Checkpoint {tmp_path}/model.ckpt-{newest} is not usable" in err


def _wait_for_steps(procs):
    for proc in procs:
        while not (proc.stdout.readline() or "").startswith("STEP"):
            assert proc.poll() is None, proc.stderr.read()


def _stopped_together(logdir, results):
    _ok(results)
    stops = {tuple(_lines(out, "DONE")[0][2:]) for out, _, _ in results}
    assert len(stops) == 1  # Same step, same values.
    ((stop_step, _),) = stops
    finals = [[s for s in _lines(out, "SAVE") if s[2] == stop_step] for out, _, _ in results]
    assert finals == [[["SAVE", "0", stop_step]], [["SAVE", "1", stop_step]]]
    assert CheckpointReader(latest_checkpoint(str(logdir))).manifest.global_step == int(stop_step)
    assert _committed_steps(logdir)[-1] == int(stop_step)
    return int(stop_step)


def test_sigterm_on_one_rank_stops_both_with_one_final_sharded_checkpoint(tmp_path):
    port = free_port()
    procs = [
        _rank(tmp_path, r, port, 10**6, "--step-delay", 0.01, "--save-secs", 60) for r in (0, 1)
    ]
    _wait_for_steps(procs)
    procs[1].send_signal(signal.SIGTERM)
    start = time.monotonic()
    results = _outputs(procs)
    # Quickly: a rank left waiting would only give up after the 60 s stop agreement.
    assert time.monotonic() - start < 50
    assert "Received SIGTERM" in results[1][1]
    _stopped_together(tmp_path, results)


def test_end_of_input_on_one_rank_stops_both_with_one_final_sharded_checkpoint(tmp_path):
    results = _run(tmp_path, 10**6, "--save-secs", 60, "--end-input-at", 12)
    assert _stopped_together(tmp_path, results) > 12


def test_a_rank_failing_in_the_body_writes_no_final_checkpoint_and_nothing_hangs(tmp_path):
    start = time.monotonic()
    results = _run(tmp_path, 10**6, "--step-delay", 0.01, "--save-secs", 0.3, "--raise-at", 15)
    # Nothing hangs: a rank left in a vote would wait the agreement's 300 s.
    assert time.monotonic() - start < 150
    assert results[1][2] != 0 and "rank 1 fails at step 15" in results[1][1]
    assert not any(_lines(out, "DONE") and code for out, _, code in results)
    saved = [int(s[2]) for out, _, _ in results for s in _lines(out, "SAVE")]
    # Rank 1 raises in its 16th step: a checkpoint agreed at step 15 (both ranks at the
    # boundary before it) is legitimate; none may come after.
    assert all(step <= 15 for step in saved) and all(s <= 15 for s in _committed_steps(tmp_path))


def test_a_periodic_save_failing_on_one_rank_fails_on_both_and_training_goes_on(tmp_path):
    # The write runs on the writer threads (asynchronous): the failure of rank 1's shard
    # reaches rank 0's writer through their collective, and both report it.
    results = _run(tmp_path, STEPS, "--step-delay", 0.02, "--save-secs", 0.3, "--fail-first-save")
    _ok(results)
    failed = []
    for _, err, _ in results:
        lines = [x for x in err.splitlines() if "failed; training continues" in x]
        assert lines and "failed on rank 1: [Errno 28] No space left" in lines[0], err[-3000:]
        failed.append(int(lines[0].split("Checkpoint at step ")[1].split()[0]))
    assert failed[0] == failed[1]  # The same save, on both ranks.
    saves = [[int(line[2]) for line in _lines(out, "SAVE")] for out, _, _ in results]
    assert saves[0] == saves[1] and saves[0][-1] == STEPS and failed[0] not in saves[0]
    assert _committed_steps(tmp_path) == saves[0]  # Nothing of the failed one.
    assert not [n for n in os.listdir(tmp_path) if f"model.ckpt-{failed[0]}." in n]
