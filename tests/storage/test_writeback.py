"""``start_writeback``: a hint to start writing a file's pages, and ``put_streamed``'s use of it."""

from __future__ import annotations

import os
import sys

import pytest

from torchsupervisor.storage import LocalStorage
from torchsupervisor.storage import local as local_module
from torchsupervisor.storage.writeback import start_writeback


def test_start_writeback_on_a_file_leaves_its_bytes_as_written(tmp_path):
    path = tmp_path / "f"
    data = os.urandom(3 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, data)
        start_writeback(fd, 0, len(data))
        start_writeback(fd, 1 << 20, 0)  # Nothing to start.
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == data


def test_start_writeback_ignores_what_it_cannot_do():
    """A pipe (ESPIPE) or a closed descriptor (EBADF): the hint is dropped, nothing raised
    (the caller's fsync reports real errors)."""
    read_end, write_end = os.pipe()
    try:
        start_writeback(write_end, 0, 10)
    finally:
        os.close(read_end)
        os.close(write_end)
    start_writeback(write_end, 0, 10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range: Linux")
def test_the_hint_is_the_linux_call():
    from torchsupervisor.storage.writeback import _sync_file_range

    assert _sync_file_range() is not None


def test_put_streamed_starts_each_chunks_writeback_at_its_offset(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(
        local_module, "start_writeback", lambda fd, offset, n: calls.append((offset, n))
    )
    chunks = [b"a" * 5, bytearray(b"b" * 7), memoryview(b"c" * 3)]
    path = str(tmp_path / "out")
    LocalStorage().put_streamed(path, iter(chunks))
    assert calls == [(0, 5), (5, 7), (12, 3)]
    with open(path, "rb") as f:
        assert f.read() == b"a" * 5 + b"b" * 7 + b"c" * 3
