"""What a restore asks of a tier that keeps snapshots outside the checkpoint directory.

The checkpoint directory (on disk or in a bucket) is read by ``checkpoint/recovery``; a tier
such as host memory (``tiers/memory``) lists its committed snapshots and restores one, and
``SessionManager`` tries them in order of step, the faster tier first at the same step.

TF name: none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torchsupervisor.core.session import Session

__all__ = ["Snapshot", "SnapshotTier"]


@dataclass(frozen=True)
class Snapshot:
    """A committed snapshot of a tier: its global step and checkpoint prefix."""

    step: int
    prefix: str


class SnapshotTier(Protocol):
    """A tier a restart can restore from (``MemoryTier``, or anything with these members).

    Attributes:
        name: The tier's name in logs (``"memory"``).
        damaged: What the last ``snapshots`` refused, as ``"<prefix>: <why>"``.
    """

    name: str
    damaged: list[str]

    def snapshots(self) -> list[Snapshot]:
        """The committed snapshots, newest first (damaged ones left out, in ``damaged``)."""
        ...

    def restore(self, sess: Session, prefix: str) -> None:
        """Load ``prefix`` into ``sess``'s state after checking every byte.

        Raises:
            CorruptCheckpointError: It is damaged (the state is then unchanged).
        """
        ...
