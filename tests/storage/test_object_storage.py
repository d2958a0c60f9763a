"""``ObjectStorage`` on a real S3 server (SeaweedFS) and on ``memory://``: the Storage contract
without rename, append or fsync."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time

import crc32c
import pytest

from torchsupervisor.errors import (
    LogdirLockedError,
    NotRegularFileError,
    OutsideDirectoryError,
    UnimplementedError,
    WriteCancelled,
)
from torchsupervisor.storage import ObjectStorage, storage_for
from torchsupervisor.storage.lock import LOCK_FILENAME
from torchsupervisor.storage.object_lock import LockTable, lock_key, read_lock
from torchsupervisor.storage.objects import ABSENT, PreconditionFailed

MIB = 1 << 20


@pytest.fixture(params=["memory", "s3", "gs", "az"])
def url(request) -> str:
    """A fresh prefix on each kind of object store."""
    return request.getfixturevalue(f"{request.param}_url")


def _storage(url: str, **tuning) -> ObjectStorage:
    """A storage of its own on ``url``'s bucket (own tuning, own writer locks)."""
    return ObjectStorage(storage_for(url).client, **tuning)


def test_put_read_list_and_delete(url):
    st = storage_for(url)
    st.put(f"{url}/a", [b"hello ", memoryview(b"world")])
    st.put(f"{url}/sub/b", [b""])
    assert st.read_bytes(f"{url}/a", max_bytes=100) == b"hello world"
    assert st.list(url) == ["a", "sub"] and st.list_tree(url) == ["a", "sub/b"]
    assert st.is_file(f"{url}/a") and not st.is_dir(f"{url}/a")
    assert st.is_dir(f"{url}/sub") and not st.is_file(f"{url}/sub")
    assert st.exists(f"{url}/sub") and not st.exists(f"{url}/none")
    assert st.size(f"{url}/a") == 11 and st.size(f"{url}/sub/b") == 0
    assert abs(st.mtime(f"{url}/a") - time.time()) < 300
    with st.open_read(f"{url}/a") as f:
        view = memoryview(bytearray(5))
        assert f.readinto(view, 6) == 5 and bytes(view) == b"world"
        assert f.readinto(view, 11) == 0
    st.delete(f"{url}/a")
    assert not st.exists(f"{url}/a") and st.list(url) == ["sub"]
    with pytest.raises(FileNotFoundError):
        st.delete(f"{url}/a")
    assert st.list(f"{url}/nothing-here") == []
    with pytest.raises(FileNotFoundError):
        st.list_tree(f"{url}/nothing-here")


def test_open_read_refuses_missing_objects_prefixes_and_other_directories(url):
    st = storage_for(url)
    st.put(f"{url}/d/x", [b"1"])
    with pytest.raises(FileNotFoundError):
        st.open_read(f"{url}/missing")
    with pytest.raises(NotRegularFileError):
        st.open_read(f"{url}/d")
    with pytest.raises(OutsideDirectoryError):
        st.open_read(f"{url}/d/x", inside=url)
    st.open_read(f"{url}/d/x", inside=f"{url}/d").close()


def test_a_large_object_is_uploaded_in_parts_and_read_back_whole(url):
    st = _storage(url, part_bytes=5 * MIB, max_concurrency=2)
    data = os.urandom(12 * MIB + 123)
    chunks = [memoryview(data)[i : i + 3 * MIB] for i in range(0, len(data), 3 * MIB)]
    st.put(f"{url}/big", chunks)
    assert st.size(f"{url}/big") == len(data)
    assert st.read_bytes(f"{url}/big", max_bytes=len(data)) == data
    assert st.leftovers(url) == []


def test_a_failed_put_leaves_the_old_object_and_no_upload(url):
    st = _storage(url, part_bytes=5 * MIB)
    st.put(f"{url}/obj", [b"old"])

    def failing():
        yield os.urandom(6 * MIB)  # A whole part is sent before the failure.
        raise OSError("disk read error in the middle of a save")

    with pytest.raises(OSError, match="middle of a save"):
        st.put(f"{url}/obj", failing())
    assert st.read_bytes(f"{url}/obj", max_bytes=10) == b"old"
    assert st.leftovers(url) == []


def test_a_cancelled_put_commits_nothing(url):
    st = _storage(url, part_bytes=5 * MIB)
    cancel = threading.Event()

    def chunks():
        yield os.urandom(6 * MIB)
        cancel.set()
        yield b"more"

    with pytest.raises(WriteCancelled):
        st.put(f"{url}/obj", chunks(), cancel=cancel)
    assert not st.exists(f"{url}/obj") and st.leftovers(url) == []


def test_readers_see_the_old_object_until_a_multipart_upload_completes(url):
    st = _storage(url, part_bytes=5 * MIB)
    st.put(f"{url}/obj", [b"old"])
    seen = []

    def chunks():
        for _ in range(3):
            yield os.urandom(5 * MIB)
            seen.append(st.read_bytes(f"{url}/obj", max_bytes=100))

    st.put(f"{url}/obj", chunks())
    assert seen == [b"old"] * 3 and st.size(f"{url}/obj") == 15 * MIB


def test_the_store_refuses_a_body_whose_crc32c_does_not_match(url):
    client = storage_for(url).client
    key = storage_for(url).key(f"{url}/obj")
    # S3 refuses the request; GCS (or its emulator, which stores and reports the CRC-32C of
    # what it got) is checked by the client, which deletes the object; for Azure (MD5 only)
    # the client checks the bytes before it sends them.
    pattern = r"BadDigest|GCS stored a different CRC-32C|do not match their CRC-32C"
    with pytest.raises(OSError, match=pattern):
        client.put_object(key, b"payload", crc=crc32c.crc32c(b"payloaD"))
    assert not storage_for(url).exists(f"{url}/obj")


def test_a_delete_on_a_stale_version_is_refused(url):
    # GCS: its generation; Azure and S3: the ETag; fake-gcs-server ignores the condition on a
    # delete, so the GCS client also looks first.
    st = storage_for(url)
    client = st.client
    key = st.key(f"{url}/lock")
    first = client.put_object(key, b"1", crc=crc32c.crc32c(b"1"))
    second = client.put_object(key, b"2", crc=crc32c.crc32c(b"2"), only_if=first)
    with pytest.raises(PreconditionFailed):
        client.delete(key, if_match=first)
    client.delete(key, if_match=second)
    assert not st.exists(f"{url}/lock")


def test_unfinished_uploads_are_leftovers_and_cleaned(url):
    st = storage_for(url)
    client = st.client
    upload = client.create_upload(st.key(f"{url}/crashed"))
    client.upload_part(upload, 1, b"part", crc=crc32c.crc32c(b"part"))
    deeper = client.create_upload(st.key(f"{url}/sub/other"))
    assert st.leftovers(url) == [f"{url}/crashed"]
    assert st.clean_leftovers(url) == [f"{url}/crashed"]
    assert st.leftovers(url) == [] and not st.exists(f"{url}/crashed")
    client.abort_upload(deeper)


def test_conditional_puts(url):
    client = storage_for(url).client
    key = storage_for(url).key(f"{url}/lock")
    first = client.put_object(key, b"1", crc=crc32c.crc32c(b"1"), only_if=ABSENT)
    with pytest.raises(PreconditionFailed):
        client.put_object(key, b"2", crc=crc32c.crc32c(b"2"), only_if=ABSENT)
    second = client.put_object(key, b"3", crc=crc32c.crc32c(b"3"), only_if=first)
    with pytest.raises(PreconditionFailed):
        client.put_object(key, b"4", crc=crc32c.crc32c(b"4"), only_if=first)
    with pytest.raises(PreconditionFailed):
        client.delete(key, if_match=first)
    client.delete(key, if_match=second)
    assert not storage_for(url).exists(f"{url}/lock")


def test_one_writer_per_prefix(url):
    mine = _storage(url)
    lock = mine.lock(url)
    owner = mine.lock_owner(url)
    assert owner["pid"] == os.getpid() and owner["host"]
    other = LockTable()  # Another writer: its own lock table, as another process has.
    with pytest.raises(LogdirLockedError, match=f"Another process is writing to {url}: pid"):
        other.acquire(_storage(url), url)
    again = mine.lock(url)  # Shared within the process.
    lock.release()
    with pytest.raises(LogdirLockedError):
        other.acquire(_storage(url), url)
    again.release()
    assert not storage_for(url).exists(f"{url}/{LOCK_FILENAME}")
    other.acquire(_storage(url), url).release()


def test_two_storages_of_one_process_share_the_lock_of_a_prefix(url):
    # A Supervisor's storage and a Saver's own on the same bucket: not two writers.
    first, second = _storage(url).lock(url), _storage(url).lock(url)
    first.release()
    assert storage_for(url).lock_owner(url)["pid"] == os.getpid()
    second.release()
    assert storage_for(url).lock_owner(url) == {}


def _write_lock(url: str, owner: dict) -> None:
    storage_for(url).put(f"{url}/{LOCK_FILENAME}", [json.dumps(owner).encode()])


def test_the_lock_of_a_dead_process_on_this_host_is_taken_over(url, caplog):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    import socket

    _write_lock(
        url, {"pid": int(dead.stdout), "host": socket.gethostname(), "heartbeat": time.time()}
    )
    with caplog.at_level("WARNING", logger="torchsupervisor"):
        lock = _storage(url).lock(url)
    assert "Taking over the writer lock" in caplog.text
    assert storage_for(url).lock_owner(url)["pid"] == os.getpid()
    lock.release()


def test_a_lock_held_elsewhere_that_nobody_renews_is_taken_over_after_its_ttl(url):
    # Judged on this process's monotonic clock: the lock object unchanged for the TTL.
    _write_lock(url, {"pid": 1, "host": "elsewhere", "heartbeat": time.time(), "ttl": 0.5})
    start = time.monotonic()
    _storage(url, lock_ttl_secs=0.5).lock(url).release()
    assert time.monotonic() - start >= 0.5


class _RemoteHolder:
    """A writer of another host: renews its lock object every ``beat_secs`` (heartbeats
    stamped by its own clock, ``skew_secs`` off this one)."""

    def __init__(self, url: str, skew_secs: float, beat_secs: float = 0.1) -> None:
        self.url, self.skew, self.beat = url, skew_secs, beat_secs
        self.stop = threading.Event()
        self._write()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _write(self) -> None:
        owner = {"pid": 1, "host": "elsewhere", "heartbeat": time.time() + self.skew, "ttl": 1}
        _write_lock(self.url, owner)

    def _run(self) -> None:
        while not self.stop.wait(self.beat):
            self._write()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


@pytest.mark.parametrize("skew_secs", [-3600.0, 0.0, 3600.0], ids=["behind", "same", "ahead"])
def test_a_live_writer_elsewhere_keeps_its_lock_whatever_its_clock(url, skew_secs):
    # Another host's clock an hour behind made its heartbeat look an hour old: its live lock
    # was taken over, and both runs wrote one prefix.
    holder = _RemoteHolder(url, skew_secs)
    try:
        with pytest.raises(LogdirLockedError, match=r"pid 1 on host elsewhere.*heartbeat renews"):
            _storage(url, lock_ttl_secs=1.0).lock(url)
    finally:
        holder.close()
    assert storage_for(url).lock_owner(url)["host"] == "elsewhere"


def test_the_holder_renews_its_heartbeat(url):
    lock = _storage(url, lock_ttl_secs=0.3).lock(url)
    try:
        first = storage_for(url).lock_owner(url)["heartbeat"]
        deadline = time.monotonic() + 30
        while storage_for(url).lock_owner(url)["heartbeat"] == first:
            assert time.monotonic() < deadline, "the heartbeat was never renewed"
            time.sleep(0.05)
    finally:
        lock.release()


class _ReplacedWhileRead:
    """A client on which the writer of ``key`` replaces it (longer) between a reader's HEAD and
    its first GET: a heartbeat renewing a lock, a save rewriting the state file."""

    def __init__(self, client, key: str, replacement: bytes) -> None:
        self._client, self._key, self._replacement = client, key, replacement
        self.replaced = 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    def get_range(self, key, offset, length):
        if key == self._key and not self.replaced:
            self.replaced += 1
            body = self._replacement
            self._client.put_object(key, body, crc=crc32c.crc32c(body))
        return self._client.get_range(key, offset, length)


def test_a_lock_renewed_while_it_is_read_is_read_again_whole(url):
    st = storage_for(url)
    _write_lock(url, {"pid": 1, "host": "elsewhere", "heartbeat": 1.0})
    key = lock_key(st.key(url))
    renewed = {"pid": 1, "host": "elsewhere", "heartbeat": 1234567890.125, "ttl": 30.0}
    client = _ReplacedWhileRead(st.client, key, json.dumps(renewed).encode())
    owner, etag = read_lock(client, key)
    assert client.replaced == 1
    assert owner == renewed  # Not the first bytes of the new version, read as no owner.
    assert etag == st.client.head(key).etag


def test_an_object_replaced_while_it_is_read_is_read_again_whole(url):
    st = storage_for(url)
    path = f"{url}/checkpoint"
    st.put(path, [b'model_checkpoint_path: "model.ckpt-90"\n'])
    new = b'model_checkpoint_path: "model.ckpt-100"\nall_model_checkpoint_paths: "model.ckpt-100"\n'
    client = _ReplacedWhileRead(st.client, st.key(path), new)
    assert ObjectStorage(client).read_bytes(path, max_bytes=1000) == new
    assert client.replaced == 1  # Not the new version's first 39 bytes, a cut text.


def test_an_object_replaced_at_every_read_is_an_error_not_a_cut_text(url):
    st = storage_for(url)
    path = f"{url}/checkpoint"
    st.put(path, [b"first version"])
    client = _ReplacedWhileRead(st.client, st.key(path), b"")
    bodies = iter(f"version {i}, longer than the one before{'!' * i}".encode() for i in range(9))

    def replace_each_time(key, offset, length):
        client.replaced += 1
        body = next(bodies)
        st.client.put_object(key, body, crc=crc32c.crc32c(body))
        return st.client.get_range(key, offset, length)

    client.get_range = replace_each_time
    with pytest.raises(OSError, match="replaced 3 times while it was read") as e:
        ObjectStorage(client).read_bytes(path, max_bytes=1000)
    assert e.value.errno == errno.EAGAIN and client.replaced == 3


def test_an_appended_object_is_uploaded_whole_at_each_sync(url):
    st = storage_for(url)
    f = st.open_append(f"{url}/events")
    f.write(b"one ")
    assert not st.exists(f"{url}/events")
    f.sync()
    assert st.read_bytes(f"{url}/events", max_bytes=100) == b"one "
    f.write(b"two")
    f.sync()
    f.close()
    assert st.read_bytes(f"{url}/events", max_bytes=100) == b"one two"
    with pytest.raises(FileExistsError):
        st.open_append(f"{url}/events")


def test_any_prefix_accepts_objects_and_urls_of_another_bucket_are_refused(url):
    st = storage_for(url)
    assert st.accepts_objects(f"{url}/new/prefix") and not st.is_dir(f"{url}/new/prefix")
    with pytest.raises(ValueError, match="is not in"):
        st.put("memory://another-bucket/x" if url.startswith("s3") else "s3://b/x", [b""])


def test_unknown_schemes_are_refused_with_the_available_ones():
    with pytest.raises(UnimplementedError, match=r"no storage for hdfs:// \(available: s3://"):
        storage_for("hdfs://bucket/run")


def _fresh(url: str, **options):
    """A storage made anew for the bucket of ``url`` with ``options`` (not the cached one)."""
    from torchsupervisor.storage import object_storage
    from torchsupervisor.storage.paths import parse_url

    return object_storage(parse_url(url), dict(options))


def test_a_missing_bucket_is_named(s3_server):
    with pytest.raises(FileNotFoundError, match="the bucket 'no-such-bucket' does not exist"):
        _fresh("s3://no-such-bucket/run", **s3_server.options())


def test_refused_credentials_are_a_permission_error(s3_server):
    options = {**s3_server.options(), "aws_secret_access_key": "wrong"}
    with pytest.raises(PermissionError):
        _fresh("s3://tsv-test/run", **options)


def test_an_unreachable_endpoint_fails_quickly_and_names_it(s3_server):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # Nothing listens there once it is closed.
    options = {
        **s3_server.options(),
        "endpoint_url": f"http://127.0.0.1:{port}",
        "connect_timeout": 1.0,
        "max_attempts": 2,
    }
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port} is unreachable"):
        _fresh("s3://tsv-test/run", **options)
    assert time.monotonic() - start < 60  # Bounded by attempts x timeout, never a hang.


def test_unknown_options_are_refused(s3_server):
    with pytest.raises(ValueError, match="unknown storage options \\['endpoint'\\]"):
        _fresh("s3://tsv-test/run", endpoint="http://x")


def test_sequential_and_random_reads_of_a_large_object(url):
    from torchsupervisor.storage.object_reads import READ_PART_BYTES

    st = _storage(url, part_bytes=5 * MIB)
    data = os.urandom(3 * READ_PART_BYTES + 12345)
    st.put(f"{url}/big", [data])
    with st.open_read(f"{url}/big") as f:
        f.read_ahead(100)
        got, offset, step = bytearray(), 100, 3 * MIB + 7  # Reads that straddle parts.
        while True:
            view = memoryview(bytearray(step))
            n = f.readinto(view, offset)
            if not n:
                break
            got += view[:n]
            offset += n
        assert bytes(got) == data[100:]
        view = memoryview(bytearray(10))
        assert f.readinto(view, READ_PART_BYTES - 5) == 10  # Back, across a part boundary.
        assert bytes(view) == data[READ_PART_BYTES - 5 : READ_PART_BYTES + 5]
    with pytest.raises(ValueError, match="closed"):
        f.readinto(memoryview(bytearray(1)), 0)


class _CountingGets:
    """A client that records the ranges of its GETs."""

    def __init__(self, client) -> None:
        self._client, self.ranges = client, []

    def __getattr__(self, name):
        return getattr(self._client, name)

    def get_range(self, key, offset, length):
        self.ranges.append((offset, length))
        return self._client.get_range(key, offset, length)


def test_reads_fetch_exactly_their_bytes_until_the_reader_streams(url):
    """A resharded restore reads some rows of many chunks, and small tensors between them:
    each read fetches its own bytes, not the 8 MiB parts around them. A reader that names
    where it reads next (``read_ahead``), or goes on in sequence past a part's worth of bytes,
    streams: the parts ahead of it are in flight."""
    from torchsupervisor.storage.object_reads import READ_PART_BYTES as PART

    data = os.urandom(3 * PART + 12345)
    storage_for(url).put(f"{url}/big", [data])
    client = _CountingGets(storage_for(url).client)

    def read(f, at, size):
        view = memoryview(bytearray(size))
        assert f.readinto(view, at) == size and bytes(view) == data[at : at + size]

    def fetched(count):  # The GETs ahead run on the reader's threads: wait for them (10 s).
        deadline = time.monotonic() + 10
        while len(client.ranges) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return sorted(client.ranges)

    with ObjectStorage(client).open_read(f"{url}/big") as f:
        # Out of sequence, and short runs in sequence: exactly the bytes read.
        for at, size in ((100, 4096), (4196, 50), (PART - 10, 20), (2 * PART + 7, 9000)):
            read(f, at, size)
        assert client.ranges == [(100, 4096), (4196, 50), (PART - 10, 20), (2 * PART + 7, 9000)]
        client.ranges.clear()
        read(f, 0, PART)  # A part's worth in sequence: the next read streams.
        assert client.ranges == [(0, PART)]
        read(f, PART, 100)
        assert fetched(4) == [
            (0, PART),
            (PART, PART),
            (2 * PART, PART),
            (3 * PART, 12345),
        ]
    client.ranges.clear()
    with ObjectStorage(client).open_read(f"{url}/big") as f:
        f.read_ahead(PART + 5)
        read(f, PART + 5, 100)
        assert fetched(3) == [(PART + 5, PART - 5), (2 * PART, PART), (3 * PART, 12345)]


def _wait_lost(storage, url, deadline_secs: float = 30) -> LogdirLockedError:
    """Wait until a write of ``storage`` into ``url`` is refused; return the error."""
    deadline = time.monotonic() + deadline_secs
    while True:
        try:
            storage.put(f"{url}/probe", [b"x"])
        except LogdirLockedError as e:
            return e
        assert time.monotonic() < deadline, "the lost lock was never noticed"
        time.sleep(0.05)


def test_a_holder_that_lost_its_lock_writes_nothing_more(url, caplog):
    mine = _storage(url, lock_ttl_secs=0.3)
    lock = mine.lock(url)
    lost = []

    def slow_callback(error):
        time.sleep(0.3)  # A refused write still comes after it: the callback stops training.
        lost.append(error)

    lock.on_lost(slow_callback)
    try:
        with caplog.at_level("ERROR", logger="torchsupervisor"):
            _write_lock(url, {"pid": 1, "host": "elsewhere", "heartbeat": time.time()})
            error = _wait_lost(mine, url)
        assert "lost the writer lock" in str(error) and "pid 1 on host elsewhere" in str(error)
        assert lost == [error]
        with pytest.raises(LogdirLockedError):
            mine.delete(f"{url}/probe")
        late = []
        lock.on_lost(late.append)  # Registered after the loss: called at once.
        assert late == [error]
    finally:
        lock.release()
    assert storage_for(url).lock_owner(url)["host"] == "elsewhere"  # Not ours to remove.


def test_a_holder_that_cannot_renew_for_its_ttl_counts_its_lock_lost(memory_url, monkeypatch):
    # A partition: another writer takes the lock once it saw no heartbeat for the TTL, so the
    # holder must stop writing before that, on its own clock.
    mine = _storage(memory_url, lock_ttl_secs=0.5)
    lock = mine.lock(memory_url)
    real_put = mine.client.put_object
    key = lock_key(mine.key(memory_url))

    def partitioned(k, *args, **kwargs):
        if k == key:
            raise OSError("connection timed out")
        return real_put(k, *args, **kwargs)

    monkeypatch.setattr(mine.client, "put_object", partitioned)
    try:
        start = time.monotonic()
        error = _wait_lost(mine, memory_url)
        assert time.monotonic() - start < 0.5  # Before another writer may take it over.
        assert "could not be renewed" in str(error) or "was not renewed" in str(error)
    finally:
        lock.release()


def test_a_supervisor_whose_lock_was_taken_stops_with_that_error(memory_url):
    import torch

    from torchsupervisor import GlobalStep, Supervisor
    from torchsupervisor.storage import configure

    configure(memory_url, lock_ttl_secs=0.3)
    step = GlobalStep()
    sv = Supervisor(logdir=memory_url, state={"w": torch.zeros(1), "global_step": step})
    deadline = time.monotonic() + 30
    lost = pytest.raises(LogdirLockedError, match=r"lost the writer lock.*host elsewhere")
    with lost, sv.managed_session():
        _write_lock(memory_url, {"pid": 1, "host": "elsewhere", "heartbeat": time.time()})
        while not sv.should_stop():
            assert time.monotonic() < deadline, "training went on with a lost lock"
            step.increment()
            time.sleep(0.01)
