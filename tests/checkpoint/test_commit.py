"""The commit protocol under injected faults: nothing committed is ever damaged."""

from __future__ import annotations

import errno
import os
import pathlib
import shutil
import tempfile

import pytest
import torch

from torchsupervisor import Saver, Session, get_checkpoint_state
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.errors import CheckpointSaveError
from torchsupervisor.storage import LOCAL, is_temporary_name
from torchsupervisor.storage.lock import LOCK_FILENAME
from torchsupervisor.testing import FaultyStorage


def _listing(directory):
    return sorted(n for n in os.listdir(directory) if n != LOCK_FILENAME)


@pytest.mark.parametrize(
    "operation,nth",
    [
        ("open", 1),  # first shard
        ("write", 1),
        ("fsync", 1),
        ("rename", 1),  # shard rename
        ("fsync_dir", 1),
        ("open", 2),  # the index's temporary file
        ("write", 2),
        ("fsync", 2),
        ("rename", 2),  # index rename: the commit point
        ("fsync_dir", 2),  # after the index rename: not durable, so not committed
    ],
)
@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, operation, nth, err):
    storage = FaultyStorage()
    w = torch.arange(100.0)
    saver = Saver(storage=storage)
    sess = Session({"w": w})
    good = saver.save(sess, str(tmp_path / "m"), global_step=1)
    before = _listing(tmp_path)
    w.add_(1)
    storage.fail(operation, nth=nth, errno=err)
    with pytest.raises(CheckpointSaveError) as info:
        saver.save(sess, str(tmp_path / "m"), global_step=2)
    assert info.value.path == str(tmp_path / "m-2")
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == err
    assert _listing(tmp_path) == before  # No temporary file, no partial shard, no new index.
    assert get_checkpoint_state(str(tmp_path)).model_checkpoint_path == good
    assert saver.last_checkpoints == [good]
    restored = torch.zeros(100)
    Saver().restore(Session({"w": restored}), good)
    assert torch.equal(restored, torch.arange(100.0))


def test_failed_async_save_reports_through_its_future(tmp_path):
    storage = FaultyStorage()
    storage.fail("write", errno=errno.ENOSPC)
    future = Saver(storage=storage).save_async(
        Session({"w": torch.ones(3)}), str(tmp_path / "m"), 1
    )
    with pytest.raises(CheckpointSaveError, match="No space left on device"):
        future.result(timeout=60)
    assert _listing(tmp_path) == []


def test_order_of_operations(tmp_path):
    storage = FaultyStorage()
    prefix = Saver(storage=storage).save(Session({"w": torch.ones(3)}), str(tmp_path / "m"), 1)
    kinds = [(op, os.path.basename(path)) for op, path in storage.calls]

    def position(op, predicate):
        return next(i for i, (o, p) in enumerate(kinds) if o == op and predicate(p))

    shard_rename = position("rename", lambda p: p == "m-1.data-00000-of-00001")
    shard_fsync = position("fsync", lambda p: ".data-" in p)
    index_open = position("open", lambda p: p.startswith("m-1.index.tmp"))
    index_rename = position("rename", lambda p: p == "m-1.index")
    state_rename = position("rename", lambda p: p == "checkpoint")
    assert shard_fsync < shard_rename < index_open < index_rename < state_rename
    # The directory is synced after the shard renames and after the index rename.
    assert any(op == "fsync_dir" for op, _ in kinds[shard_rename:index_open])
    assert any(op == "fsync_dir" for op, _ in kinds[index_rename:state_rename])
    assert CheckpointReader(prefix).global_step == 1


def test_deletion_of_old_checkpoints_only_after_the_new_commit(tmp_path):
    storage = FaultyStorage()
    saver = Saver(max_to_keep=1, storage=storage)
    w = torch.ones(3)
    sess = Session({"w": w})
    saver.save(sess, str(tmp_path / "m"), 1)
    w.add_(1)  # Changed: the next save writes it again rather than referencing m-1's data.
    storage.calls.clear()
    saver.save(sess, str(tmp_path / "m"), 2)
    names = [(op, os.path.basename(p)) for op, p in storage.calls]
    first_delete = names.index(("delete", "m-1.index"))
    assert names.index(("rename", "m-2.index")) < first_delete
    assert names.index(("rename", "checkpoint")) < first_delete
    assert _listing(tmp_path) == ["checkpoint", "m-2.data-00000-of-00001", "m-2.index"]


def test_a_failed_overwrite_keeps_older_checkpoints(tmp_path):
    saver = Saver(max_to_keep=5)
    w = torch.zeros(4)
    sess = Session({"w": w})
    older = saver.save(sess, str(tmp_path / "m"), 1)
    saver.save(sess, str(tmp_path / "m"), 2)
    storage = FaultyStorage()
    storage.fail("write")
    with pytest.raises(CheckpointSaveError):
        Saver(storage=storage).save(sess, str(tmp_path / "m"), 2)  # Overwrite of m-2 fails.
    assert os.path.exists(older + ".index")
    assert not any(is_temporary_name(f) for f in _listing(tmp_path))


def test_state_file_failure_after_commit_is_logged_and_the_checkpoint_is_found(tmp_path, caplog):
    from torchsupervisor.checkpoint.recovery import restore_candidates

    saver = Saver()
    sess = Session({"w": torch.ones(1)})
    first = saver.save(sess, str(tmp_path / "m"), 1)
    storage = FaultyStorage()
    storage.fail("rename", nth=3)  # shard, index, then the state file.
    with caplog.at_level("ERROR", logger="torchsupervisor"):
        assert Saver(storage=storage).save(sess, str(tmp_path / "m"), 2) == str(tmp_path / "m-2")
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert f"Cannot write the checkpoint state file {tmp_path / 'checkpoint'}" in record.message
    assert get_checkpoint_state(str(tmp_path)).model_checkpoint_path == first
    assert restore_candidates(str(tmp_path)) == [str(tmp_path / "m-2"), first]


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_large_shards_written_directly_round_trip_with_unaligned_tails(tmp_path, where):
    if where == "tmpfs":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no tmpfs here")
        directory = tempfile.mkdtemp(dir="/dev/shm")  # O_DIRECT is refused there: fallback.
    else:
        directory = str(tmp_path)
    try:
        value = torch.randn(1_000_003)  # 4 MB + 12 bytes: not a multiple of the block size.
        prefix = Saver().save(Session({"v": value}), os.path.join(directory, "m"), 1)
        reader = CheckpointReader(prefix)
        reader.verify()
        assert torch.equal(reader.get_tensor("v"), value)
    finally:
        if where == "tmpfs":
            shutil.rmtree(directory)


def test_direct_writes_fall_back_for_unaligned_buffers(tmp_path):
    data = bytearray(os.urandom((1 << 20) + 3 * 4096 + 5))  # Large enough for O_DIRECT.
    view = memoryview(data)[1:]  # Almost surely not 4096-aligned.
    path = str(tmp_path / "f")
    LOCAL.put(path, [view])
    assert pathlib.Path(path).read_bytes() == bytes(view)
