"""benchmarks/checkpoint.py's training measurement on a loaded machine (``--load``): its CPU
hogs run while it measures and are gone after, and it reports the ratio and its control (a
smoke test; timings are not checked)."""

from __future__ import annotations

import importlib.util
import sys

from repo_paths import repo


def _load_benchmark():
    # By path, under a name of its own: ``checkpoint`` may name another module in a test run.
    spec = importlib.util.spec_from_file_location(
        "bench_checkpoint", repo("benchmarks", "checkpoint.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_benchmark()


def test_the_hogs_run_inside_and_are_killed_after():
    with bench.cpu_load(2) as hogs:
        assert len(hogs) == 2 and all(h.poll() is None for h in hogs)
    assert all(h.returncode is not None for h in hogs)


def test_the_loaded_measurement_saves_in_its_busy_rounds_and_reports_a_control(tmp_path):
    state = bench.build_state(2 * bench.MB)
    result = bench.measure_training_loaded(state, str(tmp_path), rounds=2, load=1)
    assert result["load_processes"] == 1
    assert result["saves"] >= 2  # At least one save in each busy round.
    assert result["paired_ratio"] > 0 and result["control_paired_ratio"] > 0
    assert len(result["paired_ratios"]) == 2
