"""Checkpoints on an object store (a real S3 server, and ``memory://``): the same commit
protocol, retention, restore and fallback as on disk, with no rename."""

from __future__ import annotations

import errno
import logging
import threading

import crc32c
import pytest
import torch
from supervisor_helpers import Counter, wait_until

import torchsupervisor as ts
from torchsupervisor import Saver, Session
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.checkpoint.recovery import restore_candidates
from torchsupervisor.checkpoint.state_file import get_checkpoint_state, latest_checkpoint
from torchsupervisor.storage import ObjectStorage, storage_for


@pytest.fixture(params=["memory", "s3", "gs", "az"])
def url(request) -> str:
    return request.getfixturevalue(f"{request.param}_url")


def test_save_restore_and_retention(url):
    sess = Session({"w": torch.arange(4.0)})
    saver = Saver(max_to_keep=2)
    try:
        for step in (1, 2, 3):
            sess.state["w"].add_(1)
            assert saver.save(sess, f"{url}/model.ckpt", step) == f"{url}/model.ckpt-{step}"
    finally:
        saver.close()
    assert latest_checkpoint(url) == f"{url}/model.ckpt-3"
    state = get_checkpoint_state(url)
    assert list(state.all_model_checkpoint_paths) == [f"{url}/model.ckpt-2", f"{url}/model.ckpt-3"]
    names = storage_for(url).list(url)
    assert "model.ckpt-1.index" not in names and "model.ckpt-3.index" in names
    restored = Session({"w": torch.zeros(4)})
    Saver().restore(restored, latest_checkpoint(url))
    assert torch.equal(restored.state["w"], torch.arange(4.0) + 3)


def test_an_asynchronous_save_commits_in_the_background(url):
    sess = Session({"w": torch.randn(1000)})
    saver = Saver()
    try:
        future = saver.save_async(sess, f"{url}/model.ckpt", 7)
        assert future.result(timeout=120) == f"{url}/model.ckpt-7"
    finally:
        saver.close()
    assert restore_candidates(url) == [f"{url}/model.ckpt-7"]


def test_a_corrupt_newest_checkpoint_is_never_loaded_the_older_one_is(url, caplog):
    saver = Saver()
    sess = Session({"w": torch.ones(256), "global_step": ts.GlobalStep()})
    try:
        saver.save(sess, f"{url}/model.ckpt", 1)
        sess.state["w"].fill_(2.0)
        saver.save(sess, f"{url}/model.ckpt", 2)
    finally:
        saver.close()
    storage = storage_for(url)
    shard = f"{url}/model.ckpt-2.data-00000-of-00001"
    data = bytearray(storage.read_bytes(shard, max_bytes=1 << 20))
    data[len(data) // 2] ^= 0x40
    storage.put(shard, [bytes(data)])  # Damage after the commit (a bad disk behind the store).

    state = {"w": torch.zeros(256), "global_step": ts.GlobalStep()}
    sv = ts.Supervisor(logdir=url, state=state, save_model_secs=0, save_summaries_secs=0)
    with caplog.at_level("WARNING", logger="torchsupervisor"), sv.managed_session() as _:
        pass
    assert torch.equal(state["w"], torch.ones(256))
    assert "model.ckpt-2" in caplog.text


def test_the_supervisor_writes_checkpoints_and_events_to_the_store(url):
    model = torch.nn.Linear(3, 1)
    step = ts.GlobalStep()
    sv = ts.Supervisor(
        logdir=url,
        state={"model": model, "global_step": step},
        save_model_secs=0,
        save_summaries_secs=0,
    )
    with sv.managed_session() as sess:
        for i in range(3):
            step.increment()
            sv.summary_writer.add_scalar("x", float(i), i)
        sv.saver.save(sess, sv.save_path, global_step=3)
    names = storage_for(url).list(url)
    assert "model.ckpt-3.index" in names and "checkpoint" in names
    assert any(n.startswith("events.out.tfevents.") for n in names)
    assert storage_for(url).lock_owner(url) == {}  # Released at the end.

    again = {"model": torch.nn.Linear(3, 1), "global_step": ts.GlobalStep()}
    sv = ts.Supervisor(logdir=url, state=again, save_model_secs=0, save_summaries_secs=0)
    with sv.managed_session():
        assert again["global_step"].value == 3
    assert torch.equal(again["model"].weight, model.weight)


def test_a_start_cleans_what_a_crash_left(url, caplog):
    storage = storage_for(url)
    sess = Session({"w": torch.ones(8), "global_step": ts.GlobalStep()})
    saver = Saver()
    try:
        saver.save(sess, f"{url}/model.ckpt", 1)
    finally:
        saver.close()
    # A crash after the shards of step 2 and before its manifest, and one in an upload.
    storage.put(f"{url}/model.ckpt-2.data-00000-of-00001", [b"shard without a manifest"])
    upload = storage.client.create_upload(storage.key(f"{url}/model.ckpt-3.data-00000-of-00001"))
    assert storage.leftovers(url) == [f"{url}/model.ckpt-3.data-00000-of-00001"]

    state = {"w": torch.zeros(8), "global_step": ts.GlobalStep()}
    sv = ts.Supervisor(logdir=url, state=state, save_model_secs=0, save_summaries_secs=0)
    with caplog.at_level("INFO", logger="torchsupervisor"), sv.managed_session():
        assert torch.equal(state["w"], torch.ones(8))  # Restored from model.ckpt-1.
    names = storage.list(url)
    assert "model.ckpt-2.data-00000-of-00001" not in names
    assert "model.ckpt-1.data-00000-of-00001" in names and storage.leftovers(url) == []
    assert "incomplete checkpoint" in caplog.text
    assert upload.key not in [u.key for u in storage.client.list_uploads("")]


def test_a_start_records_a_checkpoint_committed_after_the_state_file(url, caplog):
    """A kill between a manifest and the state-file update (seen in the S3 demo test): the
    restart resumes from the newer checkpoint and, even if it saves nothing, the state file
    names it."""
    sess = Session({"w": torch.ones(8), "global_step": ts.GlobalStep()})
    saver = Saver()
    try:
        saver.save(sess, f"{url}/model.ckpt", 1)
        sess.state["w"].fill_(2.0)
        saver.save(sess, f"{url}/model.ckpt", 2, write_state=False)
    finally:
        saver.close()
    assert latest_checkpoint(url) == f"{url}/model.ckpt-1"

    state = {"w": torch.zeros(8), "global_step": ts.GlobalStep()}
    sv = ts.Supervisor(logdir=url, state=state, save_model_secs=0, save_summaries_secs=0)
    with caplog.at_level("WARNING", logger="torchsupervisor"), sv.managed_session():
        assert torch.equal(state["w"], torch.full((8,), 2.0))
    assert latest_checkpoint(url) == f"{url}/model.ckpt-2"
    assert get_checkpoint_state(url).all_model_checkpoint_paths == [
        f"{url}/model.ckpt-1",
        f"{url}/model.ckpt-2",
    ]
    assert f"Recorded {url}/model.ckpt-2 in the state file" in caplog.text


class _FullBucket:
    """A real client whose checkpoint uploads are refused while ``full`` is set, as a full
    bucket (or a store refusing a part) refuses them; everything else goes through."""

    def __init__(self, client) -> None:
        self._client = client
        self.full = threading.Event()
        self.refused = 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    def _refuse(self, key: str) -> None:
        if self.full.is_set() and "model.ckpt" in key:
            self.refused += 1
            raise OSError(errno.ENOSPC, "S3 QuotaExceeded: the bucket is full", key)

    def put_object(self, key, data, **kwargs):
        self._refuse(key)
        return self._client.put_object(key, data, **kwargs)

    def create_upload(self, key):
        self._refuse(key)
        return self._client.create_upload(key)

    def upload_part(self, upload, number, data, **kwargs):
        self._refuse(upload.key)
        return self._client.upload_part(upload, number, data, **kwargs)


def test_refused_uploads_leave_training_running_and_older_checkpoints_intact(url, caplog):
    client = _FullBucket(storage_for(url).client)
    c = Counter()
    sv = ts.Supervisor(
        logdir=url,
        state=c.state,
        saver=Saver(storage=ObjectStorage(client)),
        save_summaries_secs=0,
        save_model_secs=0.02,
    )
    caplog.set_level(logging.INFO, logger="torchsupervisor")
    with sv.managed_session() as sess:
        wait_until(lambda: latest_checkpoint(url) is not None, poll=sv.should_stop, what="ckpt")
        client.full.set()
        wait_until(
            lambda: any("failed; training continues" in m for m in caplog.messages),
            poll=lambda: sess.run(c.step),
            what="the failed save",
        )
        assert client.refused > 0 and not sv.should_stop()
        committed = latest_checkpoint(url)
        client.full.clear()  # Space again: the next saves commit.
        wait_until(lambda: latest_checkpoint(url) != committed, poll=lambda: sess.run(c.step))
    final = f"{url}/model.ckpt-{c.global_step.value}"
    assert latest_checkpoint(url) == final
    # Every checkpoint left is whole (every byte checked), and nothing of a refused save stays.
    for prefix in get_checkpoint_state(url).all_model_checkpoint_paths:
        CheckpointReader(prefix).verify()
    assert storage_for(url).leftovers(url) == []


class _RewritesOnEveryRead:
    """A client on which a writer rewrites the object ``key`` before each GET of it (a save
    rewriting the state file at every read of it), each time as a state file that lists
    every checkpoint but names ``model.ckpt-1`` the newest, a little longer than the last."""

    def __init__(self, client, key: str) -> None:
        self._client, self._key, self.rewrites = client, key, 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    def get_range(self, key, offset, length):
        if key == self._key:
            self.rewrites += 1
            listed = "".join(f'all_model_checkpoint_paths: "model.ckpt-{s}"\n' for s in (1, 2, 3))
            body = f'model_checkpoint_path: "model.ckpt-1"{" " * self.rewrites}\n{listed}'.encode()
            self._client.put_object(key, body, crc=crc32c.crc32c(body))
        return self._client.get_range(key, offset, length)


def test_a_state_file_replaced_at_every_read_is_ignored_and_the_directory_scanned(
    memory_url, caplog
):
    url = memory_url
    sess = Session({"w": torch.arange(4.0)})
    saver = Saver()
    try:
        for step in (1, 2, 3):
            saver.save(sess, f"{url}/model.ckpt", step)
    finally:
        saver.close()
    client = storage_for(url).client
    rewriting = _RewritesOnEveryRead(client, storage_for(url).key(f"{url}/checkpoint"))
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        candidates = restore_candidates(url, storage=ObjectStorage(rewriting))
    # Read as it was, the state file would put model.ckpt-1 first.
    assert candidates == [f"{url}/model.ckpt-{step}" for step in (3, 2, 1)]
    assert rewriting.rewrites == 3
    assert "Ignoring the state file" in caplog.text
    assert "replaced 3 times while it was read" in caplog.text
