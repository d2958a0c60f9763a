"""Which checkpoints to keep: ``max_to_keep``, ``keep_checkpoint_every_n_hours`` and the best.

Pure functions over plain data; the time is passed in, so tests use synthetic timestamps.
They reproduce TF's ``Saver`` bookkeeping:

* ``record``: a new checkpoint is appended to the tracked list (an existing entry with the same
  path is moved to the end); when the list grows beyond ``max_to_keep`` the oldest entries are
  evicted. ``max_to_keep`` of 0 or None tracks nothing (and so never deletes).
* ``sweep``: an evicted checkpoint whose timestamp is later than the next "keep" time is
  preserved forever (and the keep time advances by N hours); the others are to be deleted.

Keep-best (``Saver(keep_best=K)``, after Orbax's ``best_fn``/``best_mode``): ``record`` also
ranks a checkpoint saved with a score among the ``best`` K; one pushed out of them is evicted
unless it is still among the newest. ``sweep`` never deletes a checkpoint that is among the
newest or the best: the newest ``max_to_keep`` plus the best K are kept, and a best one is
deleted only once K better ones exist. ``listed`` is what the state file names: both.

And they decide when an incremental save must be a full one instead (``may_reference``).
An incremental checkpoint references the data files of earlier checkpoints, so one damaged
file can break several checkpoints: every checkpoint of the same *chain* (a full save and the
incremental saves that reference its data, directly or through each other) that uses it.
Checkpoints of different chains share no file. The rule: a save may join the current chain
only if, once it is committed and retention has run, a checkpoint of another chain is still
kept. Then every tensor has at least two independent copies among the kept checkpoints, and
a single damaged file never makes every kept checkpoint unusable: the restore falls back to
the other chain. With ``max_to_keep = N`` this gives a full save at least every ``N - 1``
saves (every save with N <= 2), and the second save of a fresh run is full too (the first
chain has no predecessor). ``full_save_every_n_saves`` can only make full saves more frequent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "Retention",
    "default_full_save_interval",
    "listed",
    "may_reference",
    "record",
    "sweep",
]

KEEP_ALL_FULL_SAVE_INTERVAL = 4
"""Saves per chain when every checkpoint is kept (``max_to_keep`` 0 or None)."""

Entry = tuple[str, float]


@dataclass(frozen=True)
class Retention:
    """The bookkeeping of a saver.

    Attributes:
        tracked: ``(prefix, timestamp_secs)`` of the checkpoints that may still be deleted,
            oldest first.
        evicted: Checkpoints pushed out of ``tracked`` and not yet swept.
        next_keep_time: Wall time (seconds) after which an evicted checkpoint is preserved.
        best: ``(prefix, score, timestamp_secs)`` of the best checkpoints, best first (keep
            best); empty without.
    """

    tracked: tuple[Entry, ...] = ()
    evicted: tuple[Entry, ...] = ()
    next_keep_time: float = float("inf")
    best: tuple[tuple[str, float, float], ...] = ()


def rank_best(
    best: list[tuple[str, float, float]], keep_best: int, higher_is_better: bool
) -> tuple[list[tuple[str, float, float]], list[tuple[str, float, float]]]:
    """Split ``best`` into the ``keep_best`` best (best first; of equal scores the older
    first) and the rest."""
    ordered = sorted(best, key=lambda b: (-b[1] if higher_is_better else b[1], b[2]))
    return ordered[:keep_best], ordered[keep_best:]


def record(
    state: Retention,
    prefix: str,
    now_secs: float,
    max_to_keep: int | None,
    *,
    score: float | None = None,
    keep_best: int = 0,
    higher_is_better: bool = True,
) -> Retention:
    """Return the bookkeeping after a checkpoint ``prefix`` was committed at ``now_secs``.

    Args:
        score: The checkpoint's score (keep best); None: it ranks nowhere.
        keep_best: How many best checkpoints to keep besides the newest (0: none).
        higher_is_better: Whether a higher score is better.
    """
    if not max_to_keep:
        return state
    tracked = [entry for entry in state.tracked if entry[0] != prefix]
    tracked.append((prefix, now_secs))
    overflow = max(0, len(tracked) - max_to_keep)
    best = [b for b in state.best if b[0] != prefix]
    displaced: list[tuple[str, float, float]] = []
    if keep_best and score is not None:
        best, displaced = rank_best([*best, (prefix, score, now_secs)], keep_best, higher_is_better)
    newest = {p for p, _ in tracked[overflow:]}
    return Retention(
        tracked=tuple(tracked[overflow:]),
        evicted=(
            state.evicted
            + tuple(tracked[:overflow])
            + tuple((p, t) for p, _, t in displaced if p not in newest)
        ),
        next_keep_time=state.next_keep_time,
        best=tuple(best),
    )


def listed(state: Retention) -> list[str]:
    """The checkpoints the state file names: the newest and the best, oldest first."""
    entries = {p: t for p, t in state.tracked}
    for prefix, _, timestamp in state.best:
        entries.setdefault(prefix, timestamp)
    return [p for p, _ in sorted(entries.items(), key=lambda e: e[1])]


def sweep(state: Retention, keep_every_secs: float) -> tuple[Retention, list[str], list[str]]:
    """Decide the fate of the evicted checkpoints.

    Args:
        state: The bookkeeping.
        keep_every_secs: ``keep_checkpoint_every_n_hours * 3600``.

    Returns:
        ``(new_state, to_delete, preserved)``: prefixes to delete now, and prefixes kept for good
        (no longer tracked), in eviction order.
    """
    next_keep_time = state.next_keep_time
    to_delete: list[str] = []
    preserved: list[str] = []
    kept = {p for p, _ in state.tracked} | {p for p, _, _ in state.best}
    for prefix, timestamp in state.evicted:
        if prefix in kept:  # Still among the newest or the best.
            continue
        if timestamp > next_keep_time:
            preserved.append(prefix)
            next_keep_time += keep_every_secs
        else:
            to_delete.append(prefix)
    return (
        Retention(
            tracked=state.tracked, evicted=(), next_keep_time=next_keep_time, best=state.best
        ),
        to_delete,
        preserved,
    )


def default_full_save_interval(max_to_keep: int | None) -> int:
    """Return the longest chain (in saves, the full one included) ``max_to_keep`` allows.

    ``max_to_keep - 1`` (at least 1: with one or two kept checkpoints every save is full), so
    that the kept checkpoints always span two chains; ``KEEP_ALL_FULL_SAVE_INTERVAL`` when
    every checkpoint is kept.
    """
    if not max_to_keep:
        return KEEP_ALL_FULL_SAVE_INTERVAL
    return max(1, max_to_keep - 1)


def may_reference(
    kept_chains: Iterable[str | None],
    chain: str | None,
    chain_saves: int,
    full_save_every_n_saves: int,
) -> bool:
    """Return True if the next save may reference the current chain's data (be incremental).

    Args:
        kept_chains: For every checkpoint that stays kept once the next save is committed and
            retention has run (the next save itself excluded), the chain it belongs to: the
            prefix of the full save its data starts from; None for a checkpoint of unknown
            chain (written by an earlier run: independent of the current chain, which always
            starts with a full save in this run).
        chain: The chain the next save would join (the last committed save's); None: there is
            none (first save, or the last one failed).
        chain_saves: Saves already in that chain, the full one included.
        full_save_every_n_saves: The longest chain allowed, in saves (>= 1).

    Returns:
        False if the next save must write every tensor (start a new chain).
    """
    if chain is None or chain_saves >= full_save_every_n_saves:
        return False
    return any(other != chain for other in kept_chains)
