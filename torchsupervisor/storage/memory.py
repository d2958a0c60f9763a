"""``memory://bucket/...``: an object store inside this process, for tests and dry runs.

It behaves as the S3 API does where the commit protocol cares: whole-object puts, multipart
uploads that are invisible until completed and listed until completed or aborted, conditional
puts (``If-None-Match: *``, ``If-Match``), CRC-32C checked on every put and part, ranged reads
and ``/``-delimited listings. No rename, no append. The buckets of one process are shared by
every ``MemoryClient`` (two ``memory://b`` storages see the same objects) and vanish with it.

TF name: none (TF had ``ram://`` for tests).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field

import crc32c

from torchsupervisor.storage.objects import (
    ABSENT,
    ObjectClient,
    ObjectInfo,
    PreconditionFailed,
    Upload,
)
from torchsupervisor.storage.paths import URL

__all__ = ["MemoryClient", "clear_buckets"]


@dataclass
class _Object:
    data: bytes
    mtime: float
    etag: str


@dataclass
class _Bucket:
    objects: dict[str, _Object] = field(default_factory=dict)
    uploads: dict[str, tuple[str, dict[int, bytes]]] = field(default_factory=dict)


_mutex = threading.Lock()
_buckets: dict[str, _Bucket] = {}
_versions = itertools.count(1)


def clear_buckets() -> None:
    """Forget every ``memory://`` bucket of this process (between tests)."""
    with _mutex:
        _buckets.clear()


def _check_crc(key: str, data: bytes, crc: int) -> None:
    if crc32c.crc32c(data) != crc:
        raise OSError(f"memory://{key}: BadDigest: the CRC-32C of the body does not match")


class MemoryClient(ObjectClient):
    """One ``memory://`` bucket (see the module docstring).

    Args:
        bucket: The bucket's name.

    Thread safety: every method may be called from any thread.
    """

    def __init__(self, bucket: str) -> None:
        self.url = URL("memory", bucket, "")
        with _mutex:
            self._bucket = _buckets.setdefault(bucket, _Bucket())

    def put_object(self, key: str, data: object, *, crc: int, only_if: str | None = None) -> str:
        body = bytes(data)  # type: ignore[call-overload]
        _check_crc(key, body, crc)
        with _mutex:
            old = self._bucket.objects.get(key)
            if only_if == ABSENT and old is not None:
                raise PreconditionFailed(key)
            if only_if not in (None, ABSENT) and (old is None or old.etag != only_if):
                raise PreconditionFailed(key)
            etag = f"v{next(_versions)}"
            self._bucket.objects[key] = _Object(body, time.time(), etag)
        return etag

    def create_upload(self, key: str) -> Upload:
        upload = Upload(key, uuid.uuid4().hex)
        with _mutex:
            self._bucket.uploads[upload.upload_id] = (key, {})
        return upload

    def upload_part(self, upload: Upload, number: int, data: object, *, crc: int) -> object:
        body = bytes(data)  # type: ignore[call-overload]
        _check_crc(upload.key, body, crc)
        with _mutex:
            entry = self._bucket.uploads.get(upload.upload_id)
            if entry is None:
                raise OSError(f"memory://{upload.key}: NoSuchUpload {upload.upload_id}")
            entry[1][number] = body
        return number

    def complete_upload(self, upload: Upload, parts: list[object]) -> None:
        with _mutex:
            entry = self._bucket.uploads.pop(upload.upload_id, None)
            if entry is None:
                raise OSError(f"memory://{upload.key}: NoSuchUpload {upload.upload_id}")
            data = b"".join(entry[1][n] for n in parts)  # type: ignore[index]
            etag = f"v{next(_versions)}-{len(parts)}"
            self._bucket.objects[upload.key] = _Object(data, time.time(), etag)

    def abort_upload(self, upload: Upload) -> None:
        with _mutex:
            self._bucket.uploads.pop(upload.upload_id, None)

    def list_uploads(self, prefix: str) -> list[Upload]:
        with _mutex:
            items = list(self._bucket.uploads.items())
        return [Upload(key, uid) for uid, (key, _) in items if key.startswith(prefix)]

    def _get(self, key: str) -> _Object:
        with _mutex:
            found = self._bucket.objects.get(key)
        if found is None:
            raise FileNotFoundError(2, "NoSuchKey", self.url.join(key))
        return found

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self._get(key).data[offset : offset + length]

    def head(self, key: str) -> ObjectInfo:
        found = self._get(key)
        return ObjectInfo(len(found.data), found.mtime, found.etag)

    def list(self, prefix: str, *, delimiter: bool) -> tuple[list[str], list[str]]:
        with _mutex:
            keys = sorted(k for k in self._bucket.objects if k.startswith(prefix))
        if not delimiter:
            return keys, []
        direct = [k for k in keys if "/" not in k[len(prefix) :]]
        below = {prefix + k[len(prefix) :].split("/", 1)[0] + "/" for k in keys if k not in direct}
        return direct, sorted(below)

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        with _mutex:
            old = self._bucket.objects.get(key)
            if if_match is not None and (old is None or old.etag != if_match):
                raise PreconditionFailed(key)
            self._bucket.objects.pop(key, None)
