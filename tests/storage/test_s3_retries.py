"""Transient S3 errors are retried with backoff; lasting ones fail within a bounded time.

The faults are real network events between boto3 and the real S3 server (SeaweedFS): a proxy
answers the first connections with S3's ``503 SlowDown`` or resets them.
"""

from __future__ import annotations

import time

import pytest
from faulty_proxy import FaultyProxy

from torchsupervisor.storage.objects import ObjectStorage
from torchsupervisor.storage.s3 import S3Client


def _storage(s3_server, endpoint: str, max_attempts: int = 5) -> ObjectStorage:
    options = {**s3_server.options(), "endpoint_url": endpoint, "max_attempts": max_attempts}
    return ObjectStorage(S3Client("tsv-test", options))


@pytest.fixture
def proxies(s3_server):
    made: list[FaultyProxy] = []

    def make(failures, mode="503"):
        made.append(FaultyProxy(s3_server.endpoint, failures, mode))
        return made[-1]

    yield make
    for proxy in made:
        proxy.close()


@pytest.mark.parametrize("mode", ["503", "reset"])
def test_transient_errors_are_retried_until_the_request_succeeds(s3_server, s3_url, proxies, mode):
    proxy = proxies(2, mode)
    st = _storage(s3_server, proxy.endpoint)
    st.put(f"{s3_url}/obj", [b"payload"])
    assert proxy.failed == 2 and proxy.forwarded >= 1
    # What the retried request stored is what was sent: read back through the real server.
    direct = _storage(s3_server, s3_server.endpoint)
    assert direct.read_bytes(f"{s3_url}/obj", max_bytes=100) == b"payload"


def test_a_lasting_error_fails_after_max_attempts_naming_the_object(s3_server, s3_url, proxies):
    proxy = proxies(None, "503")
    st = _storage(s3_server, proxy.endpoint, max_attempts=3)
    started = time.monotonic()
    with pytest.raises(OSError, match="SlowDown") as caught:
        st.put(f"{s3_url}/obj", [b"payload"])
    assert f"{s3_url}/obj" in str(caught.value)
    assert proxy.failed == 3  # Three attempts, then the error: no hang.
    assert time.monotonic() - started < 60
    assert not _storage(s3_server, s3_server.endpoint).exists(f"{s3_url}/obj")
