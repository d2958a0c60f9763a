"""``gs://`` on a GCS emulator (fake-gcs-server): what differs from S3 in ``GCSClient``.

The Storage contract itself runs on ``gs://`` with every other object store
(``testobject_storage.py``, ``checkpoint/test_object_stores.py``); here: multipart uploads
made of composed part objects (more parts than one compose takes), parts that never show in a
listing, and the errors for a missing bucket or endpoint.
"""

from __future__ import annotations

import os
import socket
import time

import crc32c
import pytest

from torchsupervisor.storage import ObjectStorage, object_storage, storage_for
from torchsupervisor.storage.object_client import UPLOADS_PREFIX
from torchsupervisor.storage.paths import parse_url


def test_an_upload_of_more_parts_than_one_compose_takes_is_whole(gs_url):
    st = ObjectStorage(storage_for(gs_url).client, part_bytes=1024, max_concurrency=4)
    data = os.urandom(70 * 1024 + 5)  # 71 parts: composed 32 at a time, then together.
    st.put(f"{gs_url}/big", [data[:1000], data[1000:]])
    assert st.read_bytes(f"{gs_url}/big", max_bytes=len(data)) == data
    # The parts and the intermediate composes are gone; nothing is left to clean.
    client = st.client
    assert client.list(UPLOADS_PREFIX + st.key(gs_url), delimiter=False) == ([], [])
    assert st.leftovers(gs_url) == []


def test_parts_of_an_unfinished_upload_never_show_in_a_listing(gs_url):
    st = storage_for(gs_url)
    client = st.client
    upload = client.create_upload(st.key(f"{gs_url}/model.ckpt-1.data-00000-of-00001"))
    client.upload_part(upload, 1, b"part", crc=crc32c.crc32c(b"part"))
    assert st.list(gs_url) == [] and not st.exists(gs_url)  # Not even the run's prefix.
    assert st.leftovers(gs_url) == [f"{gs_url}/model.ckpt-1.data-00000-of-00001"]
    st.clean_leftovers(gs_url)
    assert client.list_uploads(st.key(gs_url)) == []


def test_a_missing_bucket_is_named(gcs_server):
    with pytest.raises(FileNotFoundError, match="the bucket 'no-such-bucket' does not exist"):
        object_storage(parse_url("gs://no-such-bucket/run"), dict(gcs_server.options()))


def test_an_unreachable_endpoint_fails_within_its_bound_and_names_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # Nothing listens there once it is closed.
    options = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "anonymous": True,
        "connect_timeout": 1.0,
        "max_attempts": 2,
    }
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        object_storage(parse_url("gs://tsv-test/run"), options)
    assert time.monotonic() - start < 60  # Bounded by the retry deadline, never a hang.


def test_unknown_options_are_refused():
    with pytest.raises(ValueError, match="unknown storage options \\['endpoint'\\]"):
        object_storage(parse_url("gs://tsv-test/run"), {"endpoint": "http://x"})
