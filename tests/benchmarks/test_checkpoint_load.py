"""benchmarks/checkpoint.py: the training measurement on a loaded machine (``--load``), whose
CPU hogs run while it measures and are gone after, and the case of many small tensors
(``--blocks-sizes``); smoke tests, timings are not checked."""

from __future__ import annotations

from repo_paths import load_benchmark

bench = load_benchmark("checkpoint")


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


def test_the_many_tensor_case_compares_the_stall_and_training_speed(tmp_path, capsys):
    state = bench.build_blocks_state(bench.MB)
    assert len(bench.state_tensors(state)) == 16 * len(state["model"])  # 4 tensors, 3 moments.
    row = bench.run_blocks(bench.MB, str(tmp_path), repeat=1, rounds=2)
    ratios = bench.blocks_ratios(row)
    assert row["tensors"] == 16 * len(state["model"])
    assert all(ratios[k] > 0 for k in ("stall_vs_memcpy", "stall_vs_dcp", "steps_per_sec_ratio"))
    assert row["training"]["saves"] >= 2
    bench.print_blocks_table([row])
    assert "Many small tensors" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # Its directory is removed.
