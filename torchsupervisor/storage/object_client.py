"""The wire operations of an object store, as ``ObjectStorage`` needs them (``ObjectClient``).

Six operations and nothing else: PUT with a precondition, multipart uploads, ranged GET, HEAD,
LIST and DELETE. ``s3.S3Client`` (boto3), ``gcs.GCSClient`` (google-cloud-storage) and
``memory.MemoryClient`` implement them; an ``az://`` client would too.

TF name: none.
"""

from __future__ import annotations

import abc
import errno
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torchsupervisor.storage.base import Buffer
from torchsupervisor.storage.paths import URL

__all__ = [
    "ABSENT",
    "READ_TRIES",
    "UPLOADS_PREFIX",
    "ObjectClient",
    "ObjectInfo",
    "PreconditionFailed",
    "Upload",
    "UploadsAsObjects",
    "hide_uploads",
    "merge_options",
    "read_one_version",
    "upload_prefix",
    "uploads_found",
]


ABSENT = "*"
"""``put_object(only_if=ABSENT)``: create the object only if it does not exist."""

READ_TRIES = 3
"""Reads of a small object (a lock, a state file) that its writer replaced while it was read
(its etag changed between the HEAD before and the one after): then the reader gives up
(``read_one_version``)."""


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

    endpoint: str = ""
    """Where the store is reached (for messages)."""

    def missing_bucket(self, what: str = "bucket") -> FileNotFoundError:
        """The error for a bucket (or container) that does not exist, naming it and where."""
        return FileNotFoundError(
            errno.ENOENT,
            f"the {what} {self.url.bucket!r} does not exist at {self.endpoint}",
            self.url.root,
        )

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


UPLOADS_PREFIX = ".torchsupervisor-uploads/"
"""For stores without S3's listable multipart uploads (GCS, Azure): where an upload in progress
leaves its trace (its parts, or a marker), at the top of the bucket, outside every run's
prefix: ``UPLOADS_PREFIX + <key> + "/" + <upload id> + "/" + <name>``."""


def upload_prefix(upload: Upload) -> str:
    """Where the objects of ``upload`` live (below ``UPLOADS_PREFIX``), ending with ``/``."""
    return f"{UPLOADS_PREFIX}{upload.key}/{upload.upload_id}/"


def uploads_found(keys: list[str]) -> list[Upload]:
    """The uploads that the keys below ``UPLOADS_PREFIX`` belong to (each once, in order)."""
    found: dict[tuple[str, str], None] = {}
    for key in keys:
        target, upload_id, _name = key[len(UPLOADS_PREFIX) :].rsplit("/", 2)
        found[(target, upload_id)] = None
    return [Upload(target, upload_id) for target, upload_id in found]


def hide_uploads(prefix: str, keys: list[str], prefixes: list[str]) -> tuple[list[str], list[str]]:
    """A listing of ``prefix`` without the uploads' objects (unless ``prefix`` is theirs)."""
    if prefix.startswith(UPLOADS_PREFIX):
        return keys, prefixes
    return (
        [k for k in keys if not k.startswith(UPLOADS_PREFIX)],
        [p for p in prefixes if p != UPLOADS_PREFIX],
    )


class UploadsAsObjects:
    """``list_uploads`` for a store whose uploads in progress leave objects below
    ``UPLOADS_PREFIX`` (their parts, or a marker) rather than a listable upload."""

    def list_uploads(self, prefix: str) -> list[Upload]:
        """The uploads in progress of keys starting with ``prefix``."""
        keys, _ = self.list(f"{UPLOADS_PREFIX}{prefix}", delimiter=False)  # type: ignore[attr-defined]
        return uploads_found(keys)


def merge_options(
    root: str,
    defaults: Mapping[str, Any],
    given: Mapping[str, Any] | None,
    extra: Iterable[str] = (),
) -> dict[str, Any]:
    """A client's options: ``given`` over ``defaults``.

    Raises:
        ValueError: A given option is neither in ``defaults`` nor in ``extra`` (named, with
            the bucket's ``root``).
    """
    opts = {**defaults, **(given or {})}
    unknown = set(opts) - set(defaults) - set(extra)
    if unknown:
        raise ValueError(f"{root}: unknown storage options {sorted(unknown)}")
    return opts


def read_one_version(
    client: ObjectClient, key: str, read: Callable[[ObjectInfo], bytes]
) -> tuple[bytes, ObjectInfo, bool]:
    """``read(info)`` of the object ``key`` as one version of it.

    ``info`` is a HEAD of the object (its size, its etag); ``read`` fetches its bytes with
    GETs. A writer may replace the object in between (a heartbeat renewing a lock, a save
    rewriting the state file): the GETs would then read the new version's bytes up to the old
    one's size, a cut text. So the etag is read again after ``read``, and the object read
    again while it changed, ``READ_TRIES`` times at most.

    Returns:
        The bytes, the HEAD taken before the last read, and whether the etag was the same
        after it (False: replaced during every try; the bytes may be cut).

    Raises:
        FileNotFoundError: The object does not exist, or was deleted while it was read.
        OSError: A request failed.
    """
    for _ in range(READ_TRIES):
        info = client.head(key)
        data = read(info)
        if client.head(key).etag == info.etag:
            return data, info, True
    return data, info, False
