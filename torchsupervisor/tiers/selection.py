"""Which snapshot a restart restores: the newest step every rank holds, tier by tier.

Each tier (host memory, a peer's memory, the checkpoint directory, a bucket) holds some ranks'
parts of some steps, each complete and checked. A restart restores the newest step for which
every rank's part is held by some tier, never a mix of steps; each rank reads its part from the
first tier, in the order of preference, that holds it. A part that then fails its checks (a bit
flip, a truncation, a slot of an older generation) is dropped and the choice is made again: it
is never tried twice, so the restore ends after at most one attempt per part.

Pure functions over plain data. Every rank runs them on the same gathered holdings, so every
rank makes the same choice.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "Holdings",
    "Part",
    "RestoreChoice",
    "choose_restore",
    "restore_newest",
    "restore_order",
]

Holdings = Mapping[str, Mapping[int, Collection[int]]]
"""``{tier: {rank: steps}}``: the steps of each rank's part that a tier holds complete."""


@dataclass(frozen=True, order=True)
class Part:
    """One rank's part of one step in one tier."""

    tier: str
    rank: int
    step: int


@dataclass(frozen=True)
class RestoreChoice:
    """The step to restore and where each rank reads its part.

    Attributes:
        step: The global step (completed steps) of the snapshot.
        sources: By rank, the tier each rank reads its part from.
    """

    step: int
    sources: tuple[str, ...]

    def parts(self) -> list[Part]:
        """The parts this choice reads, by rank."""
        return [Part(tier, rank, self.step) for rank, tier in enumerate(self.sources)]


def choose_restore(
    holdings: Holdings,
    world_size: int,
    order: Sequence[str],
    failed: Collection[Part] = (),
) -> RestoreChoice | None:
    """The newest step every rank holds in some tier, and each rank's first tier for it.

    Args:
        holdings: What each tier holds (tiers not in ``order`` are not read).
        world_size: The number of ranks (each must hold a part).
        order: The tiers, most preferred first (e.g. memory, peer, disk, bucket).
        failed: Parts that failed their checks: not chosen again.

    Returns:
        The choice, or None when no step is held for every rank.

    Raises:
        ValueError: ``world_size`` below 1, or a tier named twice in ``order``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if len(set(order)) != len(order):
        raise ValueError(f"a tier is named twice in the order {list(order)}")
    bad = set(failed)
    by_rank: list[dict[int, str]] = [{} for _ in range(world_size)]
    for tier in reversed(order):  # The preferred tier written last wins.
        for rank, steps in holdings.get(tier, {}).items():
            if 0 <= rank < world_size:
                for step in steps:
                    if Part(tier, rank, step) not in bad:
                        by_rank[rank][step] = tier
    common = set(by_rank[0]).intersection(*by_rank[1:])
    if not common:
        return None
    step = max(common)
    return RestoreChoice(step, tuple(sources[step] for sources in by_rank))


def restore_newest(
    holdings: Holdings,
    world_size: int,
    order: Sequence[str],
    load: Callable[[RestoreChoice], Collection[Part]],
) -> tuple[RestoreChoice | None, list[Part]]:
    """Restore the newest held step, dropping each part that fails and choosing again.

    Args:
        holdings, world_size, order: As ``choose_restore``.
        load: Reads a choice into the state; returns the parts of it that failed their checks
            (empty: restored). The ranks must agree on what failed (a collective's outcome).

    Returns:
        ``(choice, failed)``: the choice restored (None: nothing held for every rank passed),
        and every part that failed, in the order found.

    Raises:
        ValueError: ``load`` reported a part the choice does not read (no loop on a part that
            cannot be dropped).
    """
    failed: list[Part] = []
    for _ in range(1 + sum(len(s) for ranks in holdings.values() for s in ranks.values())):
        choice = choose_restore(holdings, world_size, order, failed)
        if choice is None:
            return None, failed
        bad = set(load(choice))
        if not bad:
            return choice, failed
        unknown = bad - set(choice.parts())
        if unknown:
            raise ValueError(f"load reported parts it was not given: {sorted(unknown)}")
        failed.extend(sorted(bad))
    raise AssertionError("unreachable: each round drops at least one part")  # pragma: no cover


def restore_order(
    directory_tier: str,
    candidates: Sequence[str],
    newest_step: int | None,
    held: Sequence[tuple[str, int, str]],
) -> list[tuple[str, str]]:
    """The order in which one process tries its snapshots, as ``(tier, prefix)`` pairs.

    The other tiers' snapshots at least as new as the directory's newest checkpoint come
    first (newest first; at the same step, in the order of ``held``: the faster tier first),
    then the directory's checkpoints in their own order (``checkpoint.recovery``), then the
    other tiers' older snapshots. Each is tried once.

    Args:
        directory_tier: The name of the checkpoint directory's tier (``"disk"``, ``"bucket"``).
        candidates: The directory's checkpoints, in the order a restart tries them.
        newest_step: The step of ``candidates[0]``; None when its name holds none (the other
            tiers' snapshots then come after the directory's).
        held: The other tiers' snapshots as ``(tier, step, prefix)``.
    """
    if not candidates:
        newest_step = -1
    ordered = sorted(held, key=lambda h: h[1], reverse=True)  # Stable: same step, same order.
    first = [h for h in ordered if newest_step is not None and h[1] >= newest_step]
    rest = [h for h in ordered if h not in first]
    return [
        *[(tier, prefix) for tier, _, prefix in first],
        *[(directory_tier, prefix) for prefix in candidates],
        *[(tier, prefix) for tier, _, prefix in rest],
    ]
