"""Paths that may be URLs: normalized, compared and rebased without losing the scheme."""

from __future__ import annotations

import os

import pytest

from torchsupervisor.storage import paths


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("s3://b/run//x/../y/", "s3://b/run/y"),
        ("s3://b", "s3://b"),
        ("s3://b/", "s3://b"),
        ("S3://b/./k", "s3://b/k"),
        ("memory://b/a/b/..", "memory://b/a"),
        ("runs//exp/./m", os.path.normpath("runs//exp/./m")),
    ],
)
def test_normpath(path, expected):
    assert paths.normpath(path) == expected


def test_urls_are_absolute_and_rebased_within_their_bucket():
    assert paths.isabs("s3://b/x") and paths.abspath("s3://b/x/") == "s3://b/x"
    assert paths.relpath("s3://b/run/m.ckpt-1", "s3://b/run") == "m.ckpt-1"
    assert paths.relpath("s3://b/other/m", "s3://b/run") == "../other/m"
    assert paths.relpath("a/b", "a") == "b"


@pytest.mark.parametrize(
    ("path", "start"), [("s3://b/x", "s3://c/x"), ("s3://b/x", "/tmp"), ("/tmp/x", "s3://b")]
)
def test_relpath_refuses_to_cross_buckets_or_stores(path, start):
    with pytest.raises(ValueError, match=r"different buckets|no relative path"):
        paths.relpath(path, start)


@pytest.mark.parametrize("bad", ["s3://", "s3:///key", "s3://b/../x", "not-a-url"])
def test_parse_url_names_the_bad_url(bad):
    with pytest.raises(ValueError, match=r"URL|bucket"):
        paths.parse_url(bad)


def test_parse_url_splits_scheme_bucket_and_key():
    url = paths.parse_url("s3://bucket/run/./m.ckpt-10")
    assert url == ("s3", "bucket", "run/m.ckpt-10")
    assert url.root == "s3://bucket" and url.join("x") == "s3://bucket/x"
    assert not paths.is_url("/tmp/x") and not paths.is_url("C:/x") and paths.is_url("gs://b")
