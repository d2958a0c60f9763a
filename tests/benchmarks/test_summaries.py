"""benchmarks/summaries.py runs and writes its report (a smoke test; timings are not checked)."""

from __future__ import annotations


def test_the_summary_benchmark_writes_its_report(run_benchmark, tmp_path):
    stdout, report = run_benchmark(
        "summaries",
        *("--scalars", 2000, "--objects", 4, "--steps", 20, "--work-size", 16, "--repeat", 1),
        *("--dir", tmp_path / "runs"),
    )
    assert "torch.utils.tensorboard" in stdout
    writers = {"ours (defaults)", "ours (max_queue=10, TF)", "torch.utils.tensorboard"}
    for section in ("scalars_tight", "scalars_tensor_values", "histograms", "images"):
        assert set(report[section]) >= writers | {"tensorboardX"}, section
    assert report["targets"]["default_max_queue"] == 16384  # SummaryWriter(logdir)'s queue.
    verdict = report["verdict"]
    assert verdict["caller_us"] > 0 and verdict["written_per_sec"] > 0
    assert set(verdict["met"]) == {"caller_us", "written_per_sec", "vs_torch"}
