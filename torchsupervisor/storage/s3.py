"""``s3://bucket/...``: the object-store wire operations on Amazon S3 and compatible servers.

The client library is ``boto3`` (botocore), installed with ``pip install torchsupervisor[s3]``:
it is AWS's own, reads the standard configuration (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, profiles, instance roles),
retries transient errors with backoff, and exposes what the commit protocol needs of S3:
conditional puts (``IfNoneMatch``, ``IfMatch``), a CRC-32C sent with every put and part
(``ChecksumCRC32C``: the server recomputes it and refuses a body that does not match), multipart
uploads and their listing, and ranged GETs. ``docs/storage.md`` says why not fsspec or obstore.

Every error is turned into an ``OSError`` that names the URL and S3's error code; a missing
bucket, missing credentials or an unreachable endpoint fail within a bounded time
(``connect_timeout`` and ``read_timeout`` per attempt, ``max_attempts`` attempts).

TF name: none (TF's ``gfile`` on ``s3://``).
"""

from __future__ import annotations

import base64
import errno
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from torchsupervisor.storage.object_client import merge_options
from torchsupervisor.storage.objects import (
    ABSENT,
    ObjectClient,
    ObjectInfo,
    PreconditionFailed,
    Upload,
)
from torchsupervisor.storage.paths import URL

__all__ = ["S3Client"]

_T = TypeVar("_T")

DEFAULT_OPTIONS: Mapping[str, Any] = {
    "connect_timeout": 5.0,
    "read_timeout": 60.0,
    "max_attempts": 5,
}
"""Timeouts (seconds) and attempts per request; override them in ``storage_options``."""

_CLIENT_KEYS = (
    "endpoint_url",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "region_name",
)


def _crc_header(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


class S3Client(ObjectClient):
    """One S3 bucket through boto3 (see the module docstring).

    Args:
        bucket: The bucket's name.
        options: ``endpoint_url``, ``aws_access_key_id``, ``aws_secret_access_key``,
            ``aws_session_token``, ``region_name`` (each defaults to boto3's own
            configuration: the ``AWS_*`` environment variables, then its files), and
            ``connect_timeout``, ``read_timeout`` (seconds), ``max_attempts``.

    Raises:
        ImportError: boto3 is not installed (``pip install torchsupervisor[s3]``).
        ValueError: An unknown option.

    Thread safety: every method may be called from any thread (boto3 clients are).
    """

    def __init__(self, bucket: str, options: Mapping[str, Any] | None = None) -> None:
        try:
            import boto3
            import botocore.config
            import botocore.exceptions
        except ImportError as e:
            raise ImportError(
                f"s3://{bucket}: checkpoints on S3 need boto3: pip install torchsupervisor[s3]"
            ) from e
        opts = merge_options(f"s3://{bucket}", DEFAULT_OPTIONS, options, _CLIENT_KEYS)
        self.url = URL("s3", bucket, "")
        self._errors = botocore.exceptions
        config = botocore.config.Config(
            connect_timeout=opts["connect_timeout"],
            read_timeout=opts["read_timeout"],
            # Attempts in all, the first included (botocore's "max_attempts" counts retries only).
            retries={"total_max_attempts": int(opts["max_attempts"]), "mode": "standard"},
            max_pool_connections=32,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        kwargs = {k: opts[k] for k in _CLIENT_KEYS if opts.get(k) is not None}
        self._s3 = boto3.session.Session().client("s3", config=config, **kwargs)
        self.endpoint = self._s3.meta.endpoint_url

    def check_bucket(self) -> None:
        """Fail early and clearly if the bucket is missing or unreachable.

        Raises:
            FileNotFoundError: The bucket does not exist.
            PermissionError: No credentials, or they are refused.
            ConnectionError: The endpoint cannot be reached.
        """
        try:
            self._call("", lambda: self._s3.head_bucket(Bucket=self.url.bucket))
        except FileNotFoundError:
            raise self.missing_bucket() from None

    def _call(self, key: str, call: Callable[[], _T]) -> _T:
        """Run one request; translate its errors (see ``ObjectClient``)."""
        where = self.url.join(key)
        try:
            return call()
        except self._errors.ClientError as e:
            error = e.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                raise PreconditionFailed(where) from None
            if code == "NoSuchBucket":
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"the bucket {self.url.bucket!r} does not exist at {self.endpoint}",
                    where,
                ) from None
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                raise FileNotFoundError(errno.ENOENT, "no such object", where) from None
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise PermissionError(
                    errno.EACCES, f"{code}: {error.get('Message', 'access denied')}", where
                ) from None
            raise OSError(
                errno.EIO, f"S3 {code or status}: {error.get('Message', e)}", where
            ) from None
        except self._errors.NoCredentialsError:
            raise PermissionError(
                errno.EACCES,
                "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or pass "
                "them in storage_options",
                where,
            ) from None
        except (self._errors.EndpointConnectionError, self._errors.ConnectTimeoutError) as e:
            raise ConnectionError(
                errno.ECONNREFUSED, f"the S3 endpoint {self.endpoint} is unreachable: {e}", where
            ) from None
        except self._errors.BotoCoreError as e:
            raise OSError(errno.EIO, f"S3: {e}", where) from None

    def put_object(self, key: str, data: object, *, crc: int, only_if: str | None = None) -> str:
        kwargs: dict[str, Any] = {"ChecksumCRC32C": _crc_header(crc)}
        if only_if == ABSENT:
            kwargs["IfNoneMatch"] = "*"
        elif only_if is not None:
            kwargs["IfMatch"] = only_if
        body = bytes(data)
        response = self._call(
            key,
            lambda: self._s3.put_object(Bucket=self.url.bucket, Key=key, Body=body, **kwargs),
        )
        return str(response.get("ETag", ""))

    def create_upload(self, key: str) -> Upload:
        response = self._call(
            key,
            lambda: self._s3.create_multipart_upload(
                Bucket=self.url.bucket, Key=key, ChecksumAlgorithm="CRC32C"
            ),
        )
        return Upload(key, response["UploadId"])

    def upload_part(self, upload: Upload, number: int, data: object, *, crc: int) -> object:
        checksum = _crc_header(crc)
        body = bytes(data)
        response = self._call(
            upload.key,
            lambda: self._s3.upload_part(
                Bucket=self.url.bucket,
                Key=upload.key,
                UploadId=upload.upload_id,
                PartNumber=number,
                Body=body,
                ChecksumCRC32C=checksum,
            ),
        )
        return {"PartNumber": number, "ETag": response["ETag"], "ChecksumCRC32C": checksum}

    def complete_upload(self, upload: Upload, parts: list[object]) -> None:
        self._call(
            upload.key,
            lambda: self._s3.complete_multipart_upload(
                Bucket=self.url.bucket,
                Key=upload.key,
                UploadId=upload.upload_id,
                MultipartUpload={"Parts": parts},
            ),
        )

    def abort_upload(self, upload: Upload) -> None:
        try:
            self._call(
                upload.key,
                lambda: self._s3.abort_multipart_upload(
                    Bucket=self.url.bucket, Key=upload.key, UploadId=upload.upload_id
                ),
            )
        except FileNotFoundError:
            pass  # Completed or aborted already.

    def list_uploads(self, prefix: str) -> list[Upload]:
        found: list[Upload] = []
        paginator = self._s3.get_paginator("list_multipart_uploads")

        def pages() -> list[dict[str, Any]]:
            return list(paginator.paginate(Bucket=self.url.bucket, Prefix=prefix))

        for page in self._call(prefix, pages):
            found.extend(Upload(u["Key"], u["UploadId"]) for u in page.get("Uploads", []))
        return found

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""

        def get() -> bytes:
            response = self._s3.get_object(
                Bucket=self.url.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}"
            )
            return response["Body"].read()

        return self._call(key, get)

    def head(self, key: str) -> ObjectInfo:
        response = self._call(key, lambda: self._s3.head_object(Bucket=self.url.bucket, Key=key))
        return ObjectInfo(
            int(response["ContentLength"]),
            response["LastModified"].timestamp(),
            str(response.get("ETag", "")),
        )

    def list(self, prefix: str, *, delimiter: bool) -> tuple[list[str], list[str]]:
        paginator = self._s3.get_paginator("list_objects_v2")
        extra = {"Delimiter": "/"} if delimiter else {}

        def pages() -> list[dict[str, Any]]:
            return list(paginator.paginate(Bucket=self.url.bucket, Prefix=prefix, **extra))

        keys: list[str] = []
        prefixes: list[str] = []
        for page in self._call(prefix, pages):
            keys.extend(o["Key"] for o in page.get("Contents", []))
            prefixes.extend(p["Prefix"] for p in page.get("CommonPrefixes", []))
        return keys, prefixes

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        kwargs = {"IfMatch": if_match} if if_match is not None else {}
        self._call(key, lambda: self._s3.delete_object(Bucket=self.url.bucket, Key=key, **kwargs))
