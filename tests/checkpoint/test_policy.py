"""Retention and the full-save rule as pure functions, tested as tables (synthetic times)."""

from __future__ import annotations

import pytest

from torchsupervisor.checkpoint.policy import (
    KEEP_ALL_FULL_SAVE_INTERVAL,
    Retention,
    default_full_save_interval,
    may_reference,
    record,
    sweep,
)

# --------------------------------------------------------------------------------- record


@pytest.mark.parametrize(
    ("saves", "max_to_keep", "tracked", "evicted"),
    [
        # One new checkpoint a second; the oldest are pushed out past max_to_keep.
        ("abcd", 2, "cd", "ab"),
        ("abcd", 4, "abcd", ""),
        ("abcd", 1, "d", "abc"),
        # Saving to a prefix again moves it to the end (TF: same path, newest time).
        ("aba", 3, "ba", ""),
        # (The Saver sweeps after every record, so the first "a" is gone before the name
        # is reused; record alone just lists it.)
        ("abca", 2, "ca", "ab"),
        # 0 or None: nothing is tracked, so nothing is ever deleted.
        ("abcd", 0, "", ""),
        ("abcd", None, "", ""),
    ],
)
def test_record(saves, max_to_keep, tracked, evicted):
    state = Retention()
    for now, prefix in enumerate(saves):
        state = record(state, prefix, float(now), max_to_keep)
    assert "".join(p for p, _ in state.tracked) == tracked
    assert "".join(p for p, _ in state.evicted) == evicted
    assert all(t == float(saves.rindex(p)) for p, t in state.tracked)


# ---------------------------------------------------------------------------------- sweep


@pytest.mark.parametrize(
    ("evicted", "next_keep_time", "every", "to_delete", "preserved", "next_after"),
    [
        # Preserve the first checkpoint past the keep time, then one per interval.
        ({"a": 5, "b": 11, "c": 12, "d": 30}, 10, 10, "ac", "bd", 30),
        # Before the keep time everything evicted is deleted.
        ({"a": 1, "b": 2}, 10, 10, "ab", "", 10),
        # Exactly at the keep time is not after it.
        ({"a": 10}, 10, 10, "a", "", 10),
        # TF's default of 10000 hours never preserves anything in practice.
        ({"a": 1e9}, 1e9 + 3.6e7, 3.6e7, "a", "", 1e9 + 3.6e7),
        # Nothing evicted: nothing to do.
        ({}, 10, 10, "", "", 10),
    ],
)
def test_sweep(evicted, next_keep_time, every, to_delete, preserved, next_after):
    state = Retention(
        tracked=(("z", 99.0),),
        evicted=tuple((p, float(t)) for p, t in evicted.items()),
        next_keep_time=float(next_keep_time),
    )
    new, deleted, kept = sweep(state, keep_every_secs=float(every))
    assert ("".join(deleted), "".join(kept)) == (to_delete, preserved)
    assert new == Retention(tracked=(("z", 99.0),), evicted=(), next_keep_time=next_after)


# ----------------------------------------------------------------- the two-copies rule


@pytest.mark.parametrize(
    ("max_to_keep", "interval"),
    [(None, KEEP_ALL_FULL_SAVE_INTERVAL), (0, KEEP_ALL_FULL_SAVE_INTERVAL), (1, 1), (2, 1),
     (3, 2), (5, 4), (10, 9)],
)  # fmt: skip
def test_default_full_save_interval(max_to_keep, interval):
    assert default_full_save_interval(max_to_keep) == interval


@pytest.mark.parametrize(
    ("kept_chains", "chain", "chain_saves", "full_every", "expected"),
    [
        # No chain to join (first save, or the last save failed): full.
        (["a", "b"], None, 0, 10, False),
        # Every other kept checkpoint is in the chain: one bad file could break them all.
        (["a", "a"], "a", 2, 10, False),
        ([], "a", 1, 10, False),
        # A kept checkpoint of another chain is a second, independent copy.
        (["b", "a"], "a", 2, 10, True),
        # A checkpoint of unknown chain (an earlier run) is independent of this run's chain.
        ([None, "a"], "a", 1, 10, True),
        # The chain is as long as allowed: full, whatever else is kept.
        (["b", "a"], "a", 3, 3, False),
        (["b"], "a", 1, 1, False),
        (["b", "a"], "a", 2, 3, True),
    ],
)
def test_may_reference(kept_chains, chain, chain_saves, full_every, expected):
    assert may_reference(kept_chains, chain, chain_saves, full_every) is expected


def _simulate(max_to_keep: int | None, full_every: int, saves: int) -> tuple[str, list]:
    """Run ``saves`` saves the way the Saver asks the rule; return F/R per save and the
    chains of the kept checkpoints after each save."""
    tracked: list[tuple[int, int]] = []  # (save number, chain = number of its full save)
    chain, chain_saves = None, 0
    pattern, kept_after = "", []
    for n in range(saves):
        # Kept once this save is in and retention ran, this save excluded.
        if not max_to_keep:
            kept = tracked
        else:
            kept = tracked[max(0, len(tracked) - max_to_keep + 1) :] if max_to_keep > 1 else []
        if may_reference([c for _, c in kept], chain, chain_saves, full_every):
            chain_saves += 1
            pattern += "R"
        else:
            chain, chain_saves = n, 1
            pattern += "F"
        tracked.append((n, chain))
        if max_to_keep:
            tracked = tracked[-max_to_keep:]
        kept_after.append([c for _, c in tracked])
    return pattern, kept_after


@pytest.mark.parametrize(
    ("max_to_keep", "full_every", "pattern"),
    [
        # Keeping one or two checkpoints: every save is full.
        (1, None, "FFFFFFFFFFFF"),
        (2, None, "FFFFFFFFFFFF"),
        # The second save of a run is full (the first chain has no predecessor); then a
        # full save every max_to_keep - 1 saves.
        (3, None, "FFRFRFRFRFRF"),
        (5, None, "FFRRRFRRRFRR"),
        # full_save_every_n_saves only makes full saves more frequent: a longer limit
        # still ends each chain when the kept checkpoints would all be in it.
        (5, 2, "FFRFRFRFRFRF"),
        (5, 1, "FFFFFFFFFFFF"),
        (5, 100, "FFRRRFRRRFRR"),
        # Keeping everything: chains of KEEP_ALL_FULL_SAVE_INTERVAL saves.
        (None, None, "FFRRRFRRRFRR"),
        (None, 6, "FFRRRRRFRRRR"),
    ],
)
def test_full_save_pattern_and_two_independent_copies(max_to_keep, full_every, pattern):
    # As the Saver passes it: full_save_every_n_saves, else the default for max_to_keep.
    limit = full_every or default_full_save_interval(max_to_keep)
    got, kept_after = _simulate(max_to_keep, limit, len(pattern))
    assert got == pattern
    for n, chains in enumerate(kept_after):
        if len(chains) >= 2:  # Two kept checkpoints: never all on the same data.
            assert len(set(chains)) >= 2, (n, chains)
    chain_lengths = [1 + len(refs) for refs in got.split("F")[1:]]
    assert max(chain_lengths) <= limit, got
