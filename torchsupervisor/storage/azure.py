"""``az://container/...``: the object-store wire operations on Azure Blob Storage.

The client library is ``azure-storage-blob`` (``pip install torchsupervisor[azure]``),
Microsoft's own. The account comes from a connection string (``AZURE_STORAGE_CONNECTION_STRING``
or the ``connection_string`` option), or from ``account_url`` with a ``credential`` (a key, a
SAS token, or an ``azure.identity`` credential). In a URL the first component is the
container: ``az://checkpoints/runs/exp``. What the commit protocol needs maps onto block
blobs:

* conditional puts: ``If-None-Match: *`` (create only if absent) and ``If-Match: <etag>``;
  conditional deletes likewise;
* checksums: Azure has no CRC-32C; the client checks the bytes against the CRC-32C computed
  beside the write before it sends them, and every request carries a Content-MD5 of those
  bytes that the service checks before it stores them (``validate_content``). A whole
  object's CRC-32C is kept in its metadata (``crc32c``);
* multipart uploads: the parts are staged blocks of the blob (invisible until the block list is
  committed, which makes the object appear whole); a marker object under
  ``.torchsupervisor-uploads/`` (outside every run's prefix) makes an upload in progress
  listable, so a crash's leftover is found and removed at the next start, as on S3. Blocks an
  abandoned upload staged are discarded with it (or by Azure after a week);
* ranged GETs, HEAD, listing with a ``/`` delimiter.

Every error is turned into an ``OSError`` that names the URL: ``FileNotFoundError`` (blob or
container missing), ``PermissionError`` (credentials missing or refused), ``ConnectionError``
(endpoint unreachable), ``PreconditionFailed`` (a condition), ``OSError(EIO)`` otherwise.
Requests have connect and read timeouts (seconds) and at most ``max_attempts`` attempts.

TF name: none.
"""

from __future__ import annotations

import base64
import errno
import os
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import crc32c

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

__all__ = ["AzureClient"]

_T = TypeVar("_T")

DEFAULT_OPTIONS: Mapping[str, Any] = {
    "connection_string": None,
    "account_url": None,
    "credential": None,
    "connect_timeout": 5.0,
    "read_timeout": 60.0,
    "max_attempts": 5,
}
"""Options of ``configure("az://container", ...)``; see ``AzureClient``."""

_MARKER = "started"


def _block_id(upload: Upload, number: int) -> str:
    """A block id of ``upload`` (all of one blob's ids must have the same length)."""
    return base64.b64encode(f"{upload.upload_id}-{number:06d}".encode()).decode("ascii")


class AzureClient(UploadsAsObjects, ObjectClient):
    """One Azure Blob container through azure-storage-blob (see the module docstring).

    Args:
        container: The container's name.
        options: ``connection_string`` (default: ``AZURE_STORAGE_CONNECTION_STRING``), or
            ``account_url`` and ``credential``; ``connect_timeout`` and ``read_timeout``
            (seconds per request), ``max_attempts``.

    Raises:
        ImportError: azure-storage-blob is not installed (``pip install
            torchsupervisor[azure]``).
        ValueError: An unknown option, or no account given.

    Thread safety: every method may be called from any thread.
    """

    def __init__(self, container: str, options: Mapping[str, Any] | None = None) -> None:
        try:
            import azure.core.exceptions as az_errors
            from azure.core import MatchConditions
            from azure.storage.blob import (
                BlobBlock,
                BlobPrefix,
                BlobServiceClient,
                ExponentialRetry,
            )
        except ImportError as e:
            raise ImportError(
                f"az://{container}: checkpoints on Azure need azure-storage-blob: "
                "pip install torchsupervisor[azure]"
            ) from e
        opts = merge_options(f"az://{container}", DEFAULT_OPTIONS, options)
        self.url = URL("az", container, "")
        self._errors = az_errors
        self._unchanged = MatchConditions.IfNotModified
        self._block = BlobBlock
        self._prefix_type = BlobPrefix
        transport = {
            "connection_timeout": float(opts["connect_timeout"]),
            "read_timeout": float(opts["read_timeout"]),
            # The SDK's default waits 15 s before its first retry, then 45 s, ...: too long
            # for a training run waiting on a checkpoint; backoff from 0.5 s instead.
            "retry_policy": ExponentialRetry(
                initial_backoff=0.5,
                increment_base=2,
                retry_total=max(0, int(opts["max_attempts"]) - 1),
                random_jitter_range=0.5,
            ),
        }
        connection = opts["connection_string"] or os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
        if connection:
            service = BlobServiceClient.from_connection_string(connection, **transport)
        elif opts["account_url"]:
            service = BlobServiceClient(opts["account_url"], opts["credential"], **transport)
        else:
            raise ValueError(
                f"az://{container}: no Azure account: set AZURE_STORAGE_CONNECTION_STRING, or "
                "pass connection_string (or account_url and credential) to configure()"
            )
        self.endpoint = service.url
        self._container = service.get_container_client(container)

    def check_bucket(self) -> None:
        """Fail early and clearly if the container is missing or unreachable.

        Raises:
            FileNotFoundError: The container does not exist.
            PermissionError: No credentials, or they are refused.
            ConnectionError: The endpoint cannot be reached.
        """
        if not self._call("", self._container.exists):
            raise self.missing_bucket("container")

    def _call(self, key: str, call: Callable[[], _T]) -> _T:
        """Run one request; translate its errors (see ``ObjectClient``)."""
        where = self.url.join(key)
        az = self._errors
        try:
            return call()
        except (az.ResourceExistsError, az.ResourceModifiedError):
            raise PreconditionFailed(where) from None
        except az.ResourceNotFoundError as e:
            raise FileNotFoundError(errno.ENOENT, f"{e.error_code or 'not found'}", where) from None
        except az.ClientAuthenticationError as e:
            raise PermissionError(errno.EACCES, f"Azure: {e.message}", where) from None
        except az.ServiceRequestError as e:
            raise ConnectionError(
                errno.ECONNREFUSED, f"the Azure endpoint {self.endpoint} is unreachable: {e}", where
            ) from None
        except az.AzureError as e:
            code = getattr(e, "error_code", None) or getattr(e, "status_code", "")
            raise OSError(errno.EIO, f"Azure {code}: {e.message}", where) from None

    # ------------------------------------------------------------------------------ writing

    def _checked(self, key: str, data: object, crc: int) -> bytes:
        """``data`` as bytes, if its CRC-32C is ``crc`` (Azure cannot check a CRC-32C: it
        checks the Content-MD5 that the SDK computes from these very bytes)."""
        body = bytes(data)
        if crc32c.crc32c(body) != crc:
            raise OSError(
                errno.EIO, "the bytes do not match their CRC-32C: not sent", self.url.join(key)
            )
        return body

    def put_object(self, key: str, data: object, *, crc: int, only_if: str | None = None) -> str:
        blob = self._container.get_blob_client(key)
        kwargs: dict[str, Any] = {}
        if only_if is not None and only_if != ABSENT:
            kwargs = {"etag": only_if, "match_condition": self._unchanged}
        body = self._checked(key, data, crc)
        result = self._call(
            key,
            lambda: blob.upload_blob(
                body,
                overwrite=only_if != ABSENT,
                metadata={"crc32c": f"{crc:08x}"},
                validate_content=True,
                **kwargs,
            ),
        )
        return str(result["etag"])

    def create_upload(self, key: str) -> Upload:
        upload = Upload(key, uuid.uuid4().hex)
        marker = f"{upload_prefix(upload)}{_MARKER}"
        self._call(
            marker,
            lambda: self._container.get_blob_client(marker).upload_blob(b"", overwrite=True),
        )
        return upload

    def upload_part(self, upload: Upload, number: int, data: object, *, crc: int) -> object:
        blob = self._container.get_blob_client(upload.key)
        block = _block_id(upload, number)
        body = self._checked(upload.key, data, crc)
        self._call(upload.key, lambda: blob.stage_block(block, body, validate_content=True))
        return block

    def complete_upload(self, upload: Upload, parts: list[object]) -> None:
        blob = self._container.get_blob_client(upload.key)
        blocks = [self._block(block_id=str(p)) for p in parts]
        self._call(upload.key, lambda: blob.commit_block_list(blocks))
        self._delete_marker(upload)

    def abort_upload(self, upload: Upload) -> None:
        blob = self._container.get_blob_client(upload.key)
        try:
            self.head(upload.key)
        except FileNotFoundError:
            # No committed object: committing an empty list and deleting the blob discards
            # the staged blocks at once (a committed object is left alone; Azure discards
            # its uncommitted blocks after a week).
            try:
                self._call(upload.key, lambda: blob.commit_block_list([]))
                self.delete(upload.key)
            except FileNotFoundError:
                pass
        self._delete_marker(upload)

    def _delete_marker(self, upload: Upload) -> None:
        self.delete(f"{upload_prefix(upload)}{_MARKER}")

    # ------------------------------------------------------------------------------ reading

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        blob = self._container.get_blob_client(key)
        try:
            return self._call(
                key, lambda: blob.download_blob(offset=offset, length=length).readall()
            )
        except OSError as e:
            if "InvalidRange" in str(e):  # The range starts at or after the end.
                return b""
            raise

    def head(self, key: str) -> ObjectInfo:
        blob = self._container.get_blob_client(key)
        props = self._call(key, blob.get_blob_properties)
        return ObjectInfo(int(props.size), props.last_modified.timestamp(), str(props.etag))

    def list(self, prefix: str, *, delimiter: bool) -> tuple[list[str], list[str]]:
        def pages() -> tuple[list[str], list[str]]:
            keys: list[str] = []
            prefixes: list[str] = []
            if delimiter:
                for item in self._container.walk_blobs(name_starts_with=prefix, delimiter="/"):
                    is_prefix = isinstance(item, self._prefix_type)
                    (prefixes if is_prefix else keys).append(item.name)
            else:
                keys = [b.name for b in self._container.list_blobs(name_starts_with=prefix)]
            return keys, prefixes

        return hide_uploads(prefix, *self._call(prefix, pages))

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        blob = self._container.get_blob_client(key)
        kwargs: dict[str, Any] = {}
        if if_match is not None:
            kwargs = {"etag": if_match, "match_condition": self._unchanged}
        try:
            self._call(key, lambda: blob.delete_blob(**kwargs))
        except FileNotFoundError:
            if if_match is not None:
                raise PreconditionFailed(self.url.join(key)) from None
