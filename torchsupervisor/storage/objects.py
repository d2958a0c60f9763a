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
* ``open_read``: ranged GETs (``object_reads.py``); nothing is downloaded whole.
* ``list``: one level below a prefix (``/`` delimited), as a directory listing.
* ``lock``: one writer per prefix: a lock object created by a conditional PUT (``If-None-Match:
  *``) that names its owner (pid, host, since) and carries a heartbeat its holder renews every
  ``lock_ttl_secs / 3`` seconds (``If-Match`` its last version: a lost lock is noticed). A lock
  whose holder ran on this host in a process that is gone, or that stayed one version for its
  holder's TTL while watched on this process's monotonic clock, is stale and taken over by a
  conditional PUT on its version; a writer that lost its lock writes nothing more
  (``object_lock.py``).
* ``open_append`` (events files): appends go to a local cache file; ``sync`` uploads the whole
  file as the object. The writer rolls to a new file at ``events_roll_bytes``, so the bytes a
  flush sends stay bounded however long the run (not the whole run's events each time).

The wire operations are those of ``ObjectClient`` (``object_client.py``); ``s3.S3Client`` and
``memory.MemoryClient`` implement them. The lock is ``object_lock.py``.

TF name: none (TF's ``gfile`` on ``gs://`` and ``s3://``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import logging
import os
import posixpath
import threading
from collections.abc import Iterable, Iterator

import crc32c

from torchsupervisor.core import threads as priority
from torchsupervisor.errors import (
    NotRegularFileError,
    OpError,
    OutsideDirectoryError,
    WriteCancelled,
)
from torchsupervisor.storage.base import (
    Appendable,
    Buffer,
    DirectoryLock,
    Readable,
    Storage,
    read_whole,
)
from torchsupervisor.storage.object_client import (
    ABSENT,
    READ_TRIES,
    ObjectClient,
    ObjectInfo,
    PreconditionFailed,
    Upload,
    read_one_version,
)
from torchsupervisor.storage.object_lock import LOCKS, lock_key, read_lock
from torchsupervisor.storage.object_reads import ObjectReadable
from torchsupervisor.storage.paths import is_url, parse_url

__all__ = ["ABSENT", "ObjectClient", "ObjectInfo", "ObjectStorage", "PreconditionFailed", "Upload"]

logger = logging.getLogger("torchsupervisor")

DEFAULT_PART_BYTES = 16 << 20
"""Part size (bytes) of a multipart upload; S3 requires at least 5 MiB (but the last)."""

DEFAULT_MAX_CONCURRENCY = 4
"""Parts of one object uploaded at once."""

DEFAULT_LOCK_TTL_SECS = 30.0
"""A writer lock unchanged for this long (seconds) is stale (``object_lock``)."""

DEFAULT_EVENTS_ROLL_BYTES = 8 << 20
"""An events file on an object store is rolled (a new one started) at about this size (bytes):
each flush uploads the current file whole, so this bounds the bytes one flush sends."""


class ObjectStorage(Storage):
    """The storage seam on one bucket of an object store; see the module docstring.

    Args:
        client: The bucket's wire operations.
        part_bytes: Multipart part size in bytes (at least 5 MiB on S3).
        max_concurrency: Parts of one object in flight at once.
        lock_ttl_secs: Seconds after its last heartbeat that a writer lock is stale.
        events_roll_bytes: Size in bytes at which an events file is rolled (a new file
            started; TensorBoard reads a run's files in order), so that a flush, which
            uploads the current file whole, sends at most about this much.

    Thread safety: every method may be called from any thread.
    """

    def __init__(
        self,
        client: ObjectClient,
        *,
        part_bytes: int = DEFAULT_PART_BYTES,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        lock_ttl_secs: float = DEFAULT_LOCK_TTL_SECS,
        events_roll_bytes: int = DEFAULT_EVENTS_ROLL_BYTES,
    ) -> None:
        if part_bytes < 1:
            raise ValueError(f"part_bytes must be positive, not {part_bytes}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be positive, not {max_concurrency}")
        self.client = client
        self.part_bytes = part_bytes
        self.max_concurrency = max_concurrency
        self.lock_ttl_secs = lock_ttl_secs
        if events_roll_bytes < 1:
            raise ValueError(f"events_roll_bytes must be positive, not {events_roll_bytes}")
        self.events_roll_bytes = events_roll_bytes

    def key(self, path: str) -> str:
        """The object key of ``path`` (``s3://b/run/a`` -> ``run/a``); ``ValueError`` when
        ``path`` is not in this storage's bucket."""
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
        """One PUT, or a multipart upload above ``part_bytes``; see ``Storage.put``.

        Raises:
            LogdirLockedError: This process lost the writer lock of the prefix ``path`` is in.
        """
        key = self.key(path)
        LOCKS.check_write(self._path(key))
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
        """Delete the object (``FileNotFoundError`` if it does not exist).

        Raises:
            LogdirLockedError: This process lost the writer lock of the prefix ``path`` is in.
        """
        key = self.key(path)
        LOCKS.check_write(self._path(key))
        self.client.head(key)
        self.client.delete(key)

    def makedirs(self, path: str) -> None:
        """Nothing: a prefix exists once an object lies below it."""
        self.key(path)

    def recover_spooled(self, directory: str) -> list[str]:
        """Upload the events files a previous run of ``directory`` left in the local spool.

        Those whose upload a stop abandoned (a store that did not answer within a preemption's
        grace period) or a kill interrupted: each is put whole, then removed from the spool.
        One that fails stays for the next try (logged).

        Returns:
            The paths uploaded.
        """
        here = self.canonical(directory)
        uploaded = []
        for spool, target in _spooled():
            if spool in _OPEN_SPOOLS or not is_url(target):
                continue
            try:
                if self.canonical(posixpath.dirname(target)) != here:
                    continue
            except ValueError:  # Another bucket or store.
                continue
            try:
                with open(spool, "rb") as f:
                    self.put(target, iter(lambda f=f: f.read(8 << 20), b""))
            except (OSError, OpError) as e:
                logger.warning("Could not upload the spooled events file %s: %s", spool, e)
                continue
            _remove_spooled(spool)
            logger.info("Uploaded %s, left in the local spool by an earlier run", target)
            uploaded.append(target)
        return uploaded

    def open_append(self, path: str) -> Appendable:
        """Appends to a local cache file; ``sync`` uploads it whole (see the module docstring)."""
        if self.is_file(path):
            raise FileExistsError(errno.EEXIST, "the object exists", path)
        return _CachedAppendable(self, path)

    # ------------------------------------------------------------------------------ reading

    def open_read(self, path: str, *, inside: str | None = None) -> Readable:
        """Ranged GETs of the object; see ``Storage.open_read``."""
        key = self.key(path)
        if inside is not None:
            directory = self.key(inside)
            parent = key.rpartition("/")[0]
            if parent != directory:
                raise OutsideDirectoryError(path, inside, self._path(parent))
        with self._regular_file(path):
            info = self.client.head(key)
        return ObjectReadable(self.client, path, key, info.size)

    @contextlib.contextmanager
    def _regular_file(self, path: str) -> Iterator[None]:
        """Tell a missing object that is a directory (a prefix of others) from a missing one."""
        try:
            yield
        except FileNotFoundError:
            if self.is_dir(path):
                raise NotRegularFileError(path, "a directory") from None
            raise

    def read_bytes(self, path: str, *, max_bytes: int) -> bytes:
        """The whole object ``path`` as one version of it; see ``Storage.read_bytes``.

        An object may be replaced while it is read (the state file is rewritten at every
        save): it is read again while that happens (``read_one_version``), and after
        ``READ_TRIES`` reads so cut short, ``OSError`` ``EAGAIN`` is raised.

        Raises:
            FileNotFoundError: It does not exist, or was deleted while it was read.
            NotRegularFileError, OSError: As ``Storage.read_bytes``.
        """
        key = self.key(path)

        def read(info: ObjectInfo) -> bytes:
            with ObjectReadable(self.client, path, key, info.size) as f:
                return read_whole(f, max_bytes=max_bytes)

        with self._regular_file(path):
            data, _, whole = read_one_version(self.client, key, read)
        if not whole:
            raise OSError(errno.EAGAIN, f"replaced {READ_TRIES} times while it was read", path)
        return data

    def list(self, directory: str) -> list[str]:
        """The objects and sub-prefixes one level below ``directory`` (empty if none)."""
        prefix = _as_prefix(self.key(directory))
        keys, prefixes = self.client.list(prefix, delimiter=True)
        names = [k[len(prefix) :] for k in keys] + [p[len(prefix) :].rstrip("/") for p in prefixes]
        return sorted(n for n in names if n)

    def list_tree(self, directory: str) -> list[str]:
        """Every object below ``directory``, relative to it, sorted."""
        prefix = _as_prefix(self.key(directory))
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
        key = self.key(path)
        if not key:
            return False
        try:
            self.client.head(key)
        except FileNotFoundError:
            return False
        return True

    def is_dir(self, path: str) -> bool:
        """True if objects lie below the prefix ``path/`` (the bucket's root always is)."""
        key = self.key(path)
        if not key:
            return True
        keys, prefixes = self.client.list(_as_prefix(key), delimiter=True)
        return bool(keys or prefixes)

    def accepts_objects(self, directory: str) -> bool:
        """True: any prefix takes objects."""
        self.key(directory)
        return True

    def size(self, path: str) -> int:
        """The object's size in bytes (HEAD)."""
        return self.client.head(self.key(path)).size

    def mtime(self, path: str) -> float:
        """The object's last modification, seconds since the epoch (HEAD)."""
        return self.client.head(self.key(path)).mtime

    def canonical(self, path: str) -> str:
        """The URL with its key normalized."""
        return self._path(self.key(path))

    # ----------------------------------------------------------------------- one writer

    def lock(self, directory: str) -> DirectoryLock:
        """The prefix's writer lock (a conditional PUT; see the module docstring)."""
        return LOCKS.acquire(self, self.canonical(directory))

    def lock_owner(self, directory: str) -> dict[str, object]:
        """What the lock object says about its writer; {} if there is none."""
        try:
            return read_lock(self.client, lock_key(self.key(directory)))[0]
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
        prefix = _as_prefix(self.key(directory))
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
        self._sender = threading.get_native_id()  # Whose CPU priority the parts go at.

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
            # At the sender's priority (the idle checkpoint writer's, or raised to training's
            # while training waits for the save: ``threads.hurry``).
            priority.follow(self._sender)
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


class _CachedAppendable(Appendable):
    """An events file: appended to a local spool file, uploaded whole at each ``sync``.

    The spool file (``spool_path``, in ``spool_dir()``) stays until its last upload went
    through: an events file a stop abandoned (a store that did not answer within the grace
    period) or a killed process left is uploaded by the next writer of the same directory
    (``ObjectStorage.recover_spooled``).
    """

    def __init__(self, storage: ObjectStorage, path: str) -> None:
        self.path = path
        self.roll_bytes = storage.events_roll_bytes
        self._storage = storage
        directory = spool_dir()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        digest = hashlib.sha256(path.encode("utf-8")).hexdigest()[:16]
        self.spool_path = os.path.join(directory, f"{digest}-{posixpath.basename(path)}")
        with open(self.spool_path + _TARGET, "w", encoding="utf-8") as f:
            f.write(path)
        self._file = open(self.spool_path, "w+b")  # noqa: SIM115
        self._uploaded = True  # Nothing written yet: nothing to keep.
        _OPEN_SPOOLS.add(self.spool_path)

    def write(self, data: Buffer) -> None:
        self._file.write(data)
        self._uploaded = False

    def sync(self) -> None:
        self._file.flush()
        self._file.seek(0)
        self._storage.put(self.path, iter(lambda: self._file.read(8 << 20), b""))
        self._file.seek(0, os.SEEK_END)
        self._uploaded = True

    def close(self) -> None:
        self._file.close()
        _OPEN_SPOOLS.discard(self.spool_path)
        if self._uploaded:  # Else kept: the next writer of the directory uploads it.
            _remove_spooled(self.spool_path)


_TARGET = ".target"  # Beside a spool file: the object it is the content of.
_OPEN_SPOOLS: set[str] = set()  # This process's spool files being written.


def spool_dir() -> str:
    """Where events files for object stores are written before their upload.

    ``$TORCHSUPERVISOR_SPOOL_DIR``, else ``$XDG_CACHE_HOME/torchsupervisor/events``, else
    ``~/.cache/torchsupervisor/events`` (the user's alone: mode 0700).
    """
    explicit = os.environ.get("TORCHSUPERVISOR_SPOOL_DIR")
    if explicit:
        return explicit
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "torchsupervisor", "events")


def _spooled() -> Iterator[tuple[str, str]]:
    """``(spool file, target URL)`` of every file in the spool."""
    try:
        names = os.listdir(spool_dir())
    except OSError:
        return
    for name in names:
        if not name.endswith(_TARGET):
            continue
        spool = os.path.join(spool_dir(), name[: -len(_TARGET)])
        try:
            with open(spool + _TARGET, encoding="utf-8") as f:
                target = f.read(4096).strip()
        except (OSError, UnicodeDecodeError):
            continue
        if os.path.isfile(spool):
            yield spool, target


def _remove_spooled(spool: str) -> None:
    for path in (spool, spool + _TARGET):
        try:
            os.remove(path)
        except OSError:
            pass
