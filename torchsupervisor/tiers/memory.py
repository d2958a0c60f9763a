"""The memory tier: the newest snapshots of a rank's state in host memory that outlives it.

Every ``every_n_steps`` steps, at a step boundary, the training thread copies the state
straight into a data file of the rank's directory on a tmpfs (``tiers/memory_root``), mapped
in memory (a free slot file, ``storage/slots``: the stall, one copy), and a writer thread of
the tier commits that snapshot as a checkpoint: same layout, same CRC-32C table, same commit
protocol as a checkpoint on disk (the data file put by a rename of its slot, the manifest
last; a snapshot is visible only once complete). A state on a GPU is copied into pinned host
memory and written into the files by the writer. ``slots`` snapshots fit: the one
being written and the ``slots - 1`` newest committed ones, so a kill during a write leaves
the previous snapshot, and the tier's memory is at most ``slots`` x the state's bytes.

A snapshot is started only once the previous one is committed, and a ``GlobalStep`` counts a
step only once the snapshot of the step before it is committed (``increment`` waits for it;
it is done already unless writing a snapshot takes longer than a step). So a process killed
at any moment has a committed snapshot of the last step it counted, or of the one before:
a hard failure loses at most the step it was running. (With a plain tensor as the global
step there is no such wait: a step faster than a snapshot's write may then lose two; and the
step is read at every boundary to know whether a snapshot is due, a device sync for a CUDA
tensor. Use a ``GlobalStep``.)

A sharded state (FSDP2): every rank keeps its own part (``tiers/local_shards``: its local
shards as plain tensors) in its own directory, at its own boundaries, and the ranks agree at a
restart on a step every rank holds (``supervisor/sharded_memory``). Ranks write at their own
pace, up to two snapshots apart (a rank runs at most one step ahead of the slowest, whose
snapshot may be in flight), so a sharded tier keeps two more: ``slots + 2`` snapshots.

Generations: the rank's directory is tagged with the run id of the log directory
(``checkpoint/run_id``). Snapshots of another run (a log directory removed and made again)
are deleted unread. At each start every snapshot but the one restored is deleted: a newer
one belongs to a timeline the restart abandoned (it failed its checks, or the disk tier won),
and must never be restored later. A snapshot whose manifest names another step than its file
name, or whose recorded origin (run id and rank) is not this rank's of this run, is refused
as damaged.

With ``MemoryTierConfig.local_disk``, each committed snapshot is also offered to a local-disk
tier (``tiers/local_disk``) that copies some of them to this node's disk at an interval of its
own, for a restart after the node's memory is gone; ``tiers`` lists both for the restore.

Thread safety: ``snapshots`` and ``restore`` on the calling thread before ``start``; after it,
the snapshot runs on the training thread at its step boundaries and ``close`` on that thread.

TF name: none (TF had no memory tier).
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchsupervisor.checkpoint.files import remove_checkpoint
from torchsupervisor.checkpoint.recovery import scan_checkpoints
from torchsupervisor.checkpoint.run_id import read_run_id
from torchsupervisor.checkpoint.saver import Saver
from torchsupervisor.core import checks
from torchsupervisor.core.global_step import GlobalStep, read_step
from torchsupervisor.core.state import flatten_state
from torchsupervisor.errors import CorruptCheckpointError
from torchsupervisor.storage.private import MemoryTierStorage, SharedCounter
from torchsupervisor.storage.slots import SlotFiles
from torchsupervisor.tiers.local_disk import LocalDiskConfig, LocalDiskTier
from torchsupervisor.tiers.local_shards import local_session
from torchsupervisor.tiers.memory_root import MEMORY_ROOT_ENV, memory_root, rank_directory
from torchsupervisor.tiers.tier import (
    RUN_ID_FILE,
    Snapshot,
    SnapshotTier,
    committed_snapshots,
    open_rank_directory,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchsupervisor.core.clock import Clock
    from torchsupervisor.core.global_step import GlobalStepLike
    from torchsupervisor.core.session import Session

__all__ = [
    "HELD_IN_MEMORY",
    "MEMORY_TIER",
    "MemoryTier",
    "MemoryTierConfig",
    "RankHoldings",
    "held_in_memory",
]

MEMORY_TIER = "memory"
"""The memory tier's name in logs, listings and ``Session.restored_tier``."""
HELD_IN_MEMORY = "this node's memory tier"
"""What holds a preemption's stop step when ``hold_stop`` succeeded, in log lines."""

_BASENAME = "model.ckpt"
_HELD_FILE = re.compile(r"(rank|peer)-(\d+)/")  # A rank's own snapshots, or a peer copy.
_REACHED_FILE = "reached_step"  # The global step at the newest step boundary (a counter).
_LAST_COPY_SECS = 120.0  # The longest a close waits for the local-disk tier's last copy.
_MANIFEST_SLACK_BYTES = 1 << 20  # Room for the manifests and the state file, per slot.

logger = logging.getLogger("torchsupervisor")


@dataclass(frozen=True)
class MemoryTierConfig:
    """How the memory tier is kept (``Supervisor(memory_tier=...)``).

    Args:
        every_n_steps: Take a snapshot every this many steps (1: every step).
        slots: Snapshots that fit in memory at once, the one being written included (at least
            2: a kill during a write leaves the previous one). Memory used: at most
            ``slots`` x the state's bytes.
        root: The file system to keep the snapshots on (a tmpfs); None:
            ``$TORCHSUPERVISOR_MEMORY_ROOT`` or ``/dev/shm``.
        peer_every_secs: A replicated run (DDP) on several nodes: the chief sends its newest
            snapshot to its peer at most once per this many seconds (0: each one, as soon as
            the send before is done). A copy costs a pass over the state's bytes on both
            nodes and the network's bandwidth; a lost chief's node then loses at most about
            this long of steps (a process kill still at most one step: its node's memory
            keeps every snapshot). A sharded run (FSDP2) sends every snapshot (each rank's
            copies must be of the steps the others keep).
        local_disk: Also copy the snapshots to this node's disk at an interval of their own
            (``tiers/local_disk``: a restart after the node's memory is gone, a reboot, reads
            them instead of the checkpoint directory); None: no local-disk tier.

    Raises:
        TypeError, ValueError: For an argument of the wrong type or out of range, naming it.

    TF name: none.
    """

    every_n_steps: int = 1
    slots: int = 2
    root: str | None = None
    peer_every_secs: float = 0.0
    local_disk: LocalDiskConfig | None = None

    def __post_init__(self) -> None:
        checks.check_int("every_n_steps", self.every_n_steps, minimum=1)
        checks.check_int("slots", self.slots, minimum=2)
        checks.check_path("root", self.root)
        checks.check_number("peer_every_secs", self.peer_every_secs, allow_inf=False)
        if self.local_disk is not None and not isinstance(self.local_disk, LocalDiskConfig):
            raise TypeError(
                f"local_disk must be a LocalDiskConfig or None, got {self.local_disk!r} "
                f"({type(self.local_disk).__name__})"
            )


class MemoryTier:
    """One rank's memory tier of one run (module docstring).

    Args:
        config: Its interval, slots and file system.
        logdir: The run's log directory (the snapshots' directory is derived from it).
        run_id: The run id of ``logdir`` (``checkpoint.run_id``); snapshots tagged with
            another are deleted.
        rank: This process's rank (its own directory).
        sharded: The state holds DTensors: keep this rank's local shards (module docstring).
        world_size: The ranks of a sharded run (recorded in each snapshot's origin).
        clock: Time source of the tier's saver.

    Attributes:
        rank: The rank whose snapshots these are.
        directory: This rank's directory of snapshots.
        save_path: The snapshots' prefix family (``<directory>/model.ckpt``).

    Raises:
        FileNotFoundError: The file system to keep the snapshots on does not exist
            (``config.root``, else ``$TORCHSUPERVISOR_MEMORY_ROOT``, else ``/dev/shm``).
        PermissionError: A level of the directory is a link, not the user's, or open to
            others (``MemoryTierStorage.prepare_directory``).
        OSError: The directory cannot be made.
    """

    name = MEMORY_TIER

    def __init__(
        self,
        config: MemoryTierConfig,
        logdir: str,
        run_id: str,
        *,
        rank: int = 0,
        sharded: bool = False,
        world_size: int = 1,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.sharded = sharded
        self.storage = MemoryTierStorage()
        root = memory_root(config.root)
        if not os.path.isdir(os.path.dirname(root)):
            raise FileNotFoundError(
                errno.ENOENT,
                "The memory tier's file system is not a directory (MemoryTierConfig.root, "
                f"else ${MEMORY_ROOT_ENV}, else /dev/shm: a tmpfs)",
                os.path.dirname(root),
            )
        self.directory = open_rank_directory(root, logdir, rank, run_id, self.storage, MEMORY_TIER)
        self.save_path = os.path.join(self.directory, _BASENAME)
        SlotFiles.remove_leftovers(self.directory)  # Of a process killed while staging.
        self.storage.slots = SlotFiles(self.directory, self.storage.file_mode)
        self.origin: dict[str, str | int] = {"run_id": run_id, "rank": rank}
        """What every snapshot of this tier records as its ``origin`` (checked at restore)."""
        if sharded:
            self.origin["world_size"] = world_size
        self.slots = config.slots + (2 if sharded else 0)
        """Snapshots this tier holds at most, the one being written included."""
        self.saver = Saver(
            max_to_keep=self.slots - 1,
            incremental=False,
            storage=self.storage,
            clock=clock,
            origin=self.origin,
            staging_buffers=self.storage.slots,  # One copy a snapshot: into its file.
            row_blocks=False,  # Restored by this rank, as it was taken: never by rows.
        )
        self._session: Session | None = None
        self._target: Any = None  # What the saver saves: the session, or its local view.
        self._global_step: GlobalStepLike | None = None
        self._last_step: int | None = None
        self._reported: set[str] = set()
        self._reached: SharedCounter | None = None
        self._committed_step: int | None = None  # Of the newest snapshot committed.
        # Snapshots handed to the saver, and those whose ``_done`` ran: a future is done
        # before its callbacks run, so ``wait`` waits for both counts to meet.
        self._taken = self._settled = 0
        self._settling = threading.Condition()
        self.damaged: list[str] = []
        """What ``snapshots`` refused, as ``"<prefix>: <why>"``."""
        self.on_commit: Callable[[str], object] | None = None
        """Called with each snapshot's prefix once committed (on the writer thread): the
        peer replica's sender."""
        self.local_disk: LocalDiskTier | None = None
        """The local-disk tier fed from this tier's snapshots (``config.local_disk``)."""
        if config.local_disk is not None:
            self.local_disk = LocalDiskTier(
                config.local_disk, logdir, run_id, self.origin, rank=rank, sharded=sharded
            )

    @property
    def tiers(self) -> list[SnapshotTier]:
        """The tiers a restart tries besides the checkpoint directory, the faster first:
        this one, then its local-disk tier (if any)."""
        return [self] if self.local_disk is None else [self, self.local_disk]

    # ---------------------------------------------------------------------------- restoring

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def reached_step(self) -> int | None:
        """The global step the run had reached at its newest step boundary with this tier on
        (kept in memory through a kill); ``-1 - step`` once it stopped with a snapshot of
        its last boundary's step committed; None if unknown."""
        try:
            return self.storage.read_counter(self._path(_REACHED_FILE))
        except OSError:
            return None

    def snapshots(self) -> list[Snapshot]:
        """The committed snapshots, newest first; a damaged one is left out (``damaged``).

        Reads only the manifests (small). A manifest that cannot be read or names another step
        than its file is reported in ``damaged``; the checksums of the data are checked by
        ``restore``.
        """
        found, self.damaged = committed_snapshots(self.directory, self.storage, self.origin)
        return found

    def restore(self, sess: Session, prefix: str) -> None:
        """Load the snapshot ``prefix`` into ``sess``'s state after checking every byte.

        Raises:
            CorruptCheckpointError: A file is missing, truncated or fails its checksum, the
                manifest names another step than the file or another origin, or it is not a
                committed snapshot (deleted meanwhile); the state is then unchanged.
            NotFoundError, InvalidArgumentError: As ``Saver.restore``: the state does not
                match it.
        """
        if prefix not in {s.prefix for s in self.snapshots()}:
            why = next((d for d in self.damaged if d.startswith(prefix + ":")), None)
            raise CorruptCheckpointError(why or f"{prefix}: not a committed snapshot")
        self.saver.restore(local_session(sess) if self.sharded else sess, prefix)

    # ------------------------------------------------------------------------------ running

    def start(
        self, sess: Session, global_step: GlobalStepLike, restored: str | None = None
    ) -> None:
        """Keep only the snapshot restored (if from this tier), check the room, and take a
        snapshot at ``sess``'s step boundaries from now on.

        Args:
            sess: The session whose state is snapshotted (its state materialized).
            global_step: The run's global step.
            restored: The snapshot of this tier the session was restored from, or None.

        A second ``start`` (a session made again after an error) moves the tier to the new
        session.

        Raises:
            MemoryTierFullError: The file system cannot hold ``slots`` x the state's bytes;
                the message names the sizes.
        """
        self._detach()
        self.wait()  # The snapshot in flight, and its bookkeeping, before the scan.
        kept = []
        for snap in self.snapshots():
            if snap.prefix == restored:
                kept.append(snap.prefix)
            else:
                self._remove(snap.prefix)
        for entry in self.damaged:
            self._remove(entry.split(": ", 1)[0])
        self.saver.recover_last_checkpoints(kept)
        target = local_session(sess) if self.sharded else sess
        _, tensors = flatten_state(target.state)
        state_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        needed = self.slots * (state_bytes + _MANIFEST_SLACK_BYTES)
        self.storage.check_room(self.directory, needed)
        if self.local_disk is not None:
            self.local_disk.start(read_step(global_step), state_bytes)
        self._log_restart(sess, read_step(global_step))
        self._reached = self.storage.open_counter(self._path(_REACHED_FILE))
        self._session = sess
        self._target = target
        self._global_step = global_step
        self._last_step = read_step(global_step) if restored else None
        sess.boundary.call_each(self._at_boundary)
        if isinstance(global_step, GlobalStep):
            global_step.gate_increments(self._committed)
        logger.info(
            "Memory tier at %s: a snapshot every %d step(s), %d slots (at most %.1f MB)",
            self.directory,
            self.config.every_n_steps,
            self.slots,
            needed / 1e6,
        )

    def _log_restart(self, sess: Session, step: int | None) -> None:
        """Log which tier the session resumed from and how many steps the last run lost."""
        reached = self.reached_step()
        if step is None or sess.restored_checkpoint is None:
            return
        if reached is None:
            if sess.restored_tier == MEMORY_TIER:  # A peer copy: its node kept the record.
                logger.warning(
                    "Resumed at step %d from the memory tier, from a peer copy (this node has "
                    "no record of the last run's steps)",
                    step,
                )
            return
        if reached < 0:  # It stopped with its last step snapshotted (``close``).
            stopped = -reached - 1
            lost = max(0, stopped - step)
            (logger.warning if lost else logger.info)(
                "Resumed at step %d from the %s tier: %d step%s lost (the last run stopped at "
                "step %d)",
                step,
                sess.restored_tier,
                lost,
                "" if lost == 1 else "s",
                stopped,
            )
            return
        lost = max(0, reached - step) + 1  # The step it was running at the kill, too.
        logger.warning(
            "Resumed at step %d from the %s tier after a hard failure: at most %d step%s lost "
            "(the last run's newest step boundary was at step %d)",
            step,
            sess.restored_tier,
            lost,
            "" if lost == 1 else "s",
            reached,
        )

    def _remove(self, prefix: str) -> None:
        remove_checkpoint(prefix, storage=self.storage)

    def _at_boundary(self) -> None:
        """Take a snapshot if ``every_n_steps`` passed since the last one (training thread)."""
        assert self._global_step is not None and self._reached is not None
        step = read_step(self._global_step)
        if step is not None:
            self._reached.set(step)
        last = self._last_step
        if step is None or (last is not None and 0 <= step - last < self.config.every_n_steps):
            return
        self._snapshot(step)

    def _snapshot(self, step: int) -> None:
        self._last_step = step
        try:
            future = self.saver.save_async(self._target, self.save_path, global_step=step)
        except (OSError, ValueError) as error:
            self._report(step, error)
            return
        with self._settling:
            self._taken += 1
        future.add_done_callback(lambda f: self._done(f, step))

    def snapshot_now(self) -> None:
        """Take a snapshot of the current step now, whatever ``every_n_steps`` says, unless
        the last one is of this step (training thread, at a step boundary).

        A preemption's stop calls it before the final checkpoint: the memory tier, fast,
        holds the last step first, and a final checkpoint that does not fit in the time left
        loses nothing a restart on this node needs.
        """
        if self._session is None or self._global_step is None:
            return
        step = read_step(self._global_step)
        if step is not None and step != self._last_step:
            self._snapshot(step)

    def hold_stop(self, step: int | None, timeout_secs: float | None) -> bool:
        """A preemption's stop: snapshot the current step now (``snapshot_now``), wait up to
        ``timeout_secs`` for it; True if the tier then holds ``step`` committed (the final
        checkpoint may be skipped when it cannot fit: ``CheckpointDriver.final``'s
        ``held_elsewhere``). With a local-disk tier, the snapshot is then copied there too,
        in what is left of ``timeout_secs`` (memory and the local disk first, then the
        checkpoint directory). Both front ends call it (Supervisor, MonitoredSession).
        """
        started = time.monotonic()
        self.snapshot_now()
        held = self.wait(timeout_secs) and step is not None and self._committed_step == step
        if held and step is not None and self.local_disk is not None:
            left = None if timeout_secs is None else timeout_secs - (time.monotonic() - started)
            if left is None or left > 0:
                self.local_disk.flush(step, left)
        return held

    def _done(self, future: concurrent.futures.Future[Any], step: int) -> None:
        try:
            error = future.exception()
            if error is not None:
                self._report(step, error)
                return
            self._committed_step = step
            if self.local_disk is not None:
                self.local_disk.offer(future.result())
            on_commit = self.on_commit
            if on_commit is not None:
                on_commit(future.result())
        finally:
            with self._settling:
                self._settled += 1
                self._settling.notify_all()

    def _report(self, step: int, error: BaseException) -> None:
        """Log a failed snapshot: a warning the first time for each kind of error."""
        kind = type(error).__name__
        log = logger.debug if kind in self._reported else logger.warning
        self._reported.add(kind)
        log(
            "The memory tier's snapshot at step %d failed (the checkpoints on disk are not "
            "affected): %s",
            step,
            error,
        )

    def _committed(self) -> None:
        """Before the global step counts a step: wait for the snapshot being written."""
        self.saver.wait()

    def _detach(self) -> None:
        """Stop snapshotting at the session's boundaries."""
        step = self._global_step
        if isinstance(step, GlobalStep):
            previous = step.gate_increments(None)
            if previous is not None and previous != self._committed:
                step.gate_increments(previous)  # Another tier's: left in place.
        if self._session is not None:
            self._session.boundary.remove_each(self._at_boundary)
            self._session = self._target = None
        if self._reached is not None:
            self._reached.close()
            self._reached = None

    @property
    def committed_step(self) -> int | None:
        """The step of the newest snapshot this tier committed in this session, or None."""
        return self._committed_step

    def wait(self, timeout_secs: float | None = None) -> bool:
        """Wait for the snapshot being written and its bookkeeping (``committed_step``, the
        offer to the local disk and the peer); True when none is in flight."""
        started = time.monotonic()
        if not self.saver.wait(timeout_secs):
            return False
        left = (
            None if timeout_secs is None else max(0.0, timeout_secs - (time.monotonic() - started))
        )
        with self._settling:
            return self._settling.wait_for(lambda: self._settled >= self._taken, left)

    def close(self, *, free: bool = False) -> None:
        """Stop taking snapshots, wait for the one being written; with ``free``, delete
        every snapshot (a clean exit whose final checkpoint holds the same step).

        Raises:
            OSError: A file could not be deleted (what is left is deleted at the next start).
        """
        self.wait()
        last = self._last_step
        if self._reached is not None and last is not None and self._committed_step == last:
            self._reached.set(-1 - last)  # Stopped with its last step held: nothing lost.
        self._detach()
        if self.local_disk is not None:
            self.local_disk.close(free=free, timeout_secs=_LAST_COPY_SECS)
        self.saver.close()
        if self.storage.slots is not None:
            self.storage.slots.close()
        if free:
            self.storage.remove_directory(memory_root(self.config.root), self.directory)


@dataclass(frozen=True)
class RankHoldings:
    """What the memory tier holds for one rank of a run (``held_in_memory``).

    Attributes:
        rank: The rank.
        directory: Its directory of snapshots.
        same_run: Its run id is the log directory's (else a restart deletes it unread);
            for a copy, True (its manifests' origin says whose run it is).
        prefixes: Its committed snapshots (newest first by their manifests' steps).
        copy: A peer copy kept on this node of another node's snapshots of ``rank``
            (``peer-<rank>``), not this node's own (``rank-<rank>``).
    """

    rank: int
    directory: str
    same_run: bool
    prefixes: tuple[str, ...]
    copy: bool = False


def held_in_memory(logdir: str, root: str | None = None) -> list[RankHoldings]:
    """What the memory tier holds for the run of ``logdir`` on this node, by rank (its own
    snapshots, then the peer copies it keeps of other nodes'); reads, never writes.

    Args:
        logdir: The run's log directory.
        root: The memory tier's file system (``MemoryTierConfig.root``); None: the default.
    """
    storage = MemoryTierStorage()
    run_dir = os.path.dirname(rank_directory(memory_root(root), logdir, 0))
    try:
        files = storage.list_tree(run_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    run_id = read_run_id(logdir)
    held = []
    found = {m.groups() for m in map(_HELD_FILE.match, files) if m}
    ranks = sorted(int(rank) for kind, rank in found if kind == "rank")
    copies = sorted(int(rank) for kind, rank in found if kind == "peer")
    for rank in ranks:
        directory = os.path.join(run_dir, f"rank-{rank}")
        try:
            tag = storage.read_bytes(os.path.join(directory, RUN_ID_FILE), max_bytes=256)
        except FileNotFoundError:
            tag = b""
        prefixes = tuple(scan_checkpoints(directory, storage=storage))
        same = run_id is not None and tag.decode("ascii", "replace").strip() == run_id
        held.append(RankHoldings(rank, directory, same, prefixes))
    for rank in copies:
        directory = os.path.join(run_dir, f"peer-{rank}")
        prefixes = tuple(scan_checkpoints(directory, storage=storage))
        held.append(RankHoldings(rank, directory, True, prefixes, copy=True))
    return held
