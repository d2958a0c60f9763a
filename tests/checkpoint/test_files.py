"""Tests of checkpoint management on disk: existence, mtimes, deletion order, crash leftovers."""

from __future__ import annotations

import errno
import logging
import os

import pytest

from torchsupervisor.checkpoint.files import (
    checkpoint_exists,
    clean_stale_temporaries,
    find_incomplete_checkpoints,
    get_checkpoint_mtimes,
    list_checkpoint_files,
    meta_graph_filename,
    remove_checkpoint,
)
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.storage import temporary_name
from torchsupervisor.testing import FaultyStorage

LOGGER = "torchsupervisor"
RACE_WARNING = (
    "Hit NotFoundError when deleting '{}', possibly because another process/thread is also "
    "deleting/moving the same file"
)


def _vanish(path):
    os.remove(path)  # Another process deletes it first.


def _make(path, data: bytes = b"x") -> str:
    path = os.fspath(path)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _make_checkpoint(prefix, num_shards: int = 2, index: bool = True, meta: bool = False):
    prefix = os.fspath(prefix)
    files = [
        _make(f"{prefix}.data-{i:05d}-of-{num_shards:05d}", b"shard%d" % i)
        for i in range(num_shards)
    ]
    if index:
        files.insert(0, _make(prefix + ".index", b"{}"))
    if meta:
        files.append(_make(prefix + ".meta"))
    return files


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ----------------------------------------------------------------------------- checkpoint_exists


def test_checkpoint_exists_needs_the_index(tmp_path):
    complete = tmp_path / "model.ckpt-1"
    incomplete = tmp_path / "model.ckpt-2"
    _make_checkpoint(complete)
    _make_checkpoint(incomplete, index=False)
    assert checkpoint_exists(str(complete)) is True
    assert checkpoint_exists(complete) is True
    assert checkpoint_exists(str(incomplete)) is False
    assert checkpoint_exists(str(tmp_path / "model.ckpt-3")) is False


def test_checkpoint_exists_accepts_tf_v1_file_but_not_a_directory(tmp_path):
    v1 = _make(tmp_path / "model.ckpt-7")
    assert checkpoint_exists(v1) is True
    assert checkpoint_exists(str(tmp_path)) is False
    (tmp_path / "d.index").mkdir()
    assert checkpoint_exists(str(tmp_path / "d")) is False


def test_checkpoint_exists_globs_like_tf(tmp_path):
    _make_checkpoint(tmp_path / "model.ckpt-42")
    assert checkpoint_exists(str(tmp_path / "model.ckpt-4?")) is True
    assert checkpoint_exists(str(tmp_path / "model.ckpt-*")) is True
    assert checkpoint_exists(str(tmp_path / "model.ckpt-5?")) is False
    # TF's sharded V1 prefix is a pattern that matches the V1 shard files.
    _make(tmp_path / "old.ckpt-00000-of-00002")
    assert checkpoint_exists(str(tmp_path / "old.ckpt-?????-of-00002")) is True


def test_checkpoint_exists_with_glob_characters_in_a_literal_path(tmp_path):
    d = tmp_path / "exp[1]"
    d.mkdir()
    _make_checkpoint(d / "model.ckpt-1")
    assert checkpoint_exists(str(d / "model.ckpt-1")) is True


# ----------------------------------------------------------------------------- mtimes


def test_get_checkpoint_mtimes_skips_missing_and_keeps_order(tmp_path):
    a, b, c = (tmp_path / f"model.ckpt-{i}" for i in (1, 2, 3))
    _make_checkpoint(a)
    _make_checkpoint(c)
    _make_checkpoint(b, index=False)  # Incomplete: no mtime.
    os.utime(str(a) + ".index", ns=(0, 1_500_000_123_456_789_000))
    os.utime(str(c) + ".index", ns=(0, 1_400_000_000_250_000_000))
    # Data files get other times: only the index counts.
    os.utime(str(a) + ".data-00000-of-00002", ns=(0, 7_000_000_000))
    mtimes = get_checkpoint_mtimes([str(c), str(b), a, str(tmp_path / "missing")])
    assert mtimes == [1_400_000_000_250_000_000 / 1e9, 1_500_000_123_456_789_000 / 1e9]
    assert all(isinstance(t, float) for t in mtimes)
    assert get_checkpoint_mtimes([]) == []


def test_get_checkpoint_mtimes_falls_back_to_tf_v1_file(tmp_path):
    v1 = _make(tmp_path / "model.ckpt-7")
    os.utime(v1, ns=(0, 123_000_000_000))
    assert get_checkpoint_mtimes([v1]) == [123.0]


# ----------------------------------------------------------------------------- listing


def test_list_checkpoint_files(tmp_path):
    prefix = tmp_path / "model.ckpt-1"
    files = _make_checkpoint(prefix, num_shards=3, meta=True)
    _make_checkpoint(tmp_path / "model.ckpt-10")  # Shares the prefix as a string.
    _make(temporary_name(str(prefix) + ".data-00000-of-00003"))
    assert list_checkpoint_files(prefix) == files[:4]  # Index, 3 shards; no meta, no temp.
    assert list_checkpoint_files(str(tmp_path / "nothing")) == []
    incomplete = tmp_path / "model.ckpt-2"
    assert list_checkpoint_files(incomplete) == []
    shards = _make_checkpoint(incomplete, index=False)
    assert list_checkpoint_files(incomplete) == shards


def test_meta_graph_filename():
    assert meta_graph_filename("/r/model.ckpt-123456") == "/r/model.ckpt-123456.meta"
    assert meta_graph_filename("/r/model.ckpt-123456-?????-of-00005") == "/r/model.ckpt-123456.meta"
    assert meta_graph_filename("model.ckpt-123456-00001-of-00002", "txt") == "model.ckpt-123456.txt"


# ----------------------------------------------------------------------------- remove_checkpoint


def test_remove_checkpoint_deletes_all_its_files_and_nothing_else(tmp_path, caplog):
    prefix = tmp_path / "model.ckpt-1"
    _make_checkpoint(prefix, num_shards=3, meta=True)
    others = _make_checkpoint(tmp_path / "model.ckpt-10", meta=True)
    others.append(_make(tmp_path / "model.ckpt-1.index.bak"))
    others.append(_make(tmp_path / "checkpoint"))
    remove_checkpoint(str(prefix))
    assert sorted(os.path.join(tmp_path, n) for n in os.listdir(tmp_path)) == sorted(others)
    assert _warnings(caplog) == []


def test_remove_checkpoint_deletes_index_first_then_fsyncs_then_shards(tmp_path):
    prefix = str(tmp_path / "model.ckpt-5")
    _make_checkpoint(prefix, num_shards=2, meta=True)
    storage = FaultyStorage()
    remove_checkpoint(prefix, storage=storage)
    d = str(tmp_path)
    assert [call for call in storage.calls if call[0] in ("delete", "fsync_dir")] == [
        ("delete", prefix + ".index"),
        ("fsync_dir", d),  # Durable before any shard is touched.
        ("delete", prefix + ".data-00000-of-00002"),
        ("fsync_dir", d),
        ("delete", prefix + ".data-00001-of-00002"),
        ("fsync_dir", d),
        ("delete", prefix + ".meta"),
        ("fsync_dir", d),
    ]


def test_failure_after_index_leaves_an_incomplete_checkpoint_never_a_complete_one(tmp_path):
    prefix = str(tmp_path / "model.ckpt-5")
    _make_checkpoint(prefix, num_shards=2)
    storage = FaultyStorage()
    storage.fail("delete", nth=2, errno=errno.EIO)
    with pytest.raises(OSError) as info:
        remove_checkpoint(prefix, storage=storage)
    assert info.value.errno == errno.EIO
    assert not os.path.exists(prefix + ".index")
    assert os.path.exists(prefix + ".data-00000-of-00002")
    assert checkpoint_exists(prefix) is False
    assert find_incomplete_checkpoints(str(tmp_path)) == [prefix]
    remove_checkpoint(prefix)  # Retrying finishes the job.
    assert os.listdir(tmp_path) == []


def test_failure_on_index_deletes_nothing(tmp_path):
    prefix = str(tmp_path / "model.ckpt-5")
    files = _make_checkpoint(prefix)
    storage = FaultyStorage()
    storage.fail("delete", errno=errno.EACCES)
    with pytest.raises(PermissionError):
        remove_checkpoint(prefix, storage=storage)
    assert all(os.path.exists(f) for f in files)
    assert checkpoint_exists(prefix)


def test_file_deleted_by_someone_else_is_a_warning_only(tmp_path, caplog):
    prefix = str(tmp_path / "model.ckpt-5")
    _make_checkpoint(prefix, num_shards=2)
    storage = FaultyStorage()
    storage.fail("delete", nth=2, errno=errno.ENOENT, before=_vanish)
    remove_checkpoint(prefix, storage=storage)
    assert os.listdir(tmp_path) == []
    assert _warnings(caplog) == [RACE_WARNING.format(prefix + ".data-00000-of-00002")]


def test_vanished_index_is_a_warning_and_the_shards_still_go(tmp_path, caplog):
    prefix = str(tmp_path / "model.ckpt-5")
    _make_checkpoint(prefix, num_shards=1)
    storage = FaultyStorage()
    storage.fail("delete", errno=errno.ENOENT, before=_vanish)
    remove_checkpoint(prefix, storage=storage)
    assert os.listdir(tmp_path) == []
    assert _warnings(caplog) == [RACE_WARNING.format(prefix + ".index")]


def test_removing_a_missing_checkpoint_is_silent(tmp_path, caplog):
    storage = FaultyStorage()
    remove_checkpoint(str(tmp_path / "model.ckpt-404"), storage=storage)
    assert storage.operations("delete") == []
    assert _warnings(caplog) == []


def test_remove_incomplete_checkpoint(tmp_path):
    prefix = tmp_path / "model.ckpt-5"
    _make_checkpoint(prefix, index=False)
    remove_checkpoint(prefix)
    assert os.listdir(tmp_path) == []


def test_remove_checkpoint_treats_prefix_literally(tmp_path):
    d = tmp_path / "exp[1]"
    d.mkdir()
    near = tmp_path / "exp1"
    near.mkdir()
    _make_checkpoint(d / "model.ckpt-1")
    kept = _make_checkpoint(near / "model.ckpt-1")
    remove_checkpoint(str(d / "model.ckpt-1"))
    assert os.listdir(d) == []
    assert all(os.path.exists(f) for f in kept)
    # A pattern as prefix deletes nothing (it is not a literal path).
    remove_checkpoint(str(near / "model.ckpt-?"))
    assert all(os.path.exists(f) for f in kept)


def test_remove_checkpoint_tf_v1_layout(tmp_path):
    prefix = _make(tmp_path / "model.ckpt-3")
    _make(prefix + ".meta")
    kept = _make(prefix + ".index")
    remove_checkpoint(prefix, checkpoint_format_version=1)
    assert os.listdir(tmp_path) == [os.path.basename(kept)]


def test_remove_checkpoint_custom_meta_suffix(tmp_path):
    prefix = str(tmp_path / "model.ckpt-3")
    _make_checkpoint(prefix, num_shards=1)
    kept = _make(prefix + ".meta")
    _make(prefix + ".graph")
    remove_checkpoint(prefix, meta_graph_suffix="graph")
    assert os.listdir(tmp_path) == [os.path.basename(kept)]


# ----------------------------------------------------------------------------- crash leftovers


def test_clean_stale_temporaries(tmp_path, caplog):
    d = str(tmp_path)
    _make_checkpoint(tmp_path / "model.ckpt-1")
    state = _make(tmp_path / "checkpoint")
    temps = sorted(
        [
            _make(temporary_name(state)),
            _make(temporary_name(str(tmp_path / "model.ckpt-2.index"))),
            _make(temporary_name(str(tmp_path / "model.ckpt-2.data-00000-of-00001"))),
        ]
    )
    not_temps = [
        _make(tmp_path / "notes.tmp"),
        _make(tmp_path / ("x.tmp" + "0" * 31)),  # 31 digits: not ours.
        _make(tmp_path / ("x.tmp" + "A" * 32)),  # Upper case: not ours.
    ]
    os.mkdir(temporary_name(str(tmp_path / "a_directory")))
    before = set(os.listdir(d))

    storage = FaultyStorage()
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        removed = clean_stale_temporaries(d, storage=storage)

    assert removed == temps
    assert set(os.listdir(d)) == before - {os.path.basename(t) for t in temps}
    assert all(os.path.exists(p) for p in not_temps)
    assert storage.calls[-1] == ("fsync_dir", d)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        f"Removed temporary file {t} (left by an interrupted write)" for t in temps
    ]
    assert _warnings(caplog) == []  # What a kill -9 leaves: not a warning.
    assert clean_stale_temporaries(tmp_path) == []


def test_clean_stale_temporaries_missing_directory(tmp_path):
    assert clean_stale_temporaries(str(tmp_path / "nope")) == []


def test_clean_stale_temporaries_propagates_a_failed_delete(tmp_path):
    temp = _make(temporary_name(str(tmp_path / "checkpoint")))
    storage = FaultyStorage()
    storage.fail("delete", errno=errno.EACCES)
    with pytest.raises(PermissionError):
        clean_stale_temporaries(str(tmp_path), storage=storage)
    assert os.path.exists(temp)


def test_clean_stale_temporaries_skips_a_file_deleted_meanwhile(tmp_path, caplog):
    first = _make(tmp_path / ("a.tmp" + "1" * 32))
    second = _make(tmp_path / ("b.tmp" + "2" * 32))
    storage = FaultyStorage()
    storage.fail("delete", errno=errno.ENOENT, before=_vanish)
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        assert clean_stale_temporaries(str(tmp_path), storage=storage) == [second]
    assert not os.path.exists(first)
    assert len([r for r in caplog.records if "Removed temporary" in r.getMessage()]) == 1


def test_find_incomplete_checkpoints(tmp_path):
    d = str(tmp_path)
    _make_checkpoint(tmp_path / "model.ckpt-1")
    _make_checkpoint(tmp_path / "model.ckpt-3", index=False)
    _make_checkpoint(tmp_path / "model.ckpt-2", num_shards=3, index=False)
    # A crash while the index was being written: shards present, index only as a temporary.
    _make(temporary_name(str(tmp_path / "model.ckpt-2.index")))
    # Only temporaries (crash before the shard renames): not a checkpoint at all.
    _make(temporary_name(str(tmp_path / "model.ckpt-4.data-00000-of-00001")))
    _make(tmp_path / "checkpoint")
    _make(tmp_path / "events.out.tfevents.1700000000.host")
    assert find_incomplete_checkpoints(d) == [
        os.path.join(d, "model.ckpt-2"),
        os.path.join(d, "model.ckpt-3"),
    ]
    assert find_incomplete_checkpoints(str(tmp_path / "nope")) == []


def test_crash_leftovers_can_be_cleaned_completely(tmp_path):
    d = str(tmp_path)
    complete = _make_checkpoint(tmp_path / "model.ckpt-1")
    _make_checkpoint(tmp_path / "model.ckpt-2", index=False)
    _make(temporary_name(str(tmp_path / "model.ckpt-2.index")))
    clean_stale_temporaries(d)
    for prefix in find_incomplete_checkpoints(d):
        remove_checkpoint(prefix)
    assert sorted(os.path.join(d, n) for n in os.listdir(d)) == sorted(complete)
    assert checkpoint_exists(os.path.join(d, "model.ckpt-1"))


def test_removing_an_incomplete_checkpoint_is_said_only_when_files_are_removed(tmp_path, caplog):
    """A deleted checkpoint whose data a newer incremental checkpoint still reads looks
    incomplete (data, no index): its files stay, and nothing claims they were removed."""
    import torch

    from torchsupervisor import Saver, Session
    from torchsupervisor.checkpoint.recovery import clean_checkpoint_dir

    frozen = torch.randn(64)
    trained = torch.zeros(2)
    sess = Session({"frozen": frozen, "trained": trained})
    saver = Saver(max_to_keep=None)
    for step in (1, 2, 3):
        trained.add_(1)
        saver.save(sess, str(tmp_path / "model.ckpt"), step)
    newest = CheckpointReader(str(tmp_path / "model.ckpt-3")).manifest
    (shared,) = [s.file for s in newest.shards if not s.file.startswith("model.ckpt-3.")]
    owner = str(tmp_path / shared.split(".data-")[0])
    os.remove(owner + ".index")  # Its data is still read by model.ckpt-3.
    really = tmp_path / "model.ckpt-9"
    _make_checkpoint(really, index=False)  # Interrupted before its index: garbage.
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        clean_checkpoint_dir(str(tmp_path))
    removed = [r.getMessage() for r in caplog.records if "incomplete checkpoint" in r.getMessage()]
    assert all(r.levelno == logging.INFO for r in caplog.records if "Removed" in r.getMessage())
    assert removed == [
        f"Removed incomplete checkpoint {really} (no index: the save did not finish; 2 files)"
    ]
    assert os.path.exists(tmp_path / shared)  # Kept: model.ckpt-3 reads it.
    CheckpointReader(str(tmp_path / "model.ckpt-3")).verify()
    assert not list_checkpoint_files(really)
