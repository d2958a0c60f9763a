"""``gs://bucket/...``: the object-store wire operations on Google Cloud Storage.

The client library is ``google-cloud-storage`` (``pip install torchsupervisor[gcs]``): Google's
own, it reads the standard configuration (Application Default Credentials,
``GOOGLE_APPLICATION_CREDENTIALS``, ``STORAGE_EMULATOR_HOST`` for an emulator) and retries
transient errors with backoff. What the commit protocol needs maps onto GCS as follows:

* conditional puts: ``ifGenerationMatch=0`` (create only if absent) and
  ``ifGenerationMatch=<generation>`` (replace only that version); an object's "etag" here is
  its generation;
* the CRC-32C of every put is sent in the object's metadata, which GCS checks against the
  bytes it received (a mismatch fails the upload); the client also compares the CRC-32C the
  server reports for the stored object and deletes a mismatching object before raising;
* multipart uploads: each part is an object of its own under ``.torchsupervisor-uploads/<key>/
  <upload id>/``, and completing the upload *composes* the parts into the key (32 at a time,
  the limit of one compose) and deletes them. The parts lie outside the run's prefix, so a
  listing of the run never shows them; an upload a crash interrupted is found by
  ``list_uploads`` and removed by ``abort_upload`` (``clean_leftovers``), as on S3;
* ranged GETs, HEAD, listing with a ``/`` delimiter, and deletes conditional on the
  generation.

Every error is turned into an ``OSError`` that names the URL: ``FileNotFoundError`` (object or
bucket missing), ``PermissionError`` (credentials missing or refused), ``ConnectionError``
(endpoint unreachable), ``PreconditionFailed`` (a condition), ``OSError(EIO)`` otherwise.
Every request has a connect and a read timeout (seconds); retries stop after a deadline.

TF name: none (TF's ``gfile`` on ``gs://``).
"""

from __future__ import annotations

import base64
import errno
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from torchsupervisor.storage.object_client import (
    ABSENT,
    ObjectClient,
    ObjectInfo,
    PreconditionFailed,
    Upload,
    UploadsAsObjects,
    hide_uploads,
    merge_options,
    upload_prefix,
)
from torchsupervisor.storage.paths import URL

__all__ = ["GCSClient"]

_T = TypeVar("_T")

_STARTED = "started"
"""The marker object of an upload (its parts are numbered ``00001``, ...)."""

_COMPOSE_MAX = 32
"""The most source objects one compose request takes (a GCS limit)."""

DEFAULT_OPTIONS: Mapping[str, Any] = {
    "endpoint_url": None,
    "project": None,
    "credentials": None,
    "anonymous": False,
    "connect_timeout": 5.0,
    "read_timeout": 60.0,
    "max_attempts": 5,
}
"""Options of ``configure("gs://bucket", ...)``; see ``GCSClient``."""


def _crc_b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


class GCSClient(UploadsAsObjects, ObjectClient):
    """One GCS bucket through google-cloud-storage (see the module docstring).

    Args:
        bucket: The bucket's name.
        options: ``endpoint_url`` (an emulator's URL; default: GCS, or
            ``STORAGE_EMULATOR_HOST``), ``project``, ``credentials`` (a
            ``google.auth.credentials.Credentials``; default: Application Default
            Credentials), ``anonymous`` (no credentials: emulators and public buckets),
            ``connect_timeout`` and ``read_timeout`` (seconds per request), ``max_attempts``
            (transient errors and failed connections are retried with backoff for at most
            ``max_attempts * 2 * connect_timeout`` seconds).

    Raises:
        ImportError: google-cloud-storage is not installed (``pip install
            torchsupervisor[gcs]``).
        ValueError: An unknown option.

    Thread safety: every method may be called from any thread.
    """

    def __init__(self, bucket: str, options: Mapping[str, Any] | None = None) -> None:
        try:
            import google.api_core.exceptions as api_errors
            import google.api_core.retry as api_retry
            import google.auth.exceptions as auth_errors
            import requests.exceptions as http_errors
            from google.cloud import storage as gcs
        except ImportError as e:
            raise ImportError(
                f"gs://{bucket}: checkpoints on GCS need google-cloud-storage: "
                "pip install torchsupervisor[gcs]"
            ) from e
        opts = merge_options(f"gs://{bucket}", DEFAULT_OPTIONS, options)
        self.url = URL("gs", bucket, "")
        self._api = api_errors
        self._auth = auth_errors
        self._http = http_errors
        connect = float(opts["connect_timeout"])
        self._timeout = (connect, float(opts["read_timeout"]))
        # Transient errors only (429, 5xx, refused or reset connections), with backoff; the
        # deadline bounds how long one request keeps trying (an unreachable endpoint fails
        # within it, never hangs).
        self._retry = api_retry.Retry(
            predicate=api_retry.if_transient_error,
            initial=0.1,
            maximum=2.0,
            timeout=max(1, int(opts["max_attempts"])) * 2 * connect,
        )
        client_options = {"api_endpoint": opts["endpoint_url"]} if opts["endpoint_url"] else None
        credentials = opts["credentials"]
        project = opts["project"]
        if opts["anonymous"]:
            from google.auth.credentials import AnonymousCredentials

            credentials = AnonymousCredentials()
            project = project or "anonymous"
        try:
            self._client = gcs.Client(
                project=project, credentials=credentials, client_options=client_options
            )
        except auth_errors.DefaultCredentialsError as e:
            raise PermissionError(errno.EACCES, f"no GCS credentials: {e}", self.url.root) from None
        self._bucket = self._client.bucket(bucket)
        self.endpoint = self._client._connection.API_BASE_URL

    def check_bucket(self) -> None:
        """Fail early and clearly if the bucket is missing or unreachable.

        Raises:
            FileNotFoundError: The bucket does not exist.
            PermissionError: No credentials, or they are refused.
            ConnectionError: The endpoint cannot be reached.
        """
        exists = self._call(
            "", lambda: self._bucket.exists(timeout=self._timeout, retry=self._retry)
        )
        if not exists:
            raise self.missing_bucket()

    def _call(self, key: str, call: Callable[[], _T]) -> _T:
        """Run one request; translate its errors (see ``ObjectClient``)."""
        where = self.url.join(key)
        api = self._api
        try:
            return call()
        except api.PreconditionFailed:
            raise PreconditionFailed(where) from None
        except api.NotFound:
            raise FileNotFoundError(errno.ENOENT, "no such object", where) from None
        except (api.Forbidden, api.Unauthorized) as e:
            raise PermissionError(errno.EACCES, f"GCS: {e.message}", where) from None
        except api.GoogleAPICallError as e:
            raise OSError(errno.EIO, f"GCS {e.code}: {e.message}", where) from None
        except api.RetryError as e:
            raise ConnectionError(
                errno.ECONNREFUSED, f"the GCS endpoint {self.endpoint} failed: {e}", where
            ) from None
        except self._auth.GoogleAuthError as e:
            raise PermissionError(errno.EACCES, f"GCS credentials: {e}", where) from None
        except (self._http.ConnectionError, self._http.Timeout) as e:
            raise ConnectionError(
                errno.ECONNREFUSED, f"the GCS endpoint {self.endpoint} is unreachable: {e}", where
            ) from None

    # ------------------------------------------------------------------------------ writing

    def put_object(self, key: str, data: object, *, crc: int, only_if: str | None = None) -> str:
        if only_if == ABSENT:
            generation: int | None = 0
        elif only_if is not None:
            generation = int(only_if)
        else:
            generation = None
        blob = self._bucket.blob(key)
        blob.crc32c = _crc_b64(crc)  # Sent with the upload: GCS checks the bytes against it.
        body = bytes(data)

        def upload() -> None:
            blob.upload_from_string(
                body,
                content_type="application/octet-stream",
                if_generation_match=generation,
                timeout=self._timeout,
                retry=self._retry,
                checksum=None,
            )

        self._call(key, upload)
        if blob.crc32c != _crc_b64(crc):  # What the server stored is not what was sent.
            self._call(key, lambda: blob.delete(if_generation_match=blob.generation))
            raise OSError(errno.EIO, "GCS stored a different CRC-32C", self.url.join(key))
        return str(blob.generation)

    def create_upload(self, key: str) -> Upload:
        upload = Upload(key, uuid.uuid4().hex)
        # An empty marker: an upload is listed (a leftover if a crash interrupts it) from its
        # start, before its first part, as on S3.
        self.put_object(f"{upload_prefix(upload)}{_STARTED}", b"", crc=0)
        return upload

    def upload_part(self, upload: Upload, number: int, data: object, *, crc: int) -> object:
        name = f"{upload_prefix(upload)}{number:05d}"
        self.put_object(name, data, crc=crc)
        return name

    def complete_upload(self, upload: Upload, parts: list[object]) -> None:
        names = [str(p) for p in parts]
        level = 0
        while len(names) > _COMPOSE_MAX:  # Compose groups of 32 into larger parts first.
            grouped = []
            for i in range(0, len(names), _COMPOSE_MAX):
                name = f"{upload_prefix(upload)}compose-{level}-{i // _COMPOSE_MAX:05d}"
                self._compose(name, names[i : i + _COMPOSE_MAX])
                grouped.append(name)
            names, level = grouped, level + 1
        self._compose(upload.key, names)
        self.abort_upload(upload)  # The parts are not needed any more.

    def _compose(self, key: str, sources: list[str]) -> None:
        destination = self._bucket.blob(key)
        blobs = [self._bucket.blob(name) for name in sources]
        self._call(
            key,
            lambda: destination.compose(blobs, timeout=self._timeout, retry=self._retry),
        )

    def abort_upload(self, upload: Upload) -> None:
        keys, _ = self.list(upload_prefix(upload), delimiter=False)
        for key in keys:
            self.delete(key)

    # ------------------------------------------------------------------------------ reading

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        blob = self._bucket.blob(key)

        def get() -> bytes:
            return blob.download_as_bytes(
                start=offset,
                end=offset + length - 1,
                checksum=None,
                timeout=self._timeout,
                retry=self._retry,
            )

        try:
            return self._call(key, get)
        except OSError as e:
            if "416" in str(e):  # The range starts at or after the end.
                return b""
            raise

    def head(self, key: str) -> ObjectInfo:
        blob = self._call(
            key, lambda: self._bucket.get_blob(key, timeout=self._timeout, retry=self._retry)
        )
        if blob is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", self.url.join(key))
        return ObjectInfo(int(blob.size or 0), blob.updated.timestamp(), str(blob.generation))

    def list(self, prefix: str, *, delimiter: bool) -> tuple[list[str], list[str]]:
        def pages() -> tuple[list[str], list[str]]:
            found = self._client.list_blobs(
                self._bucket,
                prefix=prefix,
                delimiter="/" if delimiter else None,
                timeout=self._timeout,
                retry=self._retry,
            )
            keys = [blob.name for blob in found]  # Iterating fetches every page.
            return keys, sorted(found.prefixes)

        return hide_uploads(prefix, *self._call(prefix, pages))

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        blob = self._bucket.blob(key)
        generation = int(if_match) if if_match is not None else None
        if if_match is not None:
            # GCS checks the generation itself; looking first also holds on emulators that
            # ignore the condition on a delete (fake-gcs-server does).
            try:
                current = self.head(key).etag
            except FileNotFoundError:
                raise PreconditionFailed(self.url.join(key)) from None
            if current != if_match:
                raise PreconditionFailed(self.url.join(key))
        try:
            self._call(
                key,
                lambda: blob.delete(
                    if_generation_match=generation, timeout=self._timeout, retry=self._retry
                ),
            )
        except FileNotFoundError:
            if if_match is not None:
                raise PreconditionFailed(self.url.join(key)) from None
