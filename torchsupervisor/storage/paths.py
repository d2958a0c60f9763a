"""Paths that may be URLs: ``s3://bucket/run/model.ckpt-10`` as well as ``runs/exp/model.ckpt-10``.

Every path above the storage seam is a string: a local path or an object-store URL
(``scheme://bucket/key``). ``os.path.join``, ``dirname`` and ``basename`` already work on both;
``normpath``, ``abspath``, ``isabs`` and ``relpath`` do not (``os.path.normpath("s3://b/k")`` is
``"s3:/b/k"``), so code that compares or rebases paths uses the functions here, which treat the
key of a URL as a POSIX path and leave its scheme and bucket alone.

TF name: none (TF's ``gfile`` accepted ``gs://`` paths the same way).
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import NamedTuple

__all__ = ["URL", "abspath", "is_url", "isabs", "normpath", "parse_url", "relpath"]

_URL_RE = re.compile(r"^([a-z][a-z0-9+.-]*)://([^/]*)(?:/(.*))?$", re.IGNORECASE | re.DOTALL)


class URL(NamedTuple):
    """An object-store URL, split: ``s3://bucket/a/b`` is ``URL("s3", "bucket", "a/b")``.

    Attributes:
        scheme: Lower case (``"s3"``, ``"gs"``, ``"az"``, ``"memory"``).
        bucket: The bucket (container) name.
        key: The object key or prefix, normalized, without a leading or trailing ``/``;
            ``""`` for the bucket's root.
    """

    scheme: str
    bucket: str
    key: str

    def join(self, key: str) -> str:
        """Return the URL of ``key`` in the same bucket."""
        return f"{self.scheme}://{self.bucket}/{key}" if key else self.root

    @property
    def root(self) -> str:
        """``scheme://bucket``."""
        return f"{self.scheme}://{self.bucket}"


def is_url(path: object) -> bool:
    """Return True if ``path`` is an object-store URL (``scheme://...``), not a local path."""
    return isinstance(path, str) and _URL_RE.match(path) is not None


def parse_url(path: str) -> URL:
    """Split an object-store URL.

    Raises:
        ValueError: ``path`` is not a URL, has no bucket, or its key climbs out of the
            bucket (``s3://b/../x``).
    """
    match = _URL_RE.match(path)
    if match is None:
        raise ValueError(f"{path!r} is not a URL (scheme://bucket/key)")
    scheme, bucket, key = match.group(1).lower(), match.group(2), match.group(3) or ""
    if not bucket:
        raise ValueError(f"{path!r} names no bucket (scheme://bucket/key)")
    key = posixpath.normpath(key.lstrip("/")) if key.strip("/") else ""
    if key == ".":
        key = ""
    if key == ".." or key.startswith("../"):
        raise ValueError(f"{path!r} climbs out of its bucket")
    return URL(scheme, bucket, key)


def normpath(path: str) -> str:
    """``os.path.normpath`` for a local path; for a URL, its key normalized."""
    if is_url(path):
        return parse_url(path).join(parse_url(path).key)
    return os.path.normpath(path)


def abspath(path: str) -> str:
    """``os.path.abspath`` for a local path; a URL is absolute already (normalized)."""
    return normpath(path) if is_url(path) else os.path.abspath(path)


def isabs(path: str) -> bool:
    """``os.path.isabs`` for a local path; True for a URL."""
    return is_url(path) or os.path.isabs(path)


def relpath(path: str, start: str) -> str:
    """``os.path.relpath``; for two URLs of one bucket, the relative key.

    Raises:
        ValueError: One is a URL and the other not, or they name different buckets.
    """
    if not is_url(path) and not is_url(start):
        return os.path.relpath(path, start)
    if not (is_url(path) and is_url(start)):
        raise ValueError(f"no relative path from {start!r} to {path!r}")
    a, b = parse_url(path), parse_url(start)
    if (a.scheme, a.bucket) != (b.scheme, b.bucket):
        raise ValueError(f"{path!r} and {start!r} are in different buckets")
    return posixpath.relpath("/" + a.key, "/" + b.key)
