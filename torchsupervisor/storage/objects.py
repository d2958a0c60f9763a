"""``ObjectStorage``: the storage seam on an object store (S3, or the in-process ``memory://``).

An object store has no rename, no append and no fsync: an object is written whole by one PUT
(or one multipart upload, completed by a last request) and is then visible whole, or not at
all. That is exactly what ``Storage.put`` promises, so the commit protocol above runs unchanged:
shards first, the manifest (``P.index``) last, then the state file. A checkpoint is visible only
once its manifest exists.

* ``put``: one PUT for an object up to ``part_bytes``; above, a multipart upload whose parts
  (``part_bytes`` each) are sent by ``max_concurrency`` threads, at most that many parts in
  memory. Every PUT and part carries its CRC-32C, which the server checks before it stores the
  bytes (a bit flipped on the way fails the request, never lands). A failed or cancelled
  multipart upload is aborted; one a crash interrupted is a leftover that ``clean_leftovers``
  aborts at the next start.
* ``open_read``: ranged GETs; nothing is downloaded whole.
* ``list``: one level below a prefix (``/`` delimited), as a directory listing.
* ``lock``: one writer per prefix: a lock object created by a conditional PUT (``If-None-Match:
  *``) that names its owner (pid, host, since) and carries a heartbeat its holder renews every
  ``lock_ttl_secs / 3`` seconds (``If-Match`` its last version: a lost lock is noticed). A lock
  whose holder ran on this host in a process that is gone, or whose heartbeat is older than
  ``lock_ttl_secs``, is stale and taken over by a conditional PUT on its version, so a crashed
  run never blocks its own restart for long and two restarts cannot both take it.
* ``open_append`` (events files): appends go to a local cache file; ``sync`` uploads the whole
  file as the object.

The wire operations are those of ``ObjectClient``; ``s3.S3Client`` and ``memory.MemoryClient``
implement them.

TF name: none (TF's ``gfile`` on ``gs://`` and ``s3://``).
"""

from __future__ import annotations

import abc
import concurrent.futures
import datetime
import errno
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import crc32c

from torchsupervisor.errors import (
    LogdirLockedError,
    NotRegularFileError,
    OutsideDirectoryError,
    WriteCancelled,
)
from torchsupervisor.storage.base import Appendable, Buffer, DirectoryLock, Readable, Storage
from torchsupervisor.storage.lock import LOCK_FILENAME, describe_owner
from torchsupervisor.storage.paths import URL, parse_url

__all__ = ["ABSENT", "ObjectClient", "ObjectInfo", "ObjectStorage", "PreconditionFailed", "Upload"]

logger = logging.getLogger("torchsupervisor")

DEFAULT_PART_BYTES = 16 << 20
"""Part size (bytes) of a multipart upload; S3 requires at least 5 MiB (but the last)."""

DEFAULT_MAX_CONCURRENCY = 4
"""Parts of one object uploaded at once."""

READ_PART_BYTES = 8 << 20
"""Bytes per ranged GET of a read."""

READ_AHEAD_PARTS = 4
"""Parts fetched ahead of a sequential reader (with the one being read: the GETs in flight)."""

DEFAULT_LOCK_TTL_SECS = 30.0
"""A writer lock whose heartbeat is older than this (seconds) is stale."""

_MAX_LOCK_BYTES = 4096
_EXIT_GRACE_SECS = 2.0  # How long a holder on this host may take to die after a kill.


ABSENT = "*"
"""``put_object(only_if=ABSENT)``: create the object only if it does not exist."""


class PreconditionFailed(Exception):
    """A conditional request failed: the object exists (``If-None-Match``) or changed
    (``If-Match``)."""


@dataclass(frozen=True)
class ObjectInfo:
    """What a HEAD request tells of an object.

    Attributes:
        size: Bytes.
        mtime: Last modification, seconds since the epoch.
        etag: The version tag (for ``If-Match``).
    """

    size: int
    mtime: float
    etag: str


@dataclass(frozen=True)
class Upload:
    """A multipart upload in progress: ``key`` and the store's ``upload_id``."""

    key: str
    upload_id: str


class ObjectClient(abc.ABC):
    """The wire operations of one bucket; keys are relative to it.

    Errors: a missing object raises ``FileNotFoundError``; a failed condition
    ``PreconditionFailed``; anything else an ``OSError`` whose message names the key (and the
    store's error code). Transient errors are retried inside the client.

    Thread safety: every method may be called from any thread.
    """

    url: URL
    """The bucket (``key`` is empty)."""

    @abc.abstractmethod
    def put_object(self, key: str, data: Buffer, *, crc: int, only_if: str | None = None) -> str:
        """Store ``data`` as ``key`` (CRC-32C ``crc`` checked by the store); return its etag.

        ``only_if``: None, unconditional; ``ABSENT``, only if ``key`` does not exist
        (``If-None-Match: *``); an etag, only if ``key`` is that version (``If-Match``).
        """

    @abc.abstractmethod
    def create_upload(self, key: str) -> Upload:
        """Start a multipart upload of ``key`` (parts checked by CRC-32C)."""

    @abc.abstractmethod
    def upload_part(self, upload: Upload, number: int, data: Buffer, *, crc: int) -> object:
        """Send part ``number`` (1-based); return what ``complete_upload`` needs of it."""

    @abc.abstractmethod
    def complete_upload(self, upload: Upload, parts: list[object]) -> None:
        """Make the object of ``upload`` from ``parts`` (in order) visible."""

    @abc.abstractmethod
    def abort_upload(self, upload: Upload) -> None:
        """Discard ``upload`` and its parts."""

    @abc.abstractmethod
    def list_uploads(self, prefix: str) -> list[Upload]:
        """The multipart uploads in progress of keys starting with ``prefix``."""

    @abc.abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes of ``key`` from ``offset`` (fewer at the end)."""

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo:
        """Size, time and version of ``key``."""

    @abc.abstractmethod
    def list(self, prefix: str, *, delimiter: bool) -> tuple[list[str], list[str]]:
        """``(keys, common prefixes)`` under ``prefix``; with ``delimiter``, one level
        (prefixes end with ``/``); without, every key below."""

    @abc.abstractmethod
    def delete(self, key: str, *, if_match: str | None = None) -> None:
        """Delete ``key`` (no error if it is missing, unless ``if_match`` is given)."""


class ObjectStorage(Storage):
    """The storage seam on one bucket of an object store; see the module docstring.

    Args:
        client: The bucket's wire operations.
        part_bytes: Multipart part size in bytes (at least 5 MiB on S3).
        max_concurrency: Parts of one object in flight at once.
        lock_ttl_secs: Seconds after its last heartbeat that a writer lock is stale.

    Thread safety: every method may be called from any thread.
    """

    def __init__(
        self,
        client: ObjectClient,
        *,
        part_bytes: int = DEFAULT_PART_BYTES,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        lock_ttl_secs: float = DEFAULT_LOCK_TTL_SECS,
    ) -> None:
        if part_bytes < 1:
            raise ValueError(f"part_bytes must be positive, not {part_bytes}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be positive, not {max_concurrency}")
        self.client = client
        self.part_bytes = part_bytes
        self.max_concurrency = max_concurrency
        self.lock_ttl_secs = lock_ttl_secs
        self._locks = _LockTable(self)

    def _key(self, path: str) -> str:
        url = parse_url(os.fspath(path))
        if (url.scheme, url.bucket) != (self.client.url.scheme, self.client.url.bucket):
            raise ValueError(f"{path} is not in {self.client.url.root}")
        return url.key

    def _path(self, key: str) -> str:
        return self.client.url.join(key)

    # ------------------------------------------------------------------------------ writing

    def put(
        self, path: str, chunks: Iterable[Buffer], *, cancel: threading.Event | None = None
    ) -> None:
        """One PUT, or a multipart upload above ``part_bytes``; see ``Storage.put``."""
        key = self._key(path)
        part = bytearray()
        upload: _MultipartUpload | None = None
        try:
            for chunk in chunks:
                if cancel is not None and cancel.is_set():
                    raise WriteCancelled(path)
                view = memoryview(chunk).cast("B")
                while len(view):
                    room = self.part_bytes - len(part)
                    part += view[:room]
                    view = view[room:]
                    if len(part) == self.part_bytes and len(view):
                        upload = upload or _MultipartUpload(self, key)
                        upload.send(part)
                        part = bytearray()
            if cancel is not None and cancel.is_set():
                raise WriteCancelled(path)
            if upload is None:
                self.client.put_object(key, part, crc=crc32c.crc32c(part))
            else:
                upload.send(part)
                upload.complete(cancel)
        except BaseException:
            if upload is not None:
                upload.abort()
            raise

    def delete(self, path: str) -> None:
        """Delete the object (``FileNotFoundError`` if it does not exist)."""
        key = self._key(path)
        self.client.head(key)
        self.client.delete(key)

    def makedirs(self, path: str) -> None:
        """Nothing: a prefix exists once an object lies below it."""
        self._key(path)

    def open_append(self, path: str) -> Appendable:
        """Appends to a local cache file; ``sync`` uploads it whole (see the module docstring)."""
        if self.is_file(path):
            raise FileExistsError(errno.EEXIST, "the object exists", path)
        return _CachedAppendable(self, path)

    # ------------------------------------------------------------------------------ reading

    def open_read(self, path: str, *, inside: str | None = None) -> Readable:
        """Ranged GETs of the object; see ``Storage.open_read``."""
        key = self._key(path)
        if inside is not None:
            directory = self._key(inside)
            parent = key.rpartition("/")[0]
            if parent != directory:
                raise OutsideDirectoryError(path, inside, self._path(parent))
        try:
            info = self.client.head(key)
        except FileNotFoundError:
            if self.is_dir(path):
                raise NotRegularFileError(path, "a directory") from None
            raise
        return _ObjectReadable(self.client, path, key, info.size)

    def list(self, directory: str) -> list[str]:
        """The objects and sub-prefixes one level below ``directory`` (empty if none)."""
        prefix = _as_prefix(self._key(directory))
        keys, prefixes = self.client.list(prefix, delimiter=True)
        names = [k[len(prefix) :] for k in keys] + [p[len(prefix) :].rstrip("/") for p in prefixes]
        return sorted(n for n in names if n)

    def list_tree(self, directory: str) -> list[str]:
        """Every object below ``directory``, relative to it, sorted."""
        prefix = _as_prefix(self._key(directory))
        keys, _ = self.client.list(prefix, delimiter=False)
        found = sorted(k[len(prefix) :] for k in keys if len(k) > len(prefix))
        if not found and not self.is_dir(directory):
            raise FileNotFoundError(errno.ENOENT, "no object below this prefix", directory)
        return found

    def exists(self, path: str) -> bool:
        """True if ``path`` is an object or a prefix with objects below it."""
        return self.is_file(path) or self.is_dir(path)

    def is_file(self, path: str) -> bool:
        """True if the object exists."""
        key = self._key(path)
        if not key:
            return False
        try:
            self.client.head(key)
        except FileNotFoundError:
            return False
        return True

    def is_dir(self, path: str) -> bool:
        """True if objects lie below the prefix ``path/`` (the bucket's root always is)."""
        key = self._key(path)
        if not key:
            return True
        keys, prefixes = self.client.list(_as_prefix(key), delimiter=True)
        return bool(keys or prefixes)

    def accepts_objects(self, directory: str) -> bool:
        """True: any prefix takes objects."""
        self._key(directory)
        return True

    def size(self, path: str) -> int:
        """The object's size in bytes (HEAD)."""
        return self.client.head(self._key(path)).size

    def mtime(self, path: str) -> float:
        """The object's last modification, seconds since the epoch (HEAD)."""
        return self.client.head(self._key(path)).mtime

    def canonical(self, path: str) -> str:
        """The URL with its key normalized."""
        return self._path(self._key(path))

    # ----------------------------------------------------------------------- one writer

    def lock(self, directory: str) -> DirectoryLock:
        """The prefix's writer lock (a conditional PUT; see the module docstring)."""
        return self._locks.acquire(self.canonical(directory))

    def lock_owner(self, directory: str) -> dict[str, object]:
        """What the lock object says about its writer; {} if there is none."""
        try:
            return _read_lock(self.client, _lock_key(self._key(directory)))[0]
        except (FileNotFoundError, PreconditionFailed):
            return {}

    def leftovers(self, directory: str) -> list[str]:
        """The unfinished multipart uploads of objects directly in ``directory``."""
        return [self._path(u.key) for u in self._uploads(directory)]

    def clean_leftovers(self, directory: str) -> list[str]:
        """Abort the unfinished multipart uploads in ``directory``; return their paths."""
        removed = []
        for upload in self._uploads(directory):
            self.client.abort_upload(upload)
            removed.append(self._path(upload.key))
        return removed

    def _uploads(self, directory: str) -> list[Upload]:
        prefix = _as_prefix(self._key(directory))
        found = self.client.list_uploads(prefix)
        return sorted((u for u in found if "/" not in u.key[len(prefix) :]), key=_upload_order)


def _upload_order(upload: Upload) -> tuple[str, str]:
    return (upload.key, upload.upload_id)


def _as_prefix(key: str) -> str:
    return f"{key}/" if key else ""


class _MultipartUpload:
    """The parts of one object, sent by a pool of at most ``max_concurrency`` threads."""

    def __init__(self, storage: ObjectStorage, key: str) -> None:
        self._client = storage.client
        self._upload = self._client.create_upload(key)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            storage.max_concurrency, thread_name_prefix="torchsupervisor-upload"
        )
        self._room = threading.Semaphore(storage.max_concurrency)
        self._futures: list[concurrent.futures.Future[object]] = []

    def send(self, part: bytearray) -> None:
        """Queue ``part`` (taken over, not copied); blocks while the pool is full."""
        self._room.acquire()
        number = len(self._futures) + 1
        try:
            future = self._pool.submit(self._send, number, part)
        except BaseException:
            self._room.release()
            raise
        self._futures.append(future)
        for done in self._futures:
            if done.done() and done.exception() is not None:
                raise done.exception()  # type: ignore[misc]

    def _send(self, number: int, part: bytearray) -> object:
        try:
            return self._client.upload_part(self._upload, number, part, crc=crc32c.crc32c(part))
        finally:
            self._room.release()

    def complete(self, cancel: threading.Event | None) -> None:
        """Wait for every part and make the object visible."""
        parts = [f.result() for f in self._futures]
        self._pool.shutdown()
        if cancel is not None and cancel.is_set():
            raise WriteCancelled(self._upload.key)
        self._client.complete_upload(self._upload, parts)

    def abort(self) -> None:
        """Stop sending and discard the parts (a failure here is logged: a leftover)."""
        for future in self._futures:
            future.cancel()
        self._pool.shutdown(wait=True)
        try:
            self._client.abort_upload(self._upload)
        except Exception as e:
            logger.warning("Could not abort the upload of %s: %s", self._upload.key, e)


class _ObjectReadable(Readable):
    """Ranged GETs with read-ahead: aligned parts fetched by a few threads ahead of the reader.

    A read is served from parts of ``READ_PART_BYTES`` (aligned on that size), fetched in
    parallel. Once reads are sequential (each starts where the last ended, or ``read_ahead``
    named the start), the ``READ_AHEAD_PARTS`` parts after the one read are fetched too, so a
    restore keeps several requests in flight, as a multipart download does; a lone small read
    (a header, one tensor) fetches only its own part. Parts behind the reader are dropped.
    """

    def __init__(self, client: ObjectClient, path: str, key: str, size: int) -> None:
        super().__init__(path, size)
        self._client = client
        self._key = key
        self._mutex = threading.Lock()
        self._parts: dict[int, concurrent.futures.Future[bytes]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._expected = -1  # Where a sequential reader reads next.
        self._closed = False

    def _part(self, index: int) -> concurrent.futures.Future[bytes]:
        """The future of part ``index``, submitted if needed (call with the mutex held)."""
        found = self._parts.get(index)
        if found is None:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    READ_AHEAD_PARTS + 1, thread_name_prefix="torchsupervisor-download"
                )
            start = index * READ_PART_BYTES
            length = min(READ_PART_BYTES, self.size - start)
            found = self._pool.submit(self._client.get_range, self._key, start, length)
            self._parts[index] = found
        return found

    def readinto(self, view: memoryview, offset: int) -> int:
        length = min(len(view), self.size - offset)
        if length <= 0:
            return 0
        first, last = offset // READ_PART_BYTES, (offset + length - 1) // READ_PART_BYTES
        with self._mutex:
            if self._closed:
                raise ValueError(f"{self.path} is closed")
            for stale in [i for i in self._parts if i < first]:
                del self._parts[stale]  # Not cancelled: a reader on another thread may wait.
            wanted = [self._part(i) for i in range(first, last + 1)]
            if offset == self._expected:  # A sequential reader: fetch ahead of it.
                self._ahead(last + 1)
            self._expected = offset + length
        done = 0
        for index, future in zip(range(first, last + 1), wanted, strict=True):
            data = future.result()
            begin = max(offset, index * READ_PART_BYTES) - index * READ_PART_BYTES
            piece = data[begin : begin + length - done]
            if not piece:
                break
            view[done : done + len(piece)] = piece
            done += len(piece)
        return done

    def read_ahead(self, offset: int) -> None:
        """Start fetching the parts from ``offset`` on (a reader about to read from there)."""
        with self._mutex:
            if not self._closed and 0 <= offset < self.size:
                self._ahead(offset // READ_PART_BYTES)
                self._expected = offset

    def _ahead(self, index: int) -> None:
        end = (self.size - 1) // READ_PART_BYTES
        for i in range(index, min(index + READ_AHEAD_PARTS, end + 1)):
            self._part(i)

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            for future in self._parts.values():
                future.cancel()
            self._parts.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class _CachedAppendable(Appendable):
    """An events file: appended to a local temporary file, uploaded whole at each ``sync``."""

    def __init__(self, storage: ObjectStorage, path: str) -> None:
        self.path = path
        self._storage = storage
        self._file = tempfile.TemporaryFile(prefix="torchsupervisor-cache-")  # noqa: SIM115

    def write(self, data: Buffer) -> None:
        self._file.write(data)

    def sync(self) -> None:
        self._file.flush()
        self._file.seek(0)
        self._storage.put(self.path, iter(lambda: self._file.read(8 << 20), b""))
        self._file.seek(0, os.SEEK_END)

    def close(self) -> None:
        self._file.close()


# ------------------------------------------------------------------------------ the lock


def _lock_key(directory_key: str) -> str:
    return f"{_as_prefix(directory_key)}{LOCK_FILENAME}"


def _read_lock(client: ObjectClient, key: str) -> tuple[dict[str, object], str]:
    info = client.head(key)
    data = client.get_range(key, 0, min(info.size, _MAX_LOCK_BYTES))
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


class _LockTable:
    """The writer locks this process holds on one bucket, shared and counted per prefix."""

    def __init__(self, storage: ObjectStorage) -> None:
        self._storage = storage
        self._mutex = threading.Lock()
        self._held: dict[str, _HeldLock] = {}

    def acquire(self, directory: str) -> DirectoryLock:
        with self._mutex:
            held = self._held.get(directory)
            if held is None or held.pid != os.getpid():
                held = _HeldLock(self._storage, directory)
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


class _ObjectLockHandle(DirectoryLock):
    def __init__(self, table: _LockTable, directory: str) -> None:
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
        self._key = _lock_key(storage._key(directory))
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
                owner, etag = _read_lock(self._client, self._key)
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
