"""Goodput and badput of a run, from its ledger (``ledger.py``): pure, over plain records.

One rank's processes, in the order they started, make the run's timeline. For each process:

* **import**: from its creation (``launched``) to the end of ``import torchsupervisor``;
* **init** / **restore**: preparing the session (a fresh start, or a restore: waiting for
  the chief, reading and checking the checkpoint); **startup**: from the import to that (the
  user's code building the model);
* **rendezvous**: forming the process group (``distributed.connect``: by the Supervisor from
  its master string, or by the program before it), taken out of the cause it fell in;
* **checkpoint**: the training thread at step boundaries (snapshots), **data** and any cause
  a user marked (``eval``, ...): counted as they happened;
* **preemption** / **final**: from the stop to the session's end (the final checkpoint);
* **lost**: the steps this process computed that the next one did not restore (the highest
  step it reached, exact from its heartbeat, less the step the next resumed at), at this
  process's mean step time;
* **down**: from the process's last sign of life to the next one's creation (a relaunch, a
  scheduler's queue; a killed process's end is when its heartbeat last said it was alive,
  within a quarter of a second, or where there is none, its last record plus the steps it
  reached after it at its mean step time).

The rest of a process's life is **productive**: the time of the steps that were kept.
Goodput is productive time over the wall time of the whole run (the first process's creation
to the last one's last sign of life: a process's teardown after its session ended is not in
the ledger, and counts as ``down`` before the next one); each cause's badput is its time
over the same.

TF name: none.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torchsupervisor.summary.ledger import LedgerFile

__all__ = ["CAUSES", "GoodputReport", "Incarnation", "goodput_report"]

CAUSES = (
    "import",
    "startup",
    "rendezvous",
    "init",
    "restore",
    "checkpoint",
    "data",
    "preemption",
    "final",
    "lost",
    "down",
)
"""The badput causes always reported (marked ones follow, in name order)."""


@dataclass
class Incarnation:
    """One process of one rank, as the ledger tells it (seconds are wall time)."""

    path: str
    launched: float
    end: float  # The last sign of life.
    clean: bool  # It wrote an end record.
    reason: str | None
    resumed_at: int | None  # The step its session was ready at.
    reached: int | None  # The highest step it reached.
    lost_steps: int = 0
    causes: dict[str, float] = field(default_factory=dict)
    productive: float = 0.0
    attempt: int = 0
    job: str | None = None
    last_recorded_step: int | None = None  # The step of its last progress or end record.
    alive_known: bool = False  # ``end`` is the heartbeat's last time alive.


@dataclass
class GoodputReport:
    """A rank's goodput over the whole run and per process.

    Attributes:
        rank: The rank.
        wall: Seconds from the first process's creation to the last one's last sign of life.
        productive: Seconds of steps that were kept.
        causes: Badput seconds by cause.
        incarnations: Each process, in order.
        run_id: The run's id (from the first start record that has one).
    """

    rank: int
    wall: float
    productive: float
    causes: dict[str, float]
    incarnations: list[Incarnation]
    run_id: str | None = None

    @property
    def goodput(self) -> float:
        """Productive time over wall time (0 for an empty run)."""
        return self.productive / self.wall if self.wall > 0 else 0.0

    def badput(self, cause: str) -> float:
        """A cause's share of the wall time."""
        return self.causes.get(cause, 0.0) / self.wall if self.wall > 0 else 0.0

    @property
    def steps_lost(self) -> int:
        return sum(i.lost_steps for i in self.incarnations)

    def table(self) -> str:
        """A text table: the whole run, then one line per process."""
        causes = list(self.causes)
        lines = [
            f"run {self.run_id or '?'}, rank {self.rank}: {len(self.incarnations)} process(es), "
            f"{self.wall:.1f} s wall, goodput {self.goodput:.1%}, "
            f"{self.steps_lost} step(s) lost",
            "",
            f"{'cause':<12} {'seconds':>10} {'share':>7}",
            f"{'productive':<12} {self.productive:>10.1f} {self.goodput:>7.1%}",
        ]
        lines += [
            f"{c:<12} {self.causes[c]:>10.1f} {self.badput(c):>7.1%}"
            for c in causes
            if self.causes[c] > 0
        ]
        lines += ["", "process  attempt  steps          lost  wall s  goodput  ended"]
        for n, inc in enumerate(self.incarnations):
            span = inc.end - inc.launched
            share = inc.productive / span if span > 0 else 0.0
            steps = f"{inc.resumed_at}->{inc.reached}"
            lines.append(
                f"{n:<8} {inc.attempt:<8} {steps:<14} {inc.lost_steps:<5} {span:>6.1f}  "
                f"{share:>7.1%}  {inc.reason or 'killed'}"
            )
        return "\n".join(lines)

    def csv(self) -> str:
        """CSV: one row per process and a ``total`` row; a column per cause (seconds)."""
        out = io.StringIO()
        writer = csv.writer(out)
        causes = list(self.causes)
        writer.writerow(
            ["process", "attempt", "launched", "end", "resumed_at", "reached", "lost_steps",
             "productive", *causes, "reason"]
        )  # fmt: skip
        for n, inc in enumerate(self.incarnations):
            writer.writerow(
                [n, inc.attempt, f"{inc.launched:.3f}", f"{inc.end:.3f}", inc.resumed_at,
                 inc.reached, inc.lost_steps, f"{inc.productive:.3f}",
                 *(f"{inc.causes.get(c, 0.0):.3f}" for c in causes), inc.reason or "killed"]
            )  # fmt: skip
        first = self.incarnations[0].launched if self.incarnations else 0.0
        writer.writerow(
            ["total", "", f"{first:.3f}", f"{first + self.wall:.3f}", "", "", self.steps_lost,
             f"{self.productive:.3f}", *(f"{self.causes[c]:.3f}" for c in causes), ""]
        )  # fmt: skip
        return out.getvalue()


def _incarnation(ledger: LedgerFile) -> Incarnation | None:
    start = ledger.first("start")
    if start is None:
        return None
    launched = float(start.get("launched") or start["t"])
    causes: dict[str, float] = {}
    # A second recorder of a process starts after the import: its start-up counts from it.
    imported = max(float(start.get("imported") or launched), launched)
    causes["import"] = max(0.0, imported - launched)
    ready: float | None = None
    intervals = [(str(r["c"]), float(r["s"]), float(r["e"])) for r in ledger.all("interval")]

    def joining(start: float, end: float) -> float:
        """The rendezvous inside ``start``..``end`` (recorded apart: not counted twice)."""
        return sum(e - s for c, s, e in intervals if c == "rendezvous" and start <= s <= e <= end)

    for cause, s, e in intervals:
        secs = max(0.0, e - s)
        if cause in ("init", "restore"):
            secs -= joining(s, e)
            if ready is None:
                causes["startup"] = max(0.0, s - imported - joining(imported, s))
                ready = e
        causes[cause] = causes.get(cause, 0.0) + max(0.0, secs)
    resume = ledger.first("resume")
    if resume is None:  # Killed (or failed) before its session was ready: all start-up.
        causes["startup"] = causes.get("startup", 0.0) + max(
            0.0, max(float(r.get("t", r.get("e", launched))) for r in ledger.records) - imported
        )
    progress = ledger.last("progress")
    end = ledger.last("end")
    for cause, secs in ((progress or {}).get("acc") or {}).items():
        causes[cause] = causes.get(cause, 0.0) + float(secs)
    last_t = max(float(r.get("t", r.get("e", launched))) for r in ledger.records)
    steps = [
        r.get("step") for r in (progress, end) if r is not None and isinstance(r.get("step"), int)
    ]
    resumed_at = resume.get("step") if resume is not None else None
    reached = max(steps) if steps else resumed_at
    return Incarnation(
        path=ledger.path,
        launched=launched,
        end=last_t,
        clean=end is not None,
        reason=end.get("reason") if end is not None else None,
        resumed_at=resumed_at,
        reached=reached,
        causes=causes,
        attempt=int(start.get("attempt") or 0),
        job=start.get("job"),
    )


def _account(
    inc: Incarnation, ready: float | None, next_resumed: int | None, next_launched: float | None
) -> None:
    """Steps lost to the next process, the killed process's estimated end, productive time."""
    measured = sum(v for k, v in inc.causes.items() if k not in ("import", "startup", "lost"))
    measured -= sum(inc.causes.get(c, 0.0) for c in ("rendezvous", "init", "restore"))
    if ready is None:  # Never ready: no step ran, nothing was lost.
        inc.causes["lost"] = 0.0
        return
    loop = max(0.0, inc.end - ready - measured)
    done = (inc.reached or 0) - (inc.resumed_at or 0)
    step_secs = loop / done if done > 0 else 0.0
    if (
        not inc.clean
        and not inc.alive_known
        and inc.last_recorded_step is not None
        and inc.reached is not None
    ):
        # Killed: it ran on after its last record up to the step its heartbeat says.
        extra = step_secs * max(0, inc.reached - inc.last_recorded_step)
        if next_launched is not None:  # It died before the next one was started.
            extra = min(extra, max(0.0, next_launched - inc.end))
        inc.end += extra
        loop += extra
    if next_resumed is not None and inc.reached is not None:
        inc.lost_steps = max(0, inc.reached - next_resumed)
    lost = min(loop, inc.lost_steps * step_secs)
    inc.causes["lost"] = lost
    inc.productive = loop - lost


def goodput_report(ledgers: Iterable[LedgerFile], rank: int = 0) -> GoodputReport:
    """The goodput of ``rank`` over the run the ledgers tell (module docstring).

    Args:
        ledgers: The run's ledger files (``read_ledgers``), every rank's.
        rank: The rank to report.

    Returns:
        The report; empty (no process) when the rank has none.
    """
    found: list[tuple[Incarnation, float | None, dict[str, Any]]] = []
    run_id = None
    for ledger in ledgers:
        start = ledger.first("start")
        if start is None or int(start.get("rank", -1)) != rank:
            continue
        inc = _incarnation(ledger)
        if inc is None:
            continue
        run_id = run_id or (ledger.first("resume") or {}).get("run")
        interval = next(
            (r for r in ledger.all("interval") if r.get("c") in ("init", "restore")), None
        )
        progress = ledger.last("progress")
        end = ledger.last("end")
        recorded = [r.get("step") for r in (progress, end) if r is not None]
        inc.last_recorded_step = max((s for s in recorded if isinstance(s, int)), default=None)
        found.append((inc, float(interval["e"]) if interval else None, start))
    found.sort(key=lambda item: item[0].launched)
    for n, (inc, _ready, _start) in enumerate(found):
        if n + 1 < len(found):  # The next process says how far this one got (heartbeat).
            following, start = found[n + 1][0], found[n + 1][2]
            before, alive = start.get("before"), start.get("before_alive")
            counted = start.get("before_acc")
            if isinstance(before, int) and (inc.reached is None or before > inc.reached):
                inc.reached = before
            if (
                not inc.clean
                and isinstance(alive, (int, float))
                and inc.end < alive <= following.launched
            ):
                inc.end, inc.alive_known = float(alive), True
                # What it counted after its last progress record, from its heartbeat.
                for cause, secs in (counted if isinstance(counted, dict) else {}).items():
                    if isinstance(secs, (int, float)) and secs > inc.causes.get(cause, 0.0):
                        inc.causes[cause] = float(secs)
    for n, (inc, ready, _start) in enumerate(found):
        following = found[n + 1][0] if n + 1 < len(found) else None
        _account(
            inc,
            ready,
            following.resumed_at if following is not None else None,
            following.launched if following is not None else None,
        )
    incarnations = [inc for inc, _, _ in found]
    for n, inc in enumerate(incarnations[:-1]):
        inc.causes["down"] = max(0.0, incarnations[n + 1].launched - inc.end)
    names = list(CAUSES) + sorted(
        {c for inc in incarnations for c in inc.causes if c not in CAUSES}
    )
    totals = {c: sum(inc.causes.get(c, 0.0) for inc in incarnations) for c in names}
    wall = incarnations[-1].end - incarnations[0].launched if incarnations else 0.0
    productive = sum(inc.productive for inc in incarnations)
    return GoodputReport(rank, wall, productive, totals, incarnations, run_id)
