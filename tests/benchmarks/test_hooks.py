"""benchmarks/hooks.py runs and writes its report (a smoke test; timings are not checked)."""

from __future__ import annotations

import json
import subprocess
import sys

from repo_paths import repo

SCRIPT = repo("benchmarks", "hooks.py")


def test_the_hook_benchmark_writes_its_report(tmp_path):
    out = tmp_path / "hooks.json"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--steps", "300", "--repeat", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "MonitoredTrainingSession, 4 hooks" in proc.stdout
    assert "Supervisor, standard services" in proc.stdout
    report = json.loads(out.read_text())
    assert report["steps"] == 300 and report["target_us"] == 20.0
    assert report["supervisor_target_us"] == 3.0 and report["supervisor_overhead_us"] > 0
    assert report["rows"][0]["case"] == "bare loop"
    assert all(row["median_us"] > 0 for row in report["rows"])
