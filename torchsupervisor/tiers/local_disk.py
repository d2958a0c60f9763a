"""The local-disk tier: copies of the memory tier's snapshots on this node's disk, at their own
interval, for a restart after the node's memory is gone (a reboot, a lost tmpfs).

Between the memory tier (every step, gone with the node's memory) and the checkpoint
directory (``save_model_secs``, often a bucket: slow to write and to read back), a local disk
(an NVMe drive) survives a reboot and reads back fast. The tier takes nothing from the
training thread: each snapshot the memory tier commits is offered to it (on the memory tier's
writer thread), and when its interval has passed (``every_secs``, ``every_n_steps``, or both:
whichever comes first), a thread of its own copies the snapshot's files as they are, in the
kernel (``LocalStorage.put_copied``: ``sendfile(2)``, no pass through this process's memory),
under the commit protocol: each data file by a temporary name, fsync and rename, the manifest
last, so a copy is visible only once complete. The bytes are not read again: they carry the
snapshot's CRC-32C table, and a restore checks every byte as for any checkpoint. One copy
runs at a time, of the newest snapshot committed when it starts (never a backlog); while it
runs, the memory tier's snapshot being copied is kept from becoming a slot again
(``MemoryTierStorage.reading``: one more snapshot's memory while a copy lasts).

Layout, files and generations are the memory tier's: ``<directory>/torchsupervisor-<uid>/
<run key>/rank-<rank>/``, directories 0700 and files 0600, tagged with the run id, the same
manifest origin (run id, rank) checked at restore. Retention keeps the ``keep`` newest copies
(so the disk holds at most ``keep + 1`` snapshots while a copy is written). At a start every
copy newer than the step the session resumed at is deleted (a timeline the restart abandoned).
At a clean end whose final checkpoint holds the last step the copies are deleted, as the
memory tier's snapshots are; at any other end the newest snapshot is copied at once.

Thread safety: ``offer`` from any thread; the others on the thread that owns the memory tier.

TF name: none (TF had no tiers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchsupervisor.checkpoint.files import checkpoint_step, remove_checkpoint
from torchsupervisor.checkpoint.saver import Saver
from torchsupervisor.core import checks, threads
from torchsupervisor.errors import CorruptCheckpointError
from torchsupervisor.storage.private import MemoryTierStorage
from torchsupervisor.tiers.local_shards import local_session
from torchsupervisor.tiers.memory_root import memory_root
from torchsupervisor.tiers.tier import (
    Snapshot,
    committed_snapshots,
    open_rank_directory,
    snapshot_files,
)

if TYPE_CHECKING:
    from torchsupervisor.core.session import Session

__all__ = ["LOCAL_TIER", "LocalDiskConfig", "LocalDiskTier"]

LOCAL_TIER = "local"
"""The local-disk tier's name in logs, listings and ``Session.restored_tier``."""

_BASENAME = "model.ckpt"

logger = logging.getLogger("torchsupervisor")


@dataclass(frozen=True)
class LocalDiskConfig:
    """How the local-disk tier is kept (``MemoryTierConfig(local_disk=...)``).

    Args:
        directory: A directory on this node's disk (made if missing; the copies go under
            ``<directory>/torchsupervisor-<uid>/``).
        every_secs: Copy the newest memory snapshot when this many seconds passed since the
            last copy began (0: not by time).
        every_n_steps: Copy it when this many steps passed since the last copy (0: not by
            steps). With both 0, every snapshot is copied.
        keep: The copies kept (at least 1); the disk holds at most ``keep + 1`` snapshots
            (bytes: that many times the state's) while a copy is written.

    Raises:
        TypeError, ValueError: For an argument of the wrong type or out of range, naming it.

    TF name: none.
    """

    directory: str
    every_secs: float = 300.0
    every_n_steps: int = 0
    keep: int = 2

    def __post_init__(self) -> None:
        checks.check_path("directory", self.directory, allow_none=False)
        if not os.fspath(self.directory):
            raise ValueError("directory must not be empty")
        checks.check_number("every_secs", self.every_secs, allow_inf=False)
        checks.check_int("every_n_steps", self.every_n_steps, minimum=0)
        checks.check_int("keep", self.keep, minimum=1)


class LocalDiskTier:
    """One rank's local-disk tier of one run (module docstring).

    Args:
        config: Its directory, interval and retention.
        logdir: The run's log directory (the copies' directory is derived from it).
        run_id: The run id of ``logdir``; copies tagged with another are deleted.
        origin: What the memory tier's manifests record as their origin (checked at
            restore: a copy of another run or rank is refused).
        rank: This process's rank (its own directory).
        sharded: The snapshots hold this rank's local shards (``tiers/local_shards``).

    Attributes:
        directory: This rank's directory of copies.
        copied_step: The step of the newest copy committed by this process, or None.

    Raises:
        PermissionError: A level of the directory is a link, not the user's, or open to others.
        OSError: The directory cannot be made.
    """

    name = LOCAL_TIER

    def __init__(
        self,
        config: LocalDiskConfig,
        logdir: str,
        run_id: str,
        origin: dict[str, str | int],
        *,
        rank: int = 0,
        sharded: bool = False,
    ) -> None:
        if sharded and not config.every_n_steps:
            raise ValueError(
                "the local-disk tier of a sharded run copies by steps (every rank must copy "
                "the same steps): set LocalDiskConfig.every_n_steps"
            )
        self.config = config
        self.sharded = sharded
        self.storage = MemoryTierStorage()
        os.makedirs(config.directory, exist_ok=True)
        self._root = memory_root(os.fspath(config.directory))
        self.directory = open_rank_directory(
            self._root, logdir, rank, run_id, self.storage, LOCAL_TIER
        )
        self.save_path = os.path.join(self.directory, _BASENAME)
        self.origin = origin
        self._saver = Saver(incremental=False, storage=self.storage, origin=origin)
        self.damaged: list[str] = []
        """What ``snapshots`` refused, as ``"<prefix>: <why>"``."""
        self.copied_step: int | None = None
        self._cond = threading.Condition()
        self._latest: str | None = None  # The newest snapshot offered (copied at a close).
        self._pending: _Pinned | None = None  # The snapshot due, its files open.
        self._last_step: int | None = None  # Of the last snapshot chosen (or the start's).
        self._not_before = 0.0  # ``time.monotonic`` when ``every_secs`` will have passed.
        self._closing = False
        self._flush = False  # At the close: copy what is offered at once.
        self._failures: set[str] = set()
        self._failed_step: int | None = None  # Of the last copy that failed.
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------------------- restoring

    def snapshots(self) -> list[Snapshot]:
        """The committed copies, newest first; a damaged one is left out (``damaged``).

        Reads only the manifests; the data's checksums are checked by ``restore``.
        """
        found, self.damaged = committed_snapshots(self.directory, self.storage, self.origin)
        return found

    def restore(self, sess: Session, prefix: str) -> None:
        """Load the copy ``prefix`` into ``sess``'s state after checking every byte.

        Raises:
            CorruptCheckpointError: A file is missing, truncated or fails its checksum, the
                manifest names another step or origin, or it is not a committed copy; the
                state is then unchanged.
            NotFoundError, InvalidArgumentError: As ``Saver.restore``: the state does not
                match it.
        """
        if prefix not in {s.prefix for s in self.snapshots()}:
            why = next((d for d in self.damaged if d.startswith(prefix + ":")), None)
            raise CorruptCheckpointError(why or f"{prefix}: not a committed copy")
        self._saver.restore(local_session(sess) if self.sharded else sess, prefix)

    # ------------------------------------------------------------------------------ running

    def start(self, step: int | None, state_bytes: int) -> None:
        """Delete the copies newer than ``step`` (the session's, once restored) and the
        damaged ones, check the room, and copy the memory tier's snapshots from now on.

        Args:
            step: The global step the session resumed or began at (None: unknown: every
                copy is kept).
            state_bytes: The bytes of one snapshot's tensors.

        Raises:
            MemoryTierFullError: The disk cannot hold ``keep + 1`` copies; the message names
                the sizes.
        """
        self.close_copier()
        for snap in self.snapshots():
            if step is not None and snap.step > step:
                remove_checkpoint(snap.prefix, storage=self.storage)
        for entry in self.damaged:
            remove_checkpoint(entry.split(": ", 1)[0], storage=self.storage)
        needed = (self.config.keep + 1) * (state_bytes + (1 << 20))
        self.storage.check_room(
            self.directory,
            needed,
            tier=LOCAL_TIER,
            advice="give it room, keep fewer copies (LocalDiskConfig.keep), or name another "
            "directory",
        )
        with self._cond:
            if self._pending is not None:
                self._pending.close()
            self._last_step = step
            self._not_before = time.monotonic() + self.config.every_secs
            self._latest, self._pending, self._closing, self._flush = None, None, False, False
        self._thread = threading.Thread(
            target=self._run, name="torchsupervisor-local-disk", daemon=True
        )
        self._thread.start()
        logger.info(
            "Local-disk tier at %s: a copy of the memory tier every %s, %d kept (at most %.1f MB)",
            self.directory,
            self._interval_text(),
            self.config.keep,
            needed / 1e6,
        )

    def _interval_text(self) -> str:
        c = self.config
        parts = [f"{c.every_secs:g} s"] if c.every_secs and not self.sharded else []
        parts += [f"{c.every_n_steps} steps"] if c.every_n_steps else []
        return " or ".join(parts) or "snapshot"

    def offer(self, prefix: str) -> None:
        """A snapshot the memory tier committed (its writer thread): when the interval has
        passed, open its files now (so that they stay readable whatever the memory tier
        deletes meanwhile) and copy it next, in place of one due before and not yet begun."""
        step = checkpoint_step(prefix)
        with self._cond:
            self._latest = prefix
            self._cond.notify_all()  # A ``flush`` may wait for this offer.
            if self._is_due(step):
                self._last_step = step
                self._not_before = time.monotonic() + self.config.every_secs
                pinned = _Pinned.open(prefix)  # A few opens; None if deleted already.
                if pinned is not None:
                    if self._pending is not None:
                        self._pending.close()
                    self._pending = pinned

    def _is_due(self, step: int) -> bool:
        """Whether the snapshot of ``step`` is to be copied (under the lock). By steps, the
        first snapshot ``every_n_steps`` past the last one chosen: every rank of a sharded run
        chooses the same steps (which is why a sharded run copies by steps only)."""
        c, last = self.config, self._last_step
        if c.every_n_steps and (last is None or step - last >= c.every_n_steps):
            return True
        if c.every_secs and not self.sharded:
            return time.monotonic() >= self._not_before
        return not c.every_n_steps  # No interval: every snapshot.

    def _next(self) -> _Pinned | None:
        """The snapshot to copy next; None: closed. At a close with ``flush``: the one due,
        if any, then the newest offered unless copied already (the steps a sharded run's
        ranks copy alike come first)."""
        with self._cond:
            while self._pending is None and not self._closing:
                self._cond.wait()  # A ``flush`` may wake it too.
            pinned, self._pending = self._pending, None
            if pinned is not None:
                return pinned
            latest, self._latest = self._latest, None
            copied = self.copied_step
            if not self._flush or latest is None:
                return None
            if copied is not None and checkpoint_step(latest) <= copied:
                return None
            return _Pinned.open(latest)

    def _run(self) -> None:
        threads.lower(19)  # Behind training (not SCHED_IDLE: a kill must not wait for it).
        while (pinned := self._next()) is not None:
            try:
                with pinned:
                    self._copy(pinned)
                with self._cond:
                    self._cond.notify_all()  # A ``flush`` may wait for it.
            except Exception as e:
                with self._cond:
                    self._failed_step = checkpoint_step(pinned.prefix)
                    self._cond.notify_all()  # A ``flush`` waiting for it gives up.
                kind = type(e).__name__
                (logger.debug if kind in self._failures else logger.warning)(
                    "Local-disk tier: %s could not be copied to %s (the other tiers are not "
                    "affected): %s",
                    pinned.prefix,
                    self.directory,
                    e,
                )
                self._failures.add(kind)

    def _copy(self, pinned: _Pinned) -> None:
        """Copy a memory snapshot here (data files, then the manifest), then keep the newest
        ``keep`` copies."""
        target = os.path.join(self.directory, os.path.basename(pinned.prefix))
        try:
            for name, fd, size in pinned.files:
                self.storage.put_copied(os.path.join(self.directory, name), fd, size)
        except BaseException:
            remove_checkpoint(target, storage=self.storage)
            raise
        self.copied_step = checkpoint_step(pinned.prefix)
        for old in self.snapshots()[self.config.keep :]:
            remove_checkpoint(old.prefix, storage=self.storage)

    def flush(self, step: int, timeout_secs: float | None) -> bool:
        """Copy the snapshot of ``step`` now, whatever the interval says, once the memory
        tier offered it, and wait for the copy at most ``timeout_secs`` (a preemption's stop:
        memory and the local disk first, then the checkpoint directory if the time left
        allows). True once a copy of ``step`` (or of a newer one) is committed here.
        """
        deadline = None if timeout_secs is None else time.monotonic() + timeout_secs
        asked = None  # The step of the snapshot asked for.
        with self._cond:
            while not self._holds(step):
                if self._thread is None or (asked is not None and self._failed_step == asked):
                    return False
                latest = self._latest
                if asked is None and latest is not None and checkpoint_step(latest) >= step:
                    asked, self._failed_step = checkpoint_step(latest), None
                    pending = self._pending
                    if pending is None or pending.prefix != latest:
                        pinned = _Pinned.open(latest)
                        if pinned is None:
                            return False
                        if pending is not None:
                            pending.close()
                        self._pending = pinned
                        self._cond.notify_all()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def _holds(self, step: int) -> bool:
        return self.copied_step is not None and self.copied_step >= step

    # ------------------------------------------------------------------------------ closing

    def close_copier(self, timeout_secs: float | None = None, *, flush: bool = False) -> None:
        """Stop copying; with ``flush``, copy the newest snapshot offered first (waiting at
        most ``timeout_secs`` for it)."""
        thread, self._thread = self._thread, None
        with self._cond:
            self._closing, self._flush = True, flush and thread is not None
            if not self._flush:
                self._latest = None
                if self._pending is not None:
                    self._pending.close()
                    self._pending = None
            self._cond.notify_all()
        if thread is None:
            return
        thread.join(timeout_secs)
        if thread.is_alive():
            logger.warning(
                "Local-disk tier: the last copy into %s did not end within %s s",
                self.directory,
                timeout_secs,
            )

    def close(self, *, free: bool = False, timeout_secs: float | None = None) -> None:
        """Stop copying. With ``free`` (a clean end whose final checkpoint holds the last
        step), delete every copy; else copy the newest snapshot offered first.

        Raises:
            OSError: A file could not be deleted (what is left is deleted at the next start).
        """
        self.close_copier(timeout_secs, flush=not free)
        self._saver.close()
        if free:
            self.storage.remove_directory(self._root, self.directory)


class _Pinned:
    """A memory snapshot's files, open (data files, then the manifest), each kept from
    becoming a slot of the memory tier again while open (``MemoryTierStorage.reading``)."""

    def __init__(self, prefix: str, stack: contextlib.ExitStack) -> None:
        self.prefix = prefix
        self.files: list[tuple[str, int, int]] = []  # (name, file descriptor, size)
        self._stack = stack

    @classmethod
    def open(cls, prefix: str) -> _Pinned | None:
        """Open the files of ``prefix``; None when one is gone (retention deleted it)."""
        source = MemoryTierStorage()
        directory = os.path.dirname(prefix)
        stack = contextlib.ExitStack()
        pinned = cls(prefix, stack)
        try:
            for name in snapshot_files(prefix, source):
                path = os.path.join(directory, name)
                stack.enter_context(source.reading(path))
                f = stack.enter_context(open(path, "rb"))  # noqa: SIM115 (the stack closes it)
                pinned.files.append((name, f.fileno(), os.fstat(f.fileno()).st_size))
        except OSError as e:
            stack.close()
            logger.debug("Local-disk tier: %s is gone before its copy: %s", prefix, e)
            return None
        return pinned

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> _Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
