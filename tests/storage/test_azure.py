"""``az://`` on an Azure Blob emulator (Azurite): what differs from S3 in ``AzureClient``.

The Storage contract itself runs on ``az://`` with every other object store
(``testobject_storage.py``, ``checkpoint/test_object_stores.py``); here: multipart uploads as
staged blocks (invisible until committed, discarded on abort), and
the errors for a missing container, a missing account or an unreachable endpoint.
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


def test_a_multipart_upload_is_staged_blocks_invisible_until_committed(az_url):
    st = ObjectStorage(storage_for(az_url).client, part_bytes=1024, max_concurrency=4)
    client = st.client
    key = st.key(f"{az_url}/shard")
    upload = client.create_upload(key)
    first = bytes([1]) * 10
    parts = [client.upload_part(upload, 1, first, crc=crc32c.crc32c(first))]
    parts.append(client.upload_part(upload, 2, b"tail", crc=crc32c.crc32c(b"tail")))
    assert not st.exists(f"{az_url}/shard") and st.leftovers(az_url) == [f"{az_url}/shard"]
    client.complete_upload(upload, parts)
    assert st.read_bytes(f"{az_url}/shard", max_bytes=100) == bytes([1]) * 10 + b"tail"
    assert st.leftovers(az_url) == []
    data = os.urandom(10 * 1024 + 3)  # Through put: 11 blocks.
    st.put(f"{az_url}/big", [data])
    assert st.read_bytes(f"{az_url}/big", max_bytes=len(data)) == data


def test_an_aborted_upload_leaves_nothing(az_url):
    st = storage_for(az_url)
    client = st.client
    upload = client.create_upload(st.key(f"{az_url}/model.ckpt-1.data-00000-of-00001"))
    client.upload_part(upload, 1, b"part", crc=crc32c.crc32c(b"part"))
    assert st.list(az_url) == []  # Neither the blocks nor the marker show.
    assert st.clean_leftovers(az_url) == [f"{az_url}/model.ckpt-1.data-00000-of-00001"]
    assert client.list_uploads(st.key(az_url)) == []
    assert client.list(UPLOADS_PREFIX + st.key(az_url), delimiter=False) == ([], [])


def test_a_missing_container_is_named(azure_server):
    with pytest.raises(FileNotFoundError, match="the container 'no-such' does not exist"):
        object_storage(parse_url("az://no-such/run"), dict(azure_server.options()))


def test_no_account_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    with pytest.raises(ValueError, match="no Azure account: set AZURE_STORAGE_CONNECTION_STRING"):
        object_storage(parse_url("az://tsv-test/run"), {})


def test_an_unreachable_endpoint_fails_within_its_bound_and_names_it(azure_server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # Nothing listens there once it is closed.
    dead = azure_server.connection_string.replace(
        azure_server.endpoint.split("/")[2], f"127.0.0.1:{port}"
    )
    options = {"connection_string": dead, "connect_timeout": 1.0, "max_attempts": 2}
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        object_storage(parse_url("az://tsv-test/run"), options)
    assert time.monotonic() - start < 60  # Bounded by attempts x timeout, never a hang.
