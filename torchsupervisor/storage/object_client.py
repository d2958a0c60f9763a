"""The wire operations of an object store, as ``ObjectStorage`` needs them (``ObjectClient``).

Six operations and nothing else: PUT with a precondition, multipart uploads, ranged GET, HEAD,
LIST and DELETE. ``s3.S3Client`` (boto3), ``gcs.GCSClient`` (google-cloud-storage) and
``memory.MemoryClient`` implement them; an ``az://`` client would too.

TF name: none.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from torchsupervisor.storage.base import Buffer
from torchsupervisor.storage.paths import URL

__all__ = ["ABSENT", "ObjectClient", "ObjectInfo", "PreconditionFailed", "Upload"]


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
