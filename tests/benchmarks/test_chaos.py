"""benchmarks/chaos.py's accounting (the runs themselves take minutes: ``make bench``): the
failure schedule, a progress file torn by a kill, steps lost and goodput."""

from __future__ import annotations

import argparse

from repo_paths import load_benchmark

bench = load_benchmark("chaos")


def _args(**overrides) -> argparse.Namespace:
    values = {"minutes": 80.0, "rounds": 4, "kill_every": 120.0, "node_loss_every": 360.0}
    return argparse.Namespace(**{**values, **overrides})


def test_the_schedule_is_seeded_sorted_and_within_the_run():
    events = bench.schedule(_args(), seed=3)
    assert events == bench.schedule(_args(), seed=3) != bench.schedule(_args(), seed=4)
    # A segment: 80 minutes in 4 rounds.
    assert events == sorted(events) and all(0 < t < 20 * 60 for t, _ in events)
    kinds = [kind for _, kind in events]
    # About 10 kills and 3 node losses in 20 minutes at these means (loose bounds).
    assert 3 <= kinds.count("kill") <= 25 and 1 <= kinds.count("node") <= 10


def test_steps_lost_recovery_and_goodput_from_the_progress_file(tmp_path):
    progress = tmp_path / "progress.log"
    progress.write_text(
        "start 100.0\nresume 0 101.0\n"
        + "".join(f"step {s} {101.0 + s}\n" for s in range(1, 11))  # Steps 1-10 by t=111.
        + "step 11 11"  # Torn by the kill: the next process starts a line of its own.
        + "\nstart 113.0\nconnected 113.5\nresume 9 114.0\nstep 10 115.0\nstep 11 116.0\nstep 12 1"
    )
    events = bench._read_progress(str(progress))
    assert ("step", 11, 116.0) in events and ("step", 11, 11.0) not in events
    assert ("step", 12, 1.0) not in events  # The last line, unfinished: not trusted either.
    final = bench._held_step(str(progress))
    run = bench.Run("memory", wall_secs=20.0, final_step=final, clean_step_secs=1.0)
    run.failures.append(bench.Failure("kill", at=111.5, reached=10))
    bench._account(run, events)
    (failure,) = run.failures
    assert (failure.resumed, failure.recovered_at) == (9, 115.0)
    # A second segment, at half the clean step time, whose failure lost nothing (its last
    # step completed after the progress file's last line: counted as 0, not -1).
    other = bench.Run("memory", wall_secs=30.0, final_step=40, clean_step_secs=0.5)
    other.failures.append(bench.Failure("node", at=5.0, reached=7, resumed=8))
    row = bench.summarize([run, other])
    assert row["lost_per_kill"] == [1] and row["lost_per_node_loss"] == [0]
    assert row["steps_held"] == [11, 40] and row["wall_secs"] == 50.0
    assert row["goodput"] == round((11 * 1.0 + 40 * 0.5) / 50, 3)
    assert row["recovery_secs_median"] == 3.5
    parts = {"launch": 1.5, "rendezvous": 0.5, "restore": 0.5, "first step": 1.0}
    assert row["recovery_parts_median"] == parts


def test_the_state_copied_is_the_model_and_adams_moments():
    state_bytes, secs = bench.state_memcpy(_args(hidden=64, layers=2))
    parameters = 2 * (64 * 64 + 64) + (64 + 1)
    assert state_bytes == 3 * parameters * 4  # float32: the weights, exp_avg, exp_avg_sq.
    assert 0 < secs < 10


def test_a_failure_loses_only_what_the_job_completed_since_its_last_resume(tmp_path):
    """A node loss sends the job back from step 72 to 61; a kill right after its step 62
    loses 1 step, not 11 again."""
    progress = tmp_path / "progress.log"
    steps = "".join(f"step {s} {100.0 + s}\n" for s in range(1, 73))
    progress.write_text(f"start 99.0\nresume 0 99.5\n{steps}start 180.0\nresume 61 181.0\n")
    assert bench._held_step(str(progress)) == 61  # Resumed, nothing completed yet.
    with progress.open("a") as f:
        f.write("step 62 182.0\n")
    assert bench._held_step(str(progress)) == 62
    with progress.open("a") as f:
        f.write("start 190.0\nresume 61 191.0\nstep 62 192.0\nstep 63 193.0\n")
    run = bench.Run("memory", wall_secs=100.0, final_step=bench._held_step(str(progress)))
    run.failures.append(bench.Failure("kill", at=185.0, reached=62))
    bench._account(run, bench._read_progress(str(progress)))
    assert run.final_step == 63 and bench.summarize([run])["lost_per_kill"] == [1]
