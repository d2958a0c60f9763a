"""benchmarks/object_store.py runs and writes its report (a smoke test; timings are not checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from repo_paths import repo

SCRIPT = repo("benchmarks", "object_store.py")


def test_the_object_store_benchmark_writes_its_report(tmp_path):
    out = tmp_path / "object_store.json"
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--sizes",
            "2MB",
            "--repeat",
            "1",
            "--rounds",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Targets (issue 15)" in proc.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["bytes"] == row["state_bytes"] > 1_000_000
    assert set(row["ratios"]) == {"persist_vs_upload", "restore_vs_download", "steps_per_sec_ratio"}
    assert all(v > 0 for v in row["ratios"].values())
