"""benchmarks/goodput.py runs end to end, small: two processes, one stop between them; the
ledger's steps lost match the truth's (``make bench`` runs the full one)."""

from __future__ import annotations


def test_a_small_scripted_run(run_benchmark):
    out, report = run_benchmark("goodput", "--processes", "2", "--steps", "60", "--seed", "5")
    assert "steps lost per kill" in out and report["exact"], out
    assert {r["cause"] for r in report["rows"]} >= {"checkpoint", "data", "lost", "down"}
    assert report["ledger_wall"] > 0 and 0 < report["goodput"] < 1
