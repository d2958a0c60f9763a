"""benchmarks/summaries.py runs and writes its report (a smoke test; timings are not checked)."""

from __future__ import annotations

import json
import subprocess
import sys

from repo_paths import repo

SCRIPT = repo("benchmarks", "summaries.py")


def test_the_summary_benchmark_writes_its_report(tmp_path):
    out = tmp_path / "summaries.json"
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--scalars",
            "2000",
            "--objects",
            "4",
            "--steps",
            "20",
            "--work-size",
            "16",
            "--repeat",
            "1",
            "--dir",
            str(tmp_path / "runs"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "torch.utils.tensorboard" in proc.stdout
    report = json.loads(out.read_text())
    writers = {"ours (defaults)", "ours (max_queue=10, TF)", "torch.utils.tensorboard"}
    for section in ("scalars_tight", "scalars_tensor_values", "histograms", "images"):
        assert set(report[section]) >= writers | {"tensorboardX"}, section
    assert report["targets"]["default_max_queue"] == 16384  # SummaryWriter(logdir)'s queue.
    verdict = report["verdict"]
    assert verdict["caller_us"] > 0 and verdict["written_per_sec"] > 0
    assert set(verdict["met"]) == {"caller_us", "written_per_sec", "vs_torch"}
