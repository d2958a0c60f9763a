"""benchmarks/save_cache.py runs and writes its report (a smoke test; timings are not checked):
each variant turns its memo off and the saves still replay their plan."""

from __future__ import annotations

import pytest


# In make test-slow (12 s: the suite keeps the smoke tests of the benchmarks of the memory
# tier, the goodput, the summaries, the hooks and the resharding).
@pytest.mark.slow
def test_the_save_cache_benchmark_writes_its_report(run_benchmark):
    stdout, report = run_benchmark(
        "save_cache", "--variants", "on,no_shard", "--rounds", 1, "--saves", 1
    )
    assert "1008 tensors by 2 ranks" in stdout
    rows = {row["variant"]: row for row in report["rows"]}
    assert set(rows) == {"on", "no_shard"}
    assert rows["on"]["stall_spared_ms"] == 0.0
    assert all(row["replayed"] == 3 for row in rows.values())  # All but the first save.
    assert all(len(row["writer_cpu_ms"]) == 2 for row in rows.values())
