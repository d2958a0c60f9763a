"""One writer per prefix of an object store: a lock object taken by a conditional PUT.

``<prefix>/.torchsupervisor-writer.lock`` is created with ``If-None-Match: *`` (only one writer
can), names its owner (pid, host, since, command) and carries a heartbeat that a thread renews
every ``lock_ttl_secs / 3`` seconds with ``If-Match`` on its last version. A lock is stale when
its holder ran on this host in a process that is gone (after up to 2 s for a killed process to
finish dying), or when its heartbeat is older than ``lock_ttl_secs``; a stale lock is taken
over by a PUT with ``If-Match`` on its version, so two restarts cannot both take it. Within a
process the lock of a prefix is shared and counted (``LockTable``).

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


def _stale(owner: dict[str, object], ttl: float, now: float) -> bool:
    pid = _local_pid(owner)
    if pid is not None and pid != os.getpid() and not _alive(pid):
        return True
    beat = owner.get("heartbeat")
    return not isinstance(beat, (int, float)) or now - float(beat) > ttl


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
        with self._mutex:
            held = self._held.get(directory)
            if held is None or held.pid != os.getpid():
                held = _HeldLock(storage, directory)
                self._held[directory] = held
            held.count += 1
        return _ObjectLockHandle(self, directory)

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


class _HeldLock:
    """The lock object of one prefix, taken and kept alive by a heartbeat thread."""

    def __init__(self, storage: ObjectStorage, directory: str) -> None:
        self.pid = os.getpid()
        self.count = 0
        self._client = storage.client
        self._ttl = storage.lock_ttl_secs
        self._directory = directory
        self._key = lock_key(storage._key(directory))
        self._owner: dict[str, object] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)[:512],
        }
        self._etag = self._take()
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
            if pid is not None and pid != os.getpid():
                _wait_for_exit(pid, _EXIT_GRACE_SECS)  # A restart right after a kill -9.
            if not _stale(owner, self._ttl, time.time()):
                raise LogdirLockedError(
                    f"Another process is writing to {self._directory}: "
                    f"{describe_owner(owner)}. One writer per log directory: stop it, or use "
                    f"another directory (a writer that died leaves a lock that expires "
                    f"{self._ttl:g} s after its last heartbeat).",
                    path=self._client.url.join(self._key),
                    directory=self._directory,
                    owner=owner,
                )
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

    def _beat(self) -> None:
        while not self._stop.wait(self._ttl / 3):
            try:
                self._etag = self._put(self._etag)
            except PreconditionFailed:
                logger.error(
                    "The writer lock of %s was taken by another writer: two runs may now "
                    "write to it",
                    self._directory,
                )
                return
            except Exception as e:  # A transient failure: the next beat tries again.
                logger.warning("Could not renew the writer lock of %s: %s", self._directory, e)

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
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
