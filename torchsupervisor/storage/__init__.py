"""The storage seam: every checkpoint and events file goes through a ``Storage``.

``base`` defines the interface (object-store operations: atomic put of a whole object, ranged
reads, listing, delete, a writer lock); ``local`` implements it on a POSIX file system
(temporary name, fsync, rename, fsync of the directory; ``O_DIRECT`` for large objects);
``lock`` is the local writer lock. ``storage_for(path)`` picks the storage of a path.

It is a layer of its own, below ``checkpoint/`` and ``summary/`` (both write through it) and the
CLI (which reads through it), so that an object store fits in one place.
"""

from __future__ import annotations

from torchsupervisor.storage import base
from torchsupervisor.storage.base import *  # noqa: F403
from torchsupervisor.storage.base import Storage
from torchsupervisor.storage.local import LocalStorage, is_temporary_name, temporary_name

__all__ = [
    *base.__all__,
    "LOCAL",
    "LocalStorage",
    "is_temporary_name",
    "storage_for",
    "temporary_name",
]

LOCAL: Storage = LocalStorage()
"""The local file system."""


def storage_for(path: str, storage: Storage | None = None) -> Storage:
    """Return ``storage`` if given, else the storage that holds ``path``.

    Args:
        path: A local path (a URL names an object store).
        storage: An explicit storage (tests inject faults this way); None: chosen by ``path``.

    Raises:
        UnimplementedError: ``path`` is a URL (``s3://``, ``gs://``, ...): object stores are
            not available yet.
    """
    if storage is not None:
        return storage
    if "://" in str(path):
        from torchsupervisor.errors import UnimplementedError

        raise UnimplementedError(
            None, None, f"{path}: checkpoints on object storage are not available yet"
        )
    return LOCAL
