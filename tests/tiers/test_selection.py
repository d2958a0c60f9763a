"""Which step a restart restores and from which tier each rank reads it: tables."""

from __future__ import annotations

import pytest

from torchsupervisor.tiers import Part, RestoreChoice, choose_restore, restore_newest
from torchsupervisor.tiers.selection import restore_order

ORDER = ("memory", "peer", "disk", "bucket")


@pytest.mark.parametrize(
    ("holdings", "world_size", "expected"),
    [
        # The newest step every rank holds, each rank from its first tier that has it.
        (
            {"memory": {0: [5, 6], 1: [5]}, "disk": {1: [6]}},
            2,
            RestoreChoice(6, ("memory", "disk")),
        ),
        # Never a mix of steps: no step is held for both ranks.
        ({"memory": {0: [6]}, "disk": {1: [5]}}, 2, None),
        # The memory tier first where both hold a part; a peer's copy before the disk.
        (
            {"memory": {0: [4]}, "disk": {0: [4], 1: [4]}, "peer": {1: [4]}},
            2,
            RestoreChoice(4, ("memory", "peer")),
        ),
        # A rank that holds nothing anywhere: nothing to restore.
        ({"memory": {0: [3]}}, 2, None),
        # An older step held everywhere beats a newer one a rank lacks.
        (
            {"memory": {0: [9, 7]}, "bucket": {0: [7], 1: [7]}},
            2,
            RestoreChoice(7, ("memory", "bucket")),
        ),
        # Tiers outside the order and ranks outside the world are not read.
        ({"tape": {0: [8]}, "disk": {0: [2], 3: [8]}}, 1, RestoreChoice(2, ("disk",))),
        ({}, 1, None),
    ],
)
def test_the_newest_step_every_rank_holds(holdings, world_size, expected):
    assert choose_restore(holdings, world_size, ORDER) == expected


def test_a_failed_part_is_not_chosen_again():
    holdings = {"memory": {0: [6], 1: [6]}, "disk": {0: [5, 6], 1: [5]}}
    failed = [Part("memory", 1, 6)]  # Rank 1 has no other copy of step 6: back to step 5.
    assert choose_restore(holdings, 2, ORDER, failed) == RestoreChoice(5, ("disk", "disk"))
    failed = [Part("memory", 0, 6)]  # Rank 0 reads step 6 from the disk instead.
    assert choose_restore(holdings, 2, ORDER, failed) == RestoreChoice(6, ("disk", "memory"))


def test_a_restore_falls_back_part_by_part_and_tries_each_part_once():
    holdings = {"memory": {0: [6], 1: [6]}, "peer": {1: [6]}, "disk": {0: [5], 1: [5]}}
    damaged = {Part("memory", 1, 6), Part("peer", 1, 6)}
    tried: list[RestoreChoice] = []

    def load(choice: RestoreChoice) -> set[Part]:
        tried.append(choice)
        return damaged & set(choice.parts())

    choice, failed = restore_newest(holdings, 2, ORDER, load)
    assert choice == RestoreChoice(5, ("disk", "disk"))
    assert failed == [Part("memory", 1, 6), Part("peer", 1, 6)]
    assert tried == [
        RestoreChoice(6, ("memory", "memory")),
        RestoreChoice(6, ("memory", "peer")),
        RestoreChoice(5, ("disk", "disk")),
    ]


def test_a_restore_with_every_part_damaged_ends_with_nothing():
    holdings = {"memory": {0: [2, 1]}, "disk": {0: [1]}}
    calls = []

    def load(choice: RestoreChoice) -> list[Part]:
        calls.append(choice)
        return choice.parts()

    assert restore_newest(holdings, 1, ORDER, load) == (
        None,
        [Part("memory", 0, 2), Part("memory", 0, 1), Part("disk", 0, 1)],
    )
    assert len(calls) == 3  # Once per part held, then nothing is left.


def test_a_load_that_reports_a_part_it_was_not_given_is_an_error():
    with pytest.raises(ValueError, match="not given"):
        restore_newest({"disk": {0: [1]}}, 1, ORDER, lambda choice: [Part("memory", 0, 1)])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="world_size"):
        choose_restore({}, 0, ORDER)
    with pytest.raises(ValueError, match="twice"):
        choose_restore({}, 1, ("disk", "disk"))


@pytest.mark.parametrize(
    ("candidates", "newest", "held", "expected"),
    [
        # Memory newer than disk: memory first (newest first), then disk.
        (["d30"], 30, [("memory", 41, "m41"), ("memory", 40, "m40")], ["m41", "m40", "d30"]),
        # The same step: the faster tier first.
        (["d41", "d30"], 41, [("memory", 41, "m41")], ["m41", "d41", "d30"]),
        # Memory older than disk: tried only after every disk checkpoint.
        (["d50", "d40"], 50, [("memory", 45, "m45")], ["d50", "d40", "m45"]),
        # No disk checkpoint: memory alone.
        ([], None, [("memory", 3, "m3")], ["m3"]),
        # A disk checkpoint without a step in its name: the directory's order first.
        (["model.ckpt"], None, [("memory", 3, "m3")], ["model.ckpt", "m3"]),
    ],
)
def test_restore_order(candidates, newest, held, expected):
    order = restore_order("disk", candidates, newest, held)
    assert [prefix for _, prefix in order] == expected
    tiers = {prefix: tier for tier, prefix in order}
    assert all(tiers[p] == "disk" for p in candidates)
