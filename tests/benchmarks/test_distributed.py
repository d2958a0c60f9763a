"""benchmarks/distributed.py runs and writes its report (a smoke test; timings are not checked),
and the interval it gives for a median."""

from __future__ import annotations

import random

import pytest
from repo_paths import load_benchmark

bench = load_benchmark("distributed")


@pytest.mark.parametrize(
    ("n", "low", "high"),
    # The sign test's order statistics (1-based) for a 95% interval: tables give 1-6 for
    # n = 6, 6-15 for n = 20 and 10-21 for n = 30.
    [(6, 1, 6), (20, 6, 15), (30, 10, 21)],
)
def test_the_median_interval_is_the_sign_tests_order_statistics(n, low, high):
    values = [float(v) for v in range(1, n + 1)]
    random.Random(n).shuffle(values)
    got = bench.median_interval(values)
    assert (got["low"], got["high"], got["n"]) == (low, high, n)
    assert got["median"] == (n + 1) / 2


def test_too_few_values_give_no_interval():
    assert bench.median_interval([1.0, 2.0, 3.0, 4.0, 5.0])["low"] is None
    assert bench.median_interval([])["median"] is None


@pytest.mark.slow  # A minute of process groups; make test-slow.
def test_the_distributed_benchmark_writes_its_report(run_benchmark):
    stdout, report = run_benchmark(
        "distributed", "--sizes", "1MB", "--blocks-sizes", "1MB", "--repeat", 1, "--rounds", 1
    )
    assert "sharded, 2 ranks" in stdout and "ddp chief-only, 2 ranks" in stdout
    rows = {row["case"]: row for row in report["rows"]}
    assert set(rows) == {
        "sharded, 1 rank",
        "sharded, 2 ranks",
        "dcp.save, 1 rank",
        "dcp.save, 2 ranks",
        "restore 2 -> 1 rank",
        "restore 1 -> 2 ranks",
        "ddp chief-only, 2 ranks",
        "async sharded, 2 ranks",
        "async sharded, 2 ranks, blocks",
    }
    two = rows["sharded, 2 ranks"]
    assert len(two["per_rank_bytes"]) == 2 and all(b > 0 for b in two["per_rank_bytes"])
    assert all(rate > 0 for rate in two["per_rank_mb_per_sec"])
    # The plain DCP baseline of the same state, and our stall relative to it.
    dcp = rows["dcp.save, 2 ranks"]
    assert all(b > 0 for b in dcp["per_rank_bytes"]) and all(
        s > 0 for s in dcp["per_rank_stall_secs"]
    )
    assert rows["sharded, 1 rank"]["stall_vs_dcp"] > 0 and two["stall_vs_dcp"] > 0
    assert "x dcp" in stdout and "dcp.save, 2 ranks" in stdout
    assert rows["restore 2 -> 1 rank"]["restore_secs"] > 0
    assert rows["ddp chief-only, 2 ranks"]["per_rank_bytes"][0] > 0
    # Asynchronous saves, ours, dcp.async_save's and the floor's (a copy and a raw write),
    # with steps/s while each persists.
    async_row = rows["async sharded, 2 ranks"]
    for name in ("ours", "dcp", "floor"):
        figures = async_row[name]
        assert 0 < figures["stall_secs"] <= figures["total_secs"]
        assert figures["steps_per_sec_idle"] > 0 and figures["steps_per_sec_persisting"] > 0
        assert figures["stall_vs_memcpy"] > 0 and figures["stall_vs_memcpy_alone"] > 0
    assert async_row["memcpy_secs"] > 0 and async_row["memcpy_alone_secs"] > 0
    assert async_row["stall_vs_dcp"] > 0 and "async, 2 ranks" in stdout and "x alone" in stdout
    # The floor wrote every byte of each rank's local shards (half the state each).
    assert async_row["floor_bytes"] == async_row["local_bytes"]
    assert all(b > 0 for b in async_row["local_bytes"]) and len(async_row["local_bytes"]) == 2
    assert async_row["steps_ratio_vs_floor"] > 0 and "x floor" in stdout and "\nfloor " in stdout
    assert async_row["paired_vs_floor"]["n"] == 1 and async_row["paired_vs_floor"]["median"] > 0
    assert all(async_row[name]["mean_wait_secs"] >= 0 for name in ("ours", "dcp", "floor"))
    # The same on a state of many small tensors (LayerNorm + Linear blocks; 16 a block).
    blocks = rows["async sharded, 2 ranks, blocks"]
    assert blocks["model"] == "blocks" and blocks["tensors"] > 0 and blocks["tensors"] % 16 == 0
    assert blocks["tensors"] > async_row["tensors"]
    assert blocks["ours"]["stall_secs"] > 0 and blocks["stall_vs_dcp"] > 0
    assert "ours, blocks" in stdout
