"""benchmarks/reshard.py runs and writes its report (a smoke test; the figures are not
checked): ours and dcp.load restore a 2-rank FSDP2 checkpoint, and a DDP one, into an FSDP2
model at another world size, each rank's bytes read and held measured."""

from __future__ import annotations


def test_the_reshard_benchmark_writes_its_report(run_benchmark):
    stdout, report = run_benchmark(
        "reshard", *("--layers", 2, "--width", 64, "--world-sizes", "3", "--sources", "fsdp2,ddp")
    )
    assert "read/held" in stdout
    assert [(r["source"], r["world_size"]) for r in report["rows"]] == [("fsdp2", 3), ("ddp", 3)]
    for row in report["rows"]:
        for which in ("ours", "dcp"):
            ranks = row[which]["ranks"]
            assert len(ranks) == 3
            assert all(r["read_bytes"] > 0 and r["held_bytes"] > 0 for r in ranks)
            assert row[which]["max_read_over_held"] > 0 and row[which]["secs"] > 0
