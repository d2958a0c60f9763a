"""The storage seam: every checkpoint and events file goes through a ``Storage``.

``base`` defines the interface (object-store operations: atomic put of a whole object, ranged
reads, listing, delete, a writer lock); ``local`` implements it on a POSIX file system
(temporary name, fsync, rename, fsync of the directory; ``O_DIRECT`` for large objects);
``lock`` is the local writer lock; ``private`` the memory tier's files (one user's alone, on a
tmpfs); ``objects`` implements it on an object store (``s3`` on
boto3, ``memory`` inside the process); ``paths`` compares and rebases paths that may be URLs.
``storage_for(path)`` picks the storage of a path; ``BY_PATH`` picks it at every call.

It is a layer of its own, below ``checkpoint/`` and ``summary/`` (both write through it) and the
CLI (which reads through it), so that an object store fits in one place.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torchsupervisor.storage import base
from torchsupervisor.storage.base import *  # noqa: F403
from torchsupervisor.storage.base import Storage
from torchsupervisor.storage.local import LocalStorage, is_temporary_name, temporary_name
from torchsupervisor.storage.objects import ObjectStorage
from torchsupervisor.storage.paths import URL, is_url, parse_url

__all__ = [
    *base.__all__,
    "BY_PATH",
    "LOCAL",
    "LocalStorage",
    "ObjectStorage",
    "configure",
    "is_temporary_name",
    "object_storage",
    "storage_for",
    "temporary_name",
]

LOCAL: Storage = LocalStorage()
"""The local file system."""

SCHEMES = ("s3", "gs", "az", "memory")
"""The URL schemes with a storage."""

_mutex = threading.Lock()
_options: dict[tuple[str, str], dict[str, Any]] = {}
_stores: dict[tuple[str, str], ObjectStorage] = {}


def configure(url: str, **options: object) -> None:
    """Set how the bucket of ``url`` is reached (instead of the standard environment).

    Args:
        url: object URL in the bucket (``s3://bucket`` or ``s3://bucket/run``).
        **options: For ``s3://``: ``endpoint_url``, ``aws_access_key_id``,
            ``aws_secret_access_key``, ``aws_session_token``, ``region_name``,
            ``connect_timeout`` and ``read_timeout`` (seconds), ``max_attempts``; for
            ``gs://``: ``endpoint_url``, ``project``, ``credentials``, ``anonymous``,
            ``connect_timeout`` and ``read_timeout`` (seconds), ``max_attempts``; for ``az://``:
            ``connection_string``, or ``account_url`` and ``credential``,
            ``connect_timeout`` and ``read_timeout`` (seconds), ``max_attempts``; for any
            object store: ``part_bytes`` (multipart part size, bytes), ``max_concurrency``
            (parts in flight), ``lock_ttl_secs`` (seconds), ``events_roll_bytes`` (the size at
            which an events file is rolled, bytes).

    Raises:
        ValueError: ``url`` is not a URL.

    Thread safety: safe from any thread; storages made before keep their options.
    """
    parsed = parse_url(url)
    with _mutex:
        _options[(parsed.scheme, parsed.bucket)] = dict(options)
        _stores.pop((parsed.scheme, parsed.bucket), None)


def storage_for(path: str, storage: Storage | None = None) -> Storage:
    """Return ``storage`` if given, else the storage that holds ``path``.

    Args:
        path: A local path, or a URL: ``s3://bucket/key`` (boto3, configured by the ``AWS_*``
            environment variables or ``configure``), ``gs://bucket/key`` (google-cloud-storage,
            Application Default Credentials or ``configure``), ``az://container/key``
            (azure-storage-blob, ``AZURE_STORAGE_CONNECTION_STRING`` or ``configure``) or
            ``memory://bucket/key``.
        storage: An explicit storage (tests inject faults this way); None: chosen by ``path``.

    Raises:
        UnimplementedError: A URL scheme without a storage (``hdfs://``, ...).
        ImportError: The client library of the URL's store is not installed (``pip install
            torchsupervisor[s3]``, ``[gcs]``, ``[azure]``).
        ValueError: ``az://`` without an account (no connection string).
        FileNotFoundError, PermissionError, ConnectionError: The bucket does not exist, the
            credentials are missing or refused, or the endpoint cannot be reached (checked
            once per bucket and process).
    """
    if storage is not None:
        return storage
    if not is_url(path):
        return LOCAL
    url = parse_url(str(path))
    key = (url.scheme, url.bucket)
    with _mutex:
        found = _stores.get(key)
        options = dict(_options.get(key, {}))
    if found is not None:
        return found
    made = object_storage(url, options)
    with _mutex:
        return _stores.setdefault(key, made)


def object_storage(url: URL, options: dict[str, Any]) -> ObjectStorage:
    """A new ``ObjectStorage`` of ``url``'s bucket with ``options`` (``configure``'s); unlike
    ``storage_for``, not the one shared by the process. ``options`` loses the tuning keys.

    Raises:
        ValueError: For an unknown option (``memory://``), or a bad tuning value.
        UnimplementedError: For a scheme without a storage.
        OSError: The bucket cannot be reached or does not exist (``check_bucket``).

    TF name: none.
    """
    tuning = {
        k: options.pop(k)
        for k in ("part_bytes", "max_concurrency", "lock_ttl_secs", "events_roll_bytes")
        if k in options
    }
    if url.scheme == "memory":
        from torchsupervisor.storage.memory import MemoryClient

        if options:
            raise ValueError(f"{url.root}: unknown storage options {sorted(options)}")
        return ObjectStorage(MemoryClient(url.bucket), **tuning)
    if url.scheme == "s3":
        from torchsupervisor.storage.s3 import S3Client

        client = S3Client(url.bucket, options)
        client.check_bucket()
        return ObjectStorage(client, **tuning)
    if url.scheme == "gs":
        from torchsupervisor.storage.gcs import GCSClient

        gcs_client = GCSClient(url.bucket, options)
        gcs_client.check_bucket()
        return ObjectStorage(gcs_client, **tuning)
    if url.scheme == "az":
        from torchsupervisor.storage.azure import AzureClient

        azure_client = AzureClient(url.bucket, options)
        azure_client.check_bucket()
        return ObjectStorage(azure_client, **tuning)
    from torchsupervisor.errors import UnimplementedError

    raise UnimplementedError(
        None,
        None,
        f"{url.root}: no storage for {url.scheme}:// (available: "
        f"{', '.join(s + '://' for s in SCHEMES)})",
    )


def _forward(name: str) -> Callable[..., Any]:
    def by_path(self: Storage, path: str, *args: object, **kwargs: object) -> Any:
        return getattr(storage_for(path), name)(path, *args, **kwargs)

    by_path.__name__ = by_path.__qualname__ = name
    by_path.__doc__ = f"``storage_for(path).{name}(path, ...)``."
    return by_path


class _ByPath(Storage):
    """The storage of each path, chosen at every call (``storage_for``).

    Every public method of ``Storage`` (each takes the path or directory first) is forwarded,
    so a method added to the interface cannot be forgotten here.
    """


for _name, _member in vars(Storage).items():
    if not _name.startswith("_") and callable(_member):
        setattr(_ByPath, _name, _forward(_name))
_ByPath.__abstractmethods__ = frozenset()


BY_PATH: Storage = _ByPath()
"""The storage of each path: ``LOCAL`` for a local path, the object store of a URL."""
