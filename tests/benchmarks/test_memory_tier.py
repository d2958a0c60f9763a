"""benchmarks/memory_tier.py runs and writes its report (a smoke test; timings are not
checked): the stall, the training ratio and the restores (from the tier, by torch.load, from a
peer's copy against the loopback's bandwidth) are measured, and the local-disk tier's copies."""

from __future__ import annotations

import os


def test_the_memory_tier_benchmark_writes_its_report(run_benchmark, tmp_path):
    stdout, report = run_benchmark(
        "memory_tier",
        *("--sizes", "2MB", "--steps", 2, "--rounds", 1, "--step-factor", 2),
        *("--memory-root", tmp_path, "--local-dir", tmp_path / "local"),
    )
    assert "stall/memcpy" in stdout
    (row,) = report["rows"]
    assert row["bytes"] > 1_000_000
    assert row["stall_secs"] > 0 and row["memcpy_secs"] > 0 and row["training_ratio"] > 0
    assert row["restore"]["restore_secs"] > 0 and row["torch_load"]["restore_secs"] > 0
    peer = row["peer_restore"]
    assert 0 < peer["fetch_secs"] < peer["restore_secs"] and peer["loopback_bytes_per_sec"] > 0
    assert peer["target_secs"] == 1.5 * row["bytes"] / peer["loopback_bytes_per_sec"]
    assert "from a peer" in stdout
    local = row["local"]
    assert local["training_ratio"] > 0 and local["copy_secs"] > 0 and local["raw_write_secs"] > 0
    assert local["cold_restore"]["restore_secs"] > 0 and "Local-disk tier" in stdout
    # The tier was freed, torch.save's file and the peer's copies removed.
    assert os.listdir(tmp_path / f"torchsupervisor-{os.getuid()}") == []
    left = set(os.listdir(tmp_path)) - {"memory_tier.json"}  # The report (run_benchmark's).
    assert left == {f"torchsupervisor-{os.getuid()}", "local"}
    assert os.listdir(tmp_path / "local" / f"torchsupervisor-{os.getuid()}") == []
