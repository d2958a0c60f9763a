"""``shard_io.parallel_reads``: several reads in flight, chunks handed over in file order."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from torchsupervisor.checkpoint import shard_io
from torchsupervisor.checkpoint.shard_io import parallel_reads, tensor_reads
from torchsupervisor.errors import CorruptCheckpointError
from torchsupervisor.storage import Readable

DATA = bytes(range(256)) * 4  # 1,024 bytes.


class _Bytes(Readable):
    """Bytes in memory; the read at offset 0 waits until a later read has run (bounded)."""

    concurrent_reads = 4

    def __init__(self, data: bytes, *, fail_at: int | None = None, wait_first: bool = True):
        super().__init__("mem/shard", len(data))
        self.data = data
        self.fail_at = fail_at
        self.wait_first = wait_first
        self.later_read = threading.Event()
        self.offsets: list[int] = []
        self.lock = threading.Lock()

    def readinto(self, view: memoryview, offset: int) -> int:
        with self.lock:
            self.offsets.append(offset)
        if offset == 0 and self.wait_first:
            # Only a reader with other reads in flight gets past this.
            assert self.later_read.wait(10), "no read ran while the first one waited"
        elif offset:
            self.later_read.set()
        if offset == self.fail_at:
            raise OSError(errno.EIO, "Input/output error", self.path)
        n = max(0, min(len(view), len(self.data) - offset))
        view[:n] = self.data[offset : offset + n]
        return n

    def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(shard_io, "_PARALLEL_CHUNK_BYTES", 64)


def _readers() -> list[str]:
    return [t.name for t in threading.enumerate() if "checkpoint-reader" in t.name]


def test_chunks_come_in_file_order_while_later_ones_are_read():
    f = _Bytes(DATA)
    tensors = [("a", 0, 200), ("empty", 200, 0), ("b", 200, 500), ("c", 700, 324)]
    got = list(parallel_reads(f, tensors))
    assert [name for name, _, _ in got] == ["a"] * 4 + ["empty"] + ["b"] * 8 + ["c"] * 6
    assert b"".join(bytes(chunk) for _, _, chunk in got) == DATA
    buffers = {name: bytes(raw.numpy()) for name, raw, _ in got}
    assert buffers == {"a": DATA[:200], "empty": b"", "b": DATA[200:700], "c": DATA[700:]}
    assert all(raw.dtype == torch.uint8 for _, raw, _ in got)
    assert sorted(f.offsets) == sorted(set(f.offsets))  # Each chunk read once.
    assert not _readers()


def test_a_failed_read_is_raised_and_the_readers_are_joined():
    f = _Bytes(DATA, fail_at=128, wait_first=False)
    with pytest.raises(OSError, match="Input/output error"):
        list(parallel_reads(f, [("a", 0, 1024)]))
    assert not _readers()


def test_a_file_ending_early_is_truncation_naming_it():
    f = _Bytes(DATA[:900], wait_first=False)
    with pytest.raises(CorruptCheckpointError, match="mem/shard is truncated"):
        list(parallel_reads(f, [("a", 0, 1024)]))
    assert not _readers()


def test_closing_early_stops_the_readers():
    f = _Bytes(DATA * 16, wait_first=False)
    reads = parallel_reads(f, [("a", 0, len(DATA) * 16)])
    name, _, chunk = next(reads)
    assert (name, bytes(chunk)) == ("a", DATA[:64])
    reads.close()
    assert not _readers()
    # At most 2 x 4 chunks are asked for ahead of the one handed over; the rest never are.
    assert len(f.offsets) <= 1 + 2 * f.concurrent_reads


def test_a_local_shard_is_read_on_the_reader_threads(tmp_path, monkeypatch):
    from torchsupervisor.storage import LocalStorage

    path = tmp_path / "shard"
    path.write_bytes(DATA)
    threads: set[str] = set()
    read = shard_io.pread_exactly

    def recorded(f, view, offset):
        threads.add(threading.current_thread().name)
        read(f, view, offset)

    monkeypatch.setattr(shard_io, "pread_exactly", recorded)
    with LocalStorage().open_read(str(path)) as f:
        assert f.concurrent_reads == 4
        got = b"".join(bytes(chunk) for _, _, chunk in tensor_reads(f, [("a", 0, len(DATA))]))
    assert got == DATA
    assert threads and all(name.startswith("torchsupervisor-checkpoint-reader") for name in threads)


def test_the_storage_chooses_parallel_or_in_order_reads():
    parallel = _Bytes(DATA)
    assert b"".join(bytes(c) for _, _, c in tensor_reads(parallel, [("a", 0, 1024)])) == DATA

    in_order = _Bytes(DATA, wait_first=False)
    in_order.concurrent_reads = 1
    asked: list[int] = []
    in_order.read_ahead = asked.append  # type: ignore[method-assign]
    assert b"".join(bytes(c) for _, _, c in tensor_reads(in_order, [("a", 8, 1016)])) == DATA[8:]
    assert asked == [8]
    assert in_order.offsets == [8]  # One read: below _PIPELINE_MIN_BYTES, nothing chunked.
