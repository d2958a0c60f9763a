"""Reads of an object in a bucket: ranged GETs, exact for lone reads, ahead for a stream.

``ObjectStorage.open_read`` returns an ``ObjectReadable``. A restore at another world size reads
a few rows of many chunks; a whole restore streams a file from its start; both go through it.

TF name: none (TF's ``RandomAccessFile`` of its GCS and S3 file systems).
"""

from __future__ import annotations

import concurrent.futures
import threading

from torchsupervisor.storage.base import Readable
from torchsupervisor.storage.object_client import ObjectClient

__all__ = ["READ_AHEAD_PARTS", "READ_PART_BYTES", "ObjectReadable"]

READ_PART_BYTES = 8 << 20
"""Bytes per ranged GET of a read."""

READ_AHEAD_PARTS = 4
"""Parts fetched ahead of a streaming reader (with the one being read: the GETs in flight)."""


class ObjectReadable(Readable):
    """Ranged GETs: exactly the bytes asked for, with read-ahead for a streaming reader.

    A read fetches exactly its bytes, in GETs of at most ``READ_PART_BYTES`` in parallel: a
    header, one tensor, the rows of a chunk that a resharded restore needs (a rank reading
    some rows of many chunks, and whole small tensors between them, fetches about what it
    holds, not the parts around them). A reader is streaming once ``read_ahead`` named where
    it reads next, or once it has read ``READ_PART_BYTES`` in sequence (each read starting
    where the last ended: its next read in sequence streams). Its reads are then served from
    parts (from the read's start to the end of its ``READ_PART_BYTES``-aligned part, then
    whole aligned parts), and the ``READ_AHEAD_PARTS`` parts after the one read are fetched
    too, so a restore keeps several requests in flight, as a multipart download does. A read
    out of sequence ends the stream.
    Parts behind the reader are dropped.
    """

    def __init__(self, client: ObjectClient, path: str, key: str, size: int) -> None:
        super().__init__(path, size)
        self._client = client
        self._key = key
        self._mutex = threading.Lock()
        # Part index: (first byte fetched, its bytes to the part's end).
        self._parts: dict[int, tuple[int, concurrent.futures.Future[bytes]]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._expected = -1  # Where a sequential reader reads next.
        self._run = 0  # Bytes read in sequence up to there.
        self._streaming = False
        self._closed = False

    def _get(self, start: int, end: int) -> concurrent.futures.Future[bytes]:
        """Submit the GET of bytes ``[start, end)`` (call with the mutex held)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                READ_AHEAD_PARTS + 1, thread_name_prefix="torchsupervisor-download"
            )
        return self._pool.submit(self._client.get_range, self._key, start, end - start)

    def _part(
        self, index: int, start: int | None = None
    ) -> tuple[int, concurrent.futures.Future[bytes]]:
        """Part ``index`` from ``start`` (None: its beginning) on, fetched unless a fetch of it
        from there or before is there already (call with the mutex held)."""
        begin = index * READ_PART_BYTES if start is None else start
        found = self._parts.get(index)
        if found is None or found[0] > begin:
            found = (begin, self._get(begin, min((index + 1) * READ_PART_BYTES, self.size)))
            self._parts[index] = found
        return found

    def _held(self, offset: int, first: int, last: int) -> bool:
        """Whether the parts fetched hold every byte from ``offset`` in parts ``first..last``."""
        for i in range(first, last + 1):
            found = self._parts.get(i)
            if found is None or found[0] > max(offset, i * READ_PART_BYTES):
                return False
        return True

    def readinto(self, view: memoryview, offset: int) -> int:
        length = min(len(view), self.size - offset)
        if length <= 0:
            return 0
        end = offset + length
        first, last = offset // READ_PART_BYTES, (end - 1) // READ_PART_BYTES
        with self._mutex:
            if self._closed:
                raise ValueError(f"{self.path} is closed")
            for stale in [i for i in self._parts if i < first]:
                del self._parts[stale]  # Not cancelled: a reader on another thread may wait.
            if offset != self._expected:
                self._run, self._streaming = 0, False
            # Streaming: announced, or this read follows READ_PART_BYTES read in sequence.
            self._streaming = self._streaming or self._run >= READ_PART_BYTES
            self._run += length
            if self._streaming or self._held(offset, first, last):
                wanted = [self._part(first, offset), *map(self._part, range(first + 1, last + 1))]
                if self._streaming:  # Fetch ahead of it.
                    self._ahead(last + 1)
            else:  # Exactly its bytes.
                wanted = [
                    (at, self._get(at, min(at + READ_PART_BYTES, end)))
                    for at in range(offset, end, READ_PART_BYTES)
                ]
            self._expected = end
        done = 0
        for start, future in wanted:
            data = future.result()
            begin = offset + done - start
            piece = data[begin : begin + length - done]
            if not piece:
                break
            view[done : done + len(piece)] = piece
            done += len(piece)
        return done

    def read_ahead(self, offset: int) -> None:
        """Start fetching the parts from ``offset`` on (a reader about to read from there)."""
        with self._mutex:
            if not self._closed and 0 <= offset < self.size:
                index = offset // READ_PART_BYTES
                self._part(index, offset)
                self._ahead(index + 1, READ_AHEAD_PARTS - 1)
                self._expected, self._streaming = offset, True

    def _ahead(self, index: int, count: int = READ_AHEAD_PARTS) -> None:
        """Fetch the ``count`` parts from ``index`` on that are not fetched yet."""
        end = (self.size - 1) // READ_PART_BYTES
        for i in range(index, min(index + count, end + 1)):
            if i not in self._parts:
                self._part(i)

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            for _, future in self._parts.values():
                future.cancel()
            self._parts.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
