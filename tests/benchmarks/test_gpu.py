"""benchmarks/gpu.py: the GPU benchmark's code, run on the CPU (a smoke test; timings are not
checked), and its refusal without a CUDA device."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from repo_paths import repo


def test_the_gpu_benchmark_runs_its_code_on_the_cpu(run_benchmark):
    stdout, report = run_benchmark(
        "gpu", "--device", "cpu", "--sizes", "1MB", "--repeat", 2, "--rounds", 1
    )
    (row,) = report["rows"]
    assert row["device"] == "cpu" and row["size_bytes"] > 0 and row["memcpy_secs"] > 0
    for name in ("ours", "dcp"):
        figures = row[name]
        assert 0 < figures["stall_secs"] <= figures["total_secs"]
        assert figures["stall_vs_memcpy"] > 0
        (round_,) = figures["rounds"]
        assert round_["idle"] > 0 and round_["busy"] > 0
        assert figures["steps_ratio"]["n"] == 1 and figures["steps_ratio"]["median"] > 0
    assert row["stall_vs_dcp"] > 0
    assert "steps/s ratio" in stdout and "\nours " in stdout and "\ndcp " in stdout
    assert report["machine"]["device_name"] == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_it_says_how_to_run_on_the_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, repo("benchmarks", "gpu.py"), "--json", str(tmp_path / "gpu.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--device cpu" in proc.stdout
    assert not (tmp_path / "gpu.json").exists()
