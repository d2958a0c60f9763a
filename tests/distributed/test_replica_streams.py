"""Every rank's random streams gathered to the chief (``ReplicaStreams``), in a real gloo
group of two processes (``workers/replica_streams_worker.py``)."""

from __future__ import annotations

from rank_processes import run_ranks
from repo_paths import worker


def _lines(out: str, tag: str) -> list[list[str]]:
    return [line.split()[1:] for line in out.splitlines() if line.startswith(tag + " ")]


def test_the_chief_holds_each_ranks_streams_of_the_step_gathered_once_a_step():
    (chief_out, chief_err, chief_rc), (out, err, rc) = run_ranks(
        worker("replica_streams_worker.py"), "gather", timeout=120
    )
    assert chief_rc == 0 and rc == 0, chief_err[-3000:] + err[-3000:]
    own = _lines(out, "OWN")
    held = _lines(chief_out, "HELD")
    assert len(own) == 3
    # Rank 1's torch state at each step boundary, as the chief holds it: rank 1's own.
    assert held == [[n, digest, "1"] for n, digest in own]
    assert len({digest for _, digest in own}) == 3  # It moved between the steps.
    assert _lines(chief_out, "NONE") == [["4", "True"]]


def test_a_dead_rank_makes_the_chiefs_gather_fail_at_once():
    (chief_out, chief_err, chief_rc), _ = run_ranks(
        worker("replica_streams_worker.py"), "dead", timeout=120
    )
    assert chief_rc == 0, chief_err[-3000:]
    [[kind, seconds]] = _lines(chief_out, "RAISED")
    # gloo sees the connections of the dead rank close: not its timeout (30 minutes).
    assert kind == "RuntimeError" and float(seconds) < 30, chief_out
