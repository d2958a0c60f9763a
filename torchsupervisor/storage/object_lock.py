"""One writer per prefix of an object store: a lock object taken by a conditional PUT.

``<prefix>/.torchsupervisor-writer.lock`` is created with ``If-None-Match: *`` (only one writer
can), names its owner (pid, host, since, command) and carries a heartbeat that a thread renews
every ``lock_ttl_secs / 3`` seconds with ``If-Match`` on its last version. Within a process the
lock of a prefix is shared and counted (``LockTable``).

**Staleness never compares two machines' clocks.** A lock held by a process of this host is
stale when that process is gone (after up to 2 s for a killed process to finish dying), and
live while it runs. A lock held elsewhere is judged by watching it on this process's monotonic
clock: if its object changes (a heartbeat) the holder is alive and the lock is refused; if it
stays the very same version for its holder's ``lock_ttl_secs`` (the longer of its and ours),
the holder is gone and the lock is taken over by a PUT with ``If-Match`` on that version, so
two restarts cannot both take it. (A heartbeat's time was compared with this host's clock:
hosts whose clocks differed by more than the TTL, or a clock stepped back by NTP or a resumed
VM, took over a live writer's lock and both wrote one prefix.)

**A writer that lost its lock stops writing.** The holder counts its lease on its own monotonic
clock from its last successful renewal: once its heartbeat is refused (another writer took the
lock) or has not gone through for 0.9 of the TTL (a partition: another writer may take it
after the full TTL), the lock is lost. From then on every write of that storage into the
prefix raises ``LogdirLockedError`` naming the other writer, and the callbacks given to
``on_lost`` run (the Supervisor stops training with that error).

TF name: none (TF had no writer lock).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import crc32c

from torchsupervisor.errors import LogdirLockedError
from torchsupervisor.storage.base import DirectoryLock
from torchsupervisor.storage.lock import LOCK_FILENAME, describe_owner
from torchsupervisor.storage.object_client import (
    ABSENT,
    ObjectClient,
    PreconditionFailed,
    read_one_version,
)

if TYPE_CHECKING:
    from torchsupervisor.storage.objects import ObjectStorage

__all__ = ["LOCKS", "LockTable", "lock_key", "read_lock"]

logger = logging.getLogger("torchsupervisor")

_MAX_LOCK_BYTES = 4096
_EXIT_GRACE_SECS = 2.0  # How long a holder on this host may take to die after a kill.


def lock_key(directory_key: str) -> str:
    """The lock object's key for the prefix ``directory_key``."""
    return f"{directory_key}/{LOCK_FILENAME}" if directory_key else LOCK_FILENAME


def read_lock(client: ObjectClient, key: str) -> tuple[dict[str, object], str]:
    """The owner a lock object names (``{}`` if unreadable) and its etag.

    Read as one version (``read_one_version``): the holder's heartbeat may replace the object
    while it is read, and a cut JSON text would read as no owner. If it was replaced during
    every try, the last read is returned with the etag of the version before it, so that a
    conditional PUT on it fails rather than takes a lock renewed meanwhile.

    Raises:
        FileNotFoundError: The lock object does not exist (or was released meanwhile).
    """
    data, info, _ = read_one_version(
        client, key, lambda info: client.get_range(key, 0, min(info.size, _MAX_LOCK_BYTES))
    )
    try:
        owner = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        owner = {}
    return (owner if isinstance(owner, dict) else {}), info.etag


_LEASE_FRACTION = 0.9  # Of the TTL: how long a holder trusts its lock after a renewal.
_WATCH_POLLS = 10  # Looks at a lock held elsewhere during its TTL.
_TELL_WAIT_SECS = 10.0  # How long a refused write waits for the loss's callbacks to have run.


def _holder_ttl(owner: dict[str, object], ours: float) -> float:
    """The TTL a watcher must wait out: the holder's (its lock says), or ours if longer."""
    theirs = owner.get("ttl")
    if isinstance(theirs, (int, float)) and not isinstance(theirs, bool) and theirs > 0:
        return max(float(theirs), ours)
    return ours


def _local_pid(owner: dict[str, object]) -> int | None:
    """The holder's pid if it ran on this host, else None."""
    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname() or not isinstance(pid, int):
        return None
    return pid


def _alive(pid: int) -> bool:
    """True if process ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_for_exit(pid: int, secs: float) -> None:
    """Give a killed holder on this host ``secs`` seconds to finish dying."""
    deadline = time.monotonic() + secs
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


class LockTable:
    """The writer locks this process holds, shared and counted per prefix (a URL).

    One table for the process (``LOCKS``): two ``ObjectStorage`` objects on one bucket (the
    Supervisor's and a ``Saver``'s own) share the lock of a prefix instead of refusing each
    other, as handles on one local directory do.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held: dict[str, _HeldLock] = {}

    def acquire(self, storage: ObjectStorage, directory: str) -> DirectoryLock:
        """A handle on the lock of ``directory`` (a canonical URL), taken with ``storage``
        unless this process holds it already."""
        if not self._count(directory):
            # Taken outside the mutex: watching a lock held elsewhere may take its TTL, and
            # this process's writes (``check_write``) must not wait for that.
            try:
                taken = _HeldLock(storage, directory)
            except LogdirLockedError:
                if not self._count(directory):  # Not another thread of ours meanwhile.
                    raise
            else:
                with self._mutex:
                    held = self._held.get(directory)
                    mine = held is not None and held.pid == os.getpid()
                    if not mine:
                        taken.count = 1
                        self._held[directory] = taken
                    else:
                        held.count += 1
                if mine:
                    taken.release()
        return _ObjectLockHandle(self, directory)

    def _count(self, directory: str) -> bool:
        """Count one more handle on this process's lock of ``directory``; False if none."""
        with self._mutex:
            held = self._held.get(directory)
            if held is None or held.pid != os.getpid():
                return False
            held.count += 1
            return True

    def held(self, directory: str) -> _HeldLock | None:
        """This process's lock of ``directory``, if it holds it."""
        with self._mutex:
            held = self._held.get(directory)
        return held if held is not None and held.pid == os.getpid() else None

    def check_write(self, url: str) -> None:
        """Raise the ``LogdirLockedError`` of a lost lock whose prefix holds ``url``."""
        held = [h for d, h in tuple(self._held.items()) if url.startswith(d.rstrip("/") + "/")]
        for lock in held:
            if lock.pid == os.getpid():
                lock.check()

    def release(self, directory: str) -> None:
        with self._mutex:
            held = self._held.get(directory)
            if held is None or held.pid != os.getpid():
                return
            held.count -= 1
            if held.count > 0:
                return
            del self._held[directory]
        held.release()


LOCKS = LockTable()
"""The object-store writer locks of this process."""


class _ObjectLockHandle(DirectoryLock):
    def __init__(self, table: LockTable, directory: str) -> None:
        self._table = table
        self.directory = directory
        self._released = False
        self._mutex = threading.Lock()

    def release(self) -> None:
        with self._mutex:
            if self._released:
                return
            self._released = True
        self._table.release(self.directory)

    def on_lost(self, callback: Callable[[LogdirLockedError], object]) -> None:
        """Call ``callback(error)`` if the lock is lost (at once if it is already)."""
        held = self._table.held(self.directory)
        if held is not None:
            held.on_lost(callback)


class _HeldLock:
    """The lock object of one prefix, taken and kept alive by a heartbeat thread."""

    def __init__(self, storage: ObjectStorage, directory: str) -> None:
        self.pid = os.getpid()
        self.count = 0
        self._client = storage.client
        self._ttl = storage.lock_ttl_secs
        self._directory = directory
        self._key = lock_key(storage.key(directory))
        self._owner: dict[str, object] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)[:512],
        }
        self._mutex = threading.Lock()
        self._lost: LogdirLockedError | None = None
        self._callbacks: list[Callable[[LogdirLockedError], object]] = []
        # Set once the callbacks of the loss have run: a write refused for the loss is refused
        # after them, so what a callback does (stop training) comes first.
        self._told = threading.Event()
        self._teller: int | None = None
        self._etag = self._take()
        self._renewed = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name="torchsupervisor-lock-heartbeat", daemon=True
        )
        self._thread.start()

    def _body(self) -> bytes:
        return json.dumps({**self._owner, "heartbeat": time.time(), "ttl": self._ttl}).encode()

    def _put(self, only_if: str) -> str:
        body = self._body()
        return self._client.put_object(self._key, body, crc=crc32c.crc32c(body), only_if=only_if)

    def _refuse(self, owner: dict[str, object], why: str) -> LogdirLockedError:
        return LogdirLockedError(
            f"Another process is writing to {self._directory}: {describe_owner(owner)}. One "
            f"writer per log directory: stop it, or use another directory ({why}).",
            path=self._client.url.join(self._key),
            directory=self._directory,
            owner=owner,
        )

    def _take(self) -> str:
        for _ in range(3):  # Each turn loses only to a writer that took the lock meanwhile.
            try:
                return self._put(ABSENT)
            except PreconditionFailed:
                pass
            try:
                owner, etag = read_lock(self._client, self._key)
            except FileNotFoundError:
                continue  # Released meanwhile: try to create it again.
            pid = _local_pid(owner)
            if pid == os.getpid():
                raise self._refuse(owner, "it is this process, through another lock table")
            if pid is not None:
                _wait_for_exit(pid, _EXIT_GRACE_SECS)  # A restart right after a kill -9.
                if _alive(pid):
                    raise self._refuse(owner, "it runs on this host")
            else:
                etag = self._watch(owner, etag)  # Raises if its holder renews it.
            logger.warning(
                "Taking over the writer lock of %s from a writer that is gone: %s",
                self._directory,
                describe_owner(owner),
            )
            try:
                return self._put(etag)
            except (PreconditionFailed, FileNotFoundError):
                continue
        raise LogdirLockedError(
            f"Another process is writing to {self._directory}: the writer lock changed hands "
            "while this process tried to take it. One writer per log directory.",
            path=self._client.url.join(self._key),
            directory=self._directory,
            owner={},
        )

    def _watch(self, owner: dict[str, object], etag: str) -> str:
        """Watch a lock held elsewhere for its holder's TTL on this process's monotonic clock.

        Returns:
            Its version, unchanged for the TTL: its holder is gone.

        Raises:
            LogdirLockedError: It changed (a heartbeat): its holder is alive.
        """
        ttl = _holder_ttl(owner, self._ttl)
        deadline = time.monotonic() + ttl
        logger.warning(
            "The writer lock of %s is held by %s: watching it for up to %g s (a writer that is "
            "gone no longer renews it)",
            self._directory,
            describe_owner(owner),
            ttl,
        )
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return etag
            time.sleep(min(left, ttl / _WATCH_POLLS))
            try:
                now = self._client.head(self._key).etag
            except FileNotFoundError:
                return ABSENT  # Released meanwhile: the takeover creates it.
            if now != etag:
                raise self._refuse(owner, "its heartbeat renews the lock")

    def _beat(self) -> None:
        while not self._stop.wait(self._ttl / 3):
            try:
                self._etag = self._put(self._etag)
                self._renewed = time.monotonic()
            except PreconditionFailed:
                try:
                    other = read_lock(self._client, self._key)[0]
                except Exception:
                    other = {}
                self._lose(f"its writer lock was taken by {describe_owner(other)}", other)
                return
            except Exception as e:  # A transient failure: the next beat tries again.
                if time.monotonic() - self._renewed > _LEASE_FRACTION * self._ttl:
                    self._lose(f"its writer lock could not be renewed for {self._ttl:g} s ({e})")
                    return
                logger.warning("Could not renew the writer lock of %s: %s", self._directory, e)

    def _lose(self, why: str, owner: dict[str, object] | None = None) -> None:
        error = LogdirLockedError(
            f"This process lost the writer lock of {self._directory}: {why}. It writes nothing "
            "more there (two writers would corrupt each other's checkpoints).",
            path=self._client.url.join(self._key),
            directory=self._directory,
            owner=owner or {},
        )
        with self._mutex:
            if self._lost is not None:
                return  # The heartbeat and a write's check both saw it: the first one tells.
            self._lost = error
            self._teller = threading.get_ident()
            callbacks = list(self._callbacks)
        logger.error("%s", error)
        try:
            for callback in callbacks:
                try:
                    callback(error)
                except Exception:
                    logger.exception(
                        "A callback of the lost writer lock of %s failed", self._directory
                    )
        finally:
            self._told.set()

    def check(self) -> None:
        """Raise the ``LogdirLockedError`` of a lost lock (a write must not go on).

        Also a lease that ran out on this clock without a refused heartbeat (the heartbeat
        thread stalled): the lock counts as lost from then on.
        """
        lost = self._lost
        if lost is None and time.monotonic() - self._renewed > _LEASE_FRACTION * self._ttl:
            if not self._stop.is_set():
                self._lose(f"its writer lock was not renewed for {self._ttl:g} s")
            lost = self._lost
        if lost is not None:
            if self._teller != threading.get_ident():
                self._told.wait(_TELL_WAIT_SECS)
            raise lost

    def on_lost(self, callback: Callable[[LogdirLockedError], object]) -> None:
        with self._mutex:
            lost = self._lost
            if lost is None:
                self._callbacks.append(callback)
        if lost is not None:
            callback(lost)

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._lost is not None:
            return  # Another writer's lock now: not ours to remove.
        try:
            self._client.delete(self._key, if_match=self._etag)
        except (PreconditionFailed, FileNotFoundError):
            pass
        except Exception as e:
            logger.warning(
                "Could not remove the writer lock of %s (it expires %g s after its last "
                "heartbeat): %s",
                self._directory,
                self._ttl,
                e,
            )
