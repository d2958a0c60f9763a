"""benchmarks/chaos.py's accounting (the runs themselves take minutes: ``make bench``): the
failure schedule, a progress file torn by a kill, steps lost and goodput."""

from __future__ import annotations

import argparse

from repo_paths import load_benchmark

bench = load_benchmark("chaos")


def _args(**overrides) -> argparse.Namespace:
    values = {"minutes": 20.0, "kill_every": 120.0, "node_loss_every": 360.0}
    return argparse.Namespace(**{**values, **overrides})


def test_the_schedule_is_seeded_sorted_and_within_the_run():
    events = bench.schedule(_args(), seed=3)
    assert events == bench.schedule(_args(), seed=3) != bench.schedule(_args(), seed=4)
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
    run = bench.Run("memory", wall_secs=20.0, final_step=bench._highest_step(str(progress)))
    run.failures.append(bench.Failure("kill", at=111.5, reached=10))
    bench._account(run, events)
    (failure,) = run.failures
    assert (failure.resumed, failure.recovered_at) == (9, 115.0)
    row = bench.summarize(run, step_secs=1.0)
    assert row["lost_per_kill"] == [1] and row["lost_per_node_loss"] == []
    assert row["final_step"] == 11 and row["goodput"] == round(11 / 20, 3)
    assert row["recovery_secs_median"] == 3.5
    parts = {"launch": 1.5, "rendezvous": 0.5, "restore": 0.5, "first step": 1.0}
    assert row["recovery_parts_median"] == parts
