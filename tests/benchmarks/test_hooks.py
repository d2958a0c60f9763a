"""benchmarks/hooks.py runs and writes its report (a smoke test; timings are not checked)."""

from __future__ import annotations


def test_the_hook_benchmark_writes_its_report(run_benchmark):
    stdout, report = run_benchmark("hooks", "--steps", 300, "--repeat", 1)
    assert "MonitoredTrainingSession, 4 hooks" in stdout
    assert "Supervisor, standard services" in stdout
    assert report["steps"] == 300 and report["target_us"] == 20.0
    assert report["supervisor_target_us"] == 3.0 and report["supervisor_overhead_us"] > 0
    assert report["rows"][0]["case"] == "bare loop"
    assert all(row["median_us"] > 0 for row in report["rows"])
