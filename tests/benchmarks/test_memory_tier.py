"""benchmarks/memory_tier.py runs and writes its report (a smoke test; timings are not
checked): the stall, the training ratio and both restores are measured."""

from __future__ import annotations

import os


def test_the_memory_tier_benchmark_writes_its_report(run_benchmark, tmp_path):
    stdout, report = run_benchmark(
        "memory_tier",
        *("--sizes", "2MB", "--steps", 2, "--rounds", 1, "--step-factor", 2),
        *("--memory-root", tmp_path),
    )
    assert "stall/memcpy" in stdout
    (row,) = report["rows"]
    assert row["bytes"] > 1_000_000
    assert row["stall_secs"] > 0 and row["memcpy_secs"] > 0 and row["training_ratio"] > 0
    assert row["restore"]["restore_secs"] > 0 and row["torch_load"]["restore_secs"] > 0
    # The tier was freed, and torch.save's file removed.
    assert os.listdir(tmp_path / f"torchsupervisor-{os.getuid()}") == []
    assert not list(tmp_path.glob("*.pt"))
