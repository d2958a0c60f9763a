"""benchmarks/object_store.py runs and writes its report (a smoke test; timings are not checked)."""

from __future__ import annotations

import pytest


# In make test-slow (17 s: the suite keeps the smoke tests of the benchmarks of the memory
# tier, the goodput, the summaries, the hooks and the resharding).
@pytest.mark.slow
def test_the_object_store_benchmark_writes_its_report(run_benchmark):
    stdout, report = run_benchmark("object_store", "--sizes", "2MB", "--repeat", 1, "--rounds", 1)
    assert "Targets (issue 15)" in stdout
    (row,) = report["rows"]
    assert row["bytes"] == row["state_bytes"] > 1_000_000
    assert set(row["ratios"]) == {"persist_vs_upload", "restore_vs_download", "steps_per_sec_ratio"}
    assert all(v > 0 for v in row["ratios"].values())
