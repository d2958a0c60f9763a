"""benchmarks/hf_export.py runs and writes its report (a smoke test; timings are not checked):
the three variants, and the streaming export's peak memory far under the consolidated one's."""

from __future__ import annotations

import pytest


# In make test-slow (12 s: the suite keeps the smoke tests of the benchmarks of the memory
# tier, the goodput, the summaries, the hooks and the resharding).
@pytest.mark.slow
def test_the_hf_export_benchmark_writes_its_report(run_benchmark):
    stdout, report = run_benchmark("hf_export", "--mb", 40, "--shard-mb", 10, "--rounds", 1)
    assert "ours vs raw throughput" in stdout
    variants = report["variants"]
    assert set(variants) == {"ours", "consolidated", "raw"}
    assert all(v["secs"] > 0 and v["fresh_process_secs"] > 0 for v in variants.values())
    assert len(report["throughput_vs_raw_per_round"]) == 1  # The warm-up round not counted.
    # 40 MB held whole by the consolidated save; ours streams through 3 x 16 MiB buffers.
    assert variants["consolidated"]["peak_above_base_mb"] > 30
    assert variants["ours"]["peak_above_base_mb"] < report["peak_bound_mb"]
