"""What a restore asks of a tier that keeps snapshots outside the checkpoint directory.

The checkpoint directory (on disk or in a bucket) is read by ``checkpoint/recovery``; a tier
such as host memory (``tiers/memory``) or a local disk (``tiers/disk``) lists its committed
snapshots and restores one, and ``SessionManager`` tries them in order of step, the faster
tier first at the same step.

The functions here are what those tiers share: a rank's directory made, tagged with its run's
id and cleaned of what a kill left (``open_rank_directory``), its committed snapshots with the
damaged ones named (``committed_snapshots``), and a snapshot's files (``snapshot_files``).

TF name: none.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torchsupervisor.checkpoint.files import checkpoint_step
from torchsupervisor.checkpoint.reader import read_manifests
from torchsupervisor.checkpoint.recovery import clean_checkpoint_dir, scan_checkpoints
from torchsupervisor.tiers.memory_root import rank_directory

if TYPE_CHECKING:
    from torchsupervisor.core.session import Session
    from torchsupervisor.storage.private import MemoryTierStorage

__all__ = [
    "RUN_ID_FILE",
    "Snapshot",
    "SnapshotTier",
    "committed_snapshots",
    "open_rank_directory",
    "snapshot_files",
]

RUN_ID_FILE = "run_id"
"""The file of a tier's directory naming the run its snapshots belong to."""

logger = logging.getLogger("torchsupervisor")


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


def open_rank_directory(
    root: str, logdir: str, rank: int, run_id: str, storage: MemoryTierStorage, tier: str
) -> str:
    """Make ``rank``'s directory of a tier under ``root`` (``memory_root.rank_directory``;
    every level the user's alone), delete every file of another run's snapshots in it (a log
    directory removed and made again is another run), tag it with ``run_id``
    (``RUN_ID_FILE``), and remove what an interrupted write left; return it.

    Args:
        root: The tier's root (``memory_root``).
        logdir: The run's log directory (its run key).
        rank: The rank.
        run_id: The run id of the log directory (``checkpoint.run_id``).
        storage: The tier's storage.
        tier: The tier's name, for the warning.

    Raises:
        PermissionError: A level is a link, not the user's, or open to others.
        OSError: A file could not be made, read, deleted or written.
    """
    directory = rank_directory(root, logdir, rank)
    storage.prepare_directory(root, directory)
    tag = os.path.join(directory, RUN_ID_FILE)
    try:
        found = storage.read_bytes(tag, max_bytes=256).decode("ascii", "replace").strip()
    except FileNotFoundError:
        found = None
    if found != run_id:
        names = [n for n in storage.list(directory) if n != RUN_ID_FILE]
        if names:
            logger.warning(
                "The %s tier at %s holds snapshots of another run (its log directory was made "
                "again): deleting them",
                tier,
                directory,
            )
        for name in names:
            storage.delete(os.path.join(directory, name))
        storage.put(tag, [f"{run_id}\n".encode("ascii")])
    clean_checkpoint_dir(directory, storage=storage)
    return directory


def committed_snapshots(
    directory: str, storage: MemoryTierStorage, origin: dict[str, str | int]
) -> tuple[list[Snapshot], list[str]]:
    """The committed snapshots of ``directory`` whose manifests are sound, newest first, and
    the refused ones as ``"<prefix>: <why>"``.

    Reads only the manifests (small); the data's checksums are checked at restore. Refused:
    a manifest missing or damaged, one naming another step than its file (an older generation
    in its place), one written by another origin than ``origin`` (another run's or rank's
    snapshot in its place).
    """
    damaged = []
    found = []
    prefixes = scan_checkpoints(directory, storage=storage)
    for prefix, manifest in read_manifests(prefixes, storage=storage).items():
        if manifest is None:
            damaged.append(f"{prefix}: its manifest is missing or damaged")
        elif manifest.global_step is None or manifest.global_step != checkpoint_step(prefix):
            damaged.append(
                f"{prefix}: its manifest is of step {manifest.global_step} (an older "
                "generation in its place)"
            )
        elif manifest.origin != origin:
            damaged.append(
                f"{prefix}: it was written by {manifest.origin}, not by this run's rank "
                f"{origin.get('rank')} (another's snapshot in its place)"
            )
        else:
            found.append(Snapshot(manifest.global_step, prefix))
    return sorted(found, key=lambda s: s.step, reverse=True), damaged


def snapshot_files(prefix: str, storage: MemoryTierStorage) -> list[str]:
    """The names of the files of the snapshot ``prefix``: its data files, then its manifest
    (the order a copy writes them in: the manifest last commits it)."""
    directory, base = os.path.split(prefix)
    names = sorted(n for n in storage.list(directory) if n.startswith(base + ".data-"))
    return [*names, base + ".index"]
