"""MonitoredTrainingSession with a sharded (FSDP2) state on 2 CPU processes (gloo): every rank
restores its shards of the same checkpoint, saves them with the other rank at the same steps
(``ShardedSessionCreator``, ``ShardedCheckpointSaverHook``), stops with it, and a run stopped
by a signal to one rank resumes bitwise."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest
from rank_processes import run_ranks, start_ranks
from repo_paths import worker

from torchsupervisor import latest_checkpoint
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.summary.reader import summary_iterator
from torchsupervisor.tiers.memory_root import memory_root

WORKER = worker("monitored_fsdp_worker.py")


def _lines(out: str, kind: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.startswith(kind + " ")]


def _ok(results) -> None:
    assert all(code == 0 for _, _, code in results), [err[-3000:] for _, err, _ in results]


def _saved(out: str) -> list[int]:
    return sorted(int(line[2]) for line in _lines(out, "SAVE"))


def _committed(logdir) -> list[int]:
    return sorted(
        int(n[len("model.ckpt-") : -len(".index")])
        for n in os.listdir(logdir)
        if n.startswith("model.ckpt-") and n.endswith(".index")
    )


def _checkpoint_events(logdir) -> list[int]:
    files = [n for n in os.listdir(logdir) if n.startswith("events.out.tfevents")]
    assert len(files) == 1, files  # The chief's alone: no other rank writes events.
    steps = []
    for event in summary_iterator(os.path.join(logdir, files[0])):
        if event.HasField("session_log") and event.session_log.status == 3:  # CHECKPOINT
            steps.append(event.step)
    return steps


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    """The digest both ranks end with after 30 steps without a stop (one run per module)."""
    results = run_ranks(WORKER, tmp_path_factory.mktemp("uninterrupted") / "run", "=30")
    _ok(results)
    digests = {_lines(out, "DONE")[0][3] for out, _, _ in results}
    assert len(digests) == 1
    return digests.pop()


def test_every_rank_restores_and_saves_its_shards_at_the_same_steps(tmp_path):
    logdir = tmp_path / "run"
    first = run_ranks(WORKER, logdir, "=10", "--save-steps", 4)
    _ok(first)
    # Each rank committed its part of the session's checkpoint (step 0), those of every
    # 4 steps, and the final one.
    assert [_saved(out) for out, _, _ in first] == [[0, 4, 8, 10]] * 2
    assert _committed(logdir) == [0, 4, 8, 10]
    assert _checkpoint_events(logdir) == [0, 4, 8, 10]
    reader = CheckpointReader(latest_checkpoint(str(logdir)))
    assert reader.get_tensor("global_step") == 10
    done = [_lines(out, "DONE")[0] for out, _, _ in first]
    assert [d[2] for d in done] == ["10", "10"]

    again = run_ranks(WORKER, logdir, "=14", "--save-steps", 4)
    _ok(again)
    ready = [_lines(out, "READY")[0] for out, _, _ in again]
    # Both resumed from the final checkpoint, with the state the first run ended with (the
    # session's own checkpoint of step 10 is not written again).
    assert [r[2:4] for r in ready] == [["10", "model.ckpt-10"]] * 2
    assert [r[5] for r in ready] == ["disk"] * 2
    assert {r[4] for r in ready} == {done[0][3]}
    assert [_saved(out) for out, _, _ in again] == [[14]] * 2


def test_a_signal_to_one_rank_stops_both_with_a_final_checkpoint_that_resumes_bitwise(
    tmp_path, uninterrupted
):
    logdir = tmp_path / "run"
    procs = start_ranks(WORKER, logdir, "=30", "--save-secs", 0.3, "--step-delay", 0.05)
    deadline = time.monotonic() + 120
    assert procs[1].stdout is not None
    seen = []  # What rank 1 printed up to the signal.
    for line in procs[1].stdout:  # Rank 1 reports each step; SIGTERM it at step 8.
        assert time.monotonic() < deadline
        seen.append(line)
        if line.startswith("STEP 1 8"):
            procs[1].send_signal(signal.SIGTERM)
            break
    results = [(*p.communicate(timeout=120), p.returncode) for p in procs]
    results[1] = ("".join(seen) + results[1][0], *results[1][1:])
    _ok(results)
    done = [_lines(out, "DONE")[0] for out, _, _ in results]
    stopped = int(done[0][2])
    assert done[1][2] == str(stopped) and 8 <= stopped < 30  # Both at the agreed step.
    saved = [_saved(out) for out, _, _ in results]
    assert saved[0] == saved[1] and saved[0][-1] == stopped  # The final checkpoint, together.
    assert len(saved[0]) >= 3  # The session's, periodic ones at agreed steps, the final.
    assert _committed(logdir) == saved[0]

    resumed = run_ranks(WORKER, logdir, "=30")
    _ok(resumed)
    assert [_lines(out, "READY")[0][2] for out, _, _ in resumed] == [str(stopped)] * 2
    # Every tensor and every rank's random stream continued: the run ends as the run
    # without the stop did.
    assert {_lines(out, "DONE")[0][3] for out, _, _ in resumed} == {uninterrupted}


def test_a_rank_that_fails_makes_the_other_stop_at_once_without_a_final_checkpoint(tmp_path):
    logdir = tmp_path / "run"
    started = time.monotonic()
    results = run_ranks(WORKER, logdir, "=40", "--save-steps", 4, "--raise-at", 6)
    assert results[1][2] != 0 and "rank 1 fails at step 6" in results[1][1]
    # Rank 0 stopped with it: no wait for a vote that would never come (a vote waits up to
    # 300 s), and no final checkpoint without rank 1's shards.
    assert time.monotonic() - started < 60
    assert _committed(logdir) == [0, 4]
    assert _saved(results[0][0]) == [0, 4]


def test_a_killed_rank_resumes_with_the_other_from_their_memory_tiers_bitwise(
    tmp_path, uninterrupted
):
    logdir, memory = tmp_path / "run", tmp_path / "shm"
    memory.mkdir()
    options = ("--save-secs", 3600, "--memory-root", memory)
    killed = run_ranks(WORKER, logdir, "=30", *options, "--kill-at", 12)
    assert killed[1][2] == -signal.SIGKILL and killed[0][2] != 0  # Rank 0 lost its peer.
    assert _committed(logdir) == [0]  # The disk holds the session's checkpoint alone.

    resumed = run_ranks(WORKER, logdir, "=30", *options)
    _ok(resumed)
    ready = [_lines(out, "READY")[0] for out, _, _ in resumed]
    # Both ranks resumed from their memory at one step they both hold: at most the step the
    # kill interrupted is lost.
    assert {r[5] for r in ready} == {"memory"} and len({r[2] for r in ready}) == 1
    assert int(ready[0][2]) in (11, 12)
    # Every tensor and every rank's random stream continued from its own snapshot.
    assert {_lines(out, "DONE")[0][3] for out, _, _ in resumed} == {uninterrupted}
    # The final checkpoint holds the last step: every rank freed its memory tier.
    assert _committed(logdir)[-1] == 30
    assert not glob.glob(os.path.join(memory_root(str(memory)), "*", "*", "*.index"))
