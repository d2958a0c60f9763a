"""A sharded run's memory and local-disk tiers at a restart: steps every rank holds, restored
by all or none.

In a sharded run (FSDP2) each rank keeps only its own part in its own memory
(``tiers/local_shards``), and the ranks' writers may be a snapshot or two apart when a rank
dies. ``agreed_tier`` gathers every rank's committed steps and offers, on every rank, the same
list: the steps every rank holds (``selection.choose_restore``, again after dropping each
chosen one), newest first, so ``SessionManager`` tries the same steps in the same order on
every rank. A restore of one is agreed: every rank loads its part (every byte checked), then
the ranks gather their outcomes, and if any rank's part failed, the step fails on every rank
with the reason, and every rank goes on to the next step, or to the checkpoint directory,
together. Never a mix of steps, and each step is tried once. With peer copies
(``tiers/ring``) a rank also counts as held the steps of its part that other nodes offer, and
fetches its part of the step tried when its memory lacks it (or its own fails), one copy at a
time until one passes its checks. The local-disk tier (``tiers/local_disk``) is agreed on in
the same way, on its own (its steps gathered apart, never mixed with the memory tier's).

TF name: none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from torchsupervisor.errors import CorruptCheckpointError, InvalidArgumentError, NotFoundError
from torchsupervisor.tiers.selection import Part, choose_restore
from torchsupervisor.tiers.tier import Snapshot

if TYPE_CHECKING:
    from torchsupervisor.core.session import Session
    from torchsupervisor.distributed.replicas import ReplicaGroup
    from torchsupervisor.tiers.local_disk import LocalDiskTier
    from torchsupervisor.tiers.memory import MemoryTier

__all__ = ["AgreedTier", "agreed_tier", "common_steps"]

_HOLDINGS = "{}/holdings"  # Of the tier named.
_RESTORED = "{}/restored/{}"  # Of the tier named, of a step.

logger = logging.getLogger("torchsupervisor")


def common_steps(held: list[list[int]]) -> list[int]:
    """The steps every rank holds, newest first.

    Args:
        held: By rank, the steps of that rank's committed snapshots.
    """
    holdings = {"memory": dict(enumerate(held))}
    steps: list[int] = []
    while True:
        failed = [Part("memory", rank, step) for step in steps for rank in range(len(held))]
        choice = choose_restore(holdings, len(held), ["memory"], failed)
        if choice is None:
            return steps
        steps.append(choice.step)


class AgreedTier:
    """This rank's ``MemoryTier`` (or ``LocalDiskTier``) as a ``SnapshotTier`` whose steps
    every rank holds and whose restore succeeds on every rank or on none (module docstring).

    Args:
        memory: This rank's memory tier, or its local-disk tier.
        replicas: The run's ranks.
        steps: The steps every rank holds, newest first (``common_steps``).
        timeout_secs: How long a rank waits for the others' outcomes (seconds).
        fetch: A function of a step yielding, one at a time, copies of this rank's part of
            it fetched into ``memory`` from its peers (``tiers/ring.fetcher``), tried when the
            memory lacks the step or its own snapshot fails; None: no copies.
    """

    def __init__(
        self,
        memory: MemoryTier | LocalDiskTier,
        replicas: ReplicaGroup,
        steps: list[int],
        timeout_secs: float,
        fetch: Callable[[int], Iterable[str]] | None = None,
    ) -> None:
        self.memory = memory
        self.name = memory.name
        self.damaged: list[str] = []
        self._replicas = replicas
        self._steps = steps
        self._timeout_secs = timeout_secs
        self._fetch = fetch

    def snapshots(self) -> list[Snapshot]:
        """This rank's snapshots of the steps every rank holds, newest first."""
        own = {s.step: s for s in self.memory.snapshots()}
        self.damaged = list(self.memory.damaged)
        return [
            own[step] if step in own else Snapshot(step, self._prefix(step)) for step in self._steps
        ]

    def _prefix(self, step: int) -> str:
        return f"{self.memory.save_path}-{step}"

    def restore(self, sess: Session, prefix: str) -> None:
        """Load this rank's part of ``prefix``'s step; fail on every rank if one rank's fails.

        Raises:
            CorruptCheckpointError: This rank's part or another's failed (naming the ranks and
                why); every rank raises it for the same step.
        """
        step = int(prefix.rsplit("-", 1)[1])
        why = None
        try:
            self._restore_part(sess, prefix, step)
        except (CorruptCheckpointError, NotFoundError, InvalidArgumentError, OSError) as e:
            why = f"{type(e).__name__}: {e}"
        replicas = self._replicas
        name = _RESTORED.format(self.name, step)
        replicas.post(name, why)
        outcomes = replicas.gather(
            name, self._timeout_secs, what=f"the {self.name} tier's restore of step {step}"
        )
        failed = [f"rank {rank}: {reason}" for rank, reason in enumerate(outcomes) if reason]
        if failed:
            raise CorruptCheckpointError(
                f"step {step} of the {self.name} tier is not usable on every rank "
                f"({'; '.join(failed)})"
            )

    def _restore_part(self, sess: Session, prefix: str, step: int) -> None:
        """Load this rank's part of ``step``: its own snapshot, else (or if that fails) each
        copy its peers offer in turn, until one passes its checks."""
        if self._fetch is None or step in {s.step for s in self.memory.snapshots()}:
            try:
                self.memory.restore(sess, prefix)
                return
            except CorruptCheckpointError as e:
                if self._fetch is None:
                    raise
                failure: Exception = e
                logger.warning("%s; trying the peer copies", e)
        else:
            failure = NotFoundError(None, None, f"{prefix}: not in this rank's memory or peers")
        for fetched in self._fetch(step):
            try:
                self.memory.restore(sess, fetched)
                return
            except CorruptCheckpointError as e:
                failure = e
                logger.warning("The peer copy %s was refused: %s", fetched, e)
        raise failure


def agreed_tier(
    memory: MemoryTier | LocalDiskTier | None,
    replicas: ReplicaGroup,
    timeout_secs: float,
    *,
    offered: Iterable[int] = (),
    fetch: Callable[[int], Iterable[str]] | None = None,
    name: str = "memory",
) -> AgreedTier | None:
    """Gather every rank's steps; this rank's tier over the steps all hold.

    Called on every rank at the same point (a rank without the tier posts nothing held, so no
    step is common). None on a rank without the tier.

    Args:
        memory: This rank's memory tier (or its local-disk tier), or None.
        replicas: The run's ranks.
        timeout_secs: How long to wait for the other ranks (seconds).
        offered: Steps of this rank's part its peers offer (``tiers/ring``): held too.
        fetch: Fetches them (``AgreedTier``).
        name: The tier's name (the same on every rank, also on one without it).

    Raises:
        DeadlineExceededError: A rank did not post its steps within ``timeout_secs``.
    """
    own: list[int] = []
    if memory is not None:
        own = sorted({s.step for s in memory.snapshots()} | set(offered), reverse=True)
    key = _HOLDINGS.format(name)
    replicas.post(key, own)
    held = replicas.gather(key, timeout_secs, what=f"the {name} tier's steps on every rank")
    steps = common_steps(held)
    if memory is None:
        return None
    if own and not steps:
        logger.warning(
            "The %s tier holds no step that every rank holds (by rank: %s): restoring from "
            "the checkpoints",
            name,
            held,
        )
    return AgreedTier(memory, replicas, steps, timeout_secs, fetch)
