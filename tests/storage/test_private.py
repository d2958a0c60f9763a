"""The memory tier's storage: directories and files for one user alone, a check of room."""

from __future__ import annotations

import os
import pickle
import stat

import pytest

from torchsupervisor.errors import MemoryTierFullError, ResourceExhaustedError
from torchsupervisor.storage import private
from torchsupervisor.storage.private import MemoryTierStorage
from torchsupervisor.tiers import memory_root as roots


def test_every_level_is_made_the_users_alone(tmp_path):
    root = str(tmp_path / "torchsupervisor-me")
    directory = roots.rank_directory(root, "runs/a", 0)
    MemoryTierStorage().prepare_directory(root, directory)
    for level in (root, os.path.dirname(directory), directory):
        assert stat.S_IMODE(os.lstat(level).st_mode) == 0o700, level
    MemoryTierStorage().prepare_directory(
        root, directory
    )  # Again: what is there is checked, not remade.


@pytest.mark.parametrize("kind", ["link", "open", "file", "owner"])
def test_a_level_another_could_reach_is_refused_and_named(tmp_path, kind):
    if kind == "owner" and os.getuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    root = tmp_path / "torchsupervisor-me"
    root.mkdir(mode=0o700)
    run = root / "run"
    if kind == "link":  # A link planted to send the snapshots elsewhere.
        (tmp_path / "elsewhere").mkdir()
        run.symlink_to(tmp_path / "elsewhere")
    elif kind == "open":
        run.mkdir()
        run.chmod(0o755)
    elif kind == "owner":  # Made by another user before this one came.
        run.mkdir(mode=0o700)
        os.chown(run, 4321, -1)
    else:
        run.write_bytes(b"")
    with pytest.raises(PermissionError, match=str(run)):
        MemoryTierStorage().prepare_directory(str(root), str(run / "rank-0"))
    assert not (tmp_path / "elsewhere" / "rank-0").exists()


def test_a_directory_outside_the_root_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not under"):
        MemoryTierStorage().prepare_directory(str(tmp_path / "root"), str(tmp_path / "other"))


def test_room_counts_what_the_directory_holds_already(tmp_path, monkeypatch):
    directory = tmp_path / "rank-0"
    directory.mkdir()
    (directory / "slot").write_bytes(os.urandom(1 << 20))  # 1 MiB of an older snapshot.
    held = os.lstat(directory / "slot").st_blocks * 512

    class Fs:
        f_bavail, f_frsize = 1000, 4096  # 4,096,000 bytes free.

    monkeypatch.setattr(private.os, "statvfs", lambda path: Fs)
    MemoryTierStorage().check_room(
        str(directory), 4_096_000 + held
    )  # Fits: the old slot is rewritten.
    with pytest.raises(MemoryTierFullError) as caught:
        MemoryTierStorage().check_room(str(directory), 4_096_000 + held + 1)
    error = caught.value
    assert isinstance(error, ResourceExhaustedError)
    assert error.path == str(directory) and error.needed_bytes == 4_096_000 + held + 1
    assert error.free_bytes == 4_096_000 + held
    assert f"needs {4_096_000 + held + 1} bytes" in str(error) and str(directory) in str(error)
    again = pickle.loads(pickle.dumps(error))  # Crosses processes whole (a rank's error).
    assert (again.path, again.needed_bytes, again.free_bytes) == (
        error.path,
        error.needed_bytes,
        error.free_bytes,
    )


def test_room_on_the_real_file_system(tmp_path):
    MemoryTierStorage().check_room(str(tmp_path), 1)
    with pytest.raises(MemoryTierFullError, match="needs"):
        MemoryTierStorage().check_room(str(tmp_path), 1 << 62)


def test_the_memory_tiers_files_are_the_users_alone(tmp_path):
    from torchsupervisor.storage import LocalStorage

    private, shared = tmp_path / "snapshot.index", tmp_path / "checkpoint.index"
    MemoryTierStorage().put(str(private), [b"x" * (2 << 20)])  # O_DIRECT where it can.
    MemoryTierStorage().put(str(tmp_path / "small"), [b"x"])
    LocalStorage().put(str(shared), [b"x"])
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "small").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o644 & ~_umask()
    assert private.read_bytes() == b"x" * (2 << 20)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_counter_outlives_its_mapping_and_is_the_users_alone(tmp_path):
    storage = MemoryTierStorage()
    path = str(tmp_path / "reached_step")
    assert storage.read_counter(path) is None
    counter = storage.open_counter(path)
    counter.set(41)
    assert storage.read_counter(path) == 41  # Visible at once: the page is shared.
    counter.set(-42)
    counter.close()
    assert storage.read_counter(path) == -42
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.unlink(path)
    os.symlink(str(tmp_path / "elsewhere"), path)
    with pytest.raises(OSError):
        storage.open_counter(path)
    assert not os.path.exists(tmp_path / "elsewhere")


def test_remove_directory_stays_under_the_root_and_keeps_other_ranks(tmp_path):
    storage = MemoryTierStorage()
    root = str(tmp_path / "root")
    rank0, rank1 = (roots.rank_directory(root, "logdir", r) for r in (0, 1))
    for directory in (rank0, rank1):
        storage.prepare_directory(root, directory)
        storage.put(os.path.join(directory, "f"), [b"x"])
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    os.symlink(str(outside), os.path.join(rank0, "link"))
    with pytest.raises(ValueError, match="not under"):
        storage.remove_directory(root, str(tmp_path))
    storage.remove_directory(root, rank0)
    assert not os.path.exists(rank0) and outside.read_bytes() == b"keep"
    assert os.path.exists(rank1)  # Its run directory is kept for the other rank.
    storage.remove_directory(root, rank1)
    assert os.listdir(root) == []


def test_a_deleted_data_file_is_a_spare_whose_pages_the_next_one_overwrites(tmp_path):
    storage = MemoryTierStorage()
    directory = str(tmp_path)
    old = os.path.join(directory, "model.ckpt-1.data-00000-of-00001")
    storage.put(old, [b"x" * 4096])
    inode = os.stat(old).st_ino
    storage.delete(old)
    assert not os.path.exists(old)
    (spare,) = storage.spares(directory)
    assert os.path.basename(spare).startswith(private.SPARE_PREFIX)
    new = os.path.join(directory, "model.ckpt-2.data-00000-of-00001")
    storage.put(new, [b"abc", b"de"])  # Shorter than the spare: cut to what was written.
    with open(new, "rb") as f:
        assert f.read() == b"abcde"
    info = os.stat(new)
    assert info.st_ino == inode and stat.S_IMODE(info.st_mode) == 0o600
    assert storage.spares(directory) == []
    # Other files are deleted, and at most MAX_SPARES data files are kept.
    index = os.path.join(directory, "model.ckpt-2.index")
    storage.put(index, [b"{}"])
    storage.delete(index)
    assert storage.spares(directory) == []
    paths = [
        os.path.join(directory, f"model.ckpt-{step}.data-00000-of-00001")
        for step in range(3, 3 + storage.MAX_SPARES + 2)
    ]
    for path in paths:
        storage.put(path, [b"y"])
    for path in paths:
        storage.delete(path)
    assert len(storage.spares(directory)) == storage.MAX_SPARES


def test_a_spare_that_is_a_link_is_never_written_through(tmp_path):
    storage = MemoryTierStorage()
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    os.symlink(target, tmp_path / f"{private.SPARE_PREFIX}planted")
    new = str(tmp_path / "model.ckpt-2.data-00000-of-00001")
    storage.put(new, [b"data"])
    assert target.read_bytes() == b"keep"
    with open(new, "rb") as f:
        assert f.read() == b"data"
    assert not os.path.islink(new)


def test_a_spare_that_is_a_fifo_is_never_opened_for_writing(tmp_path):
    storage = MemoryTierStorage()
    os.mkfifo(tmp_path / f"{private.SPARE_PREFIX}planted", 0o600)
    new = str(tmp_path / "model.ckpt-2.data-00000-of-00001")
    storage.put(new, [b"data"])  # Would block forever on a FIFO opened for writing.
    with open(new, "rb") as f:
        assert f.read() == b"data"
    assert storage.spares(str(tmp_path)) == []


def test_a_data_file_being_read_is_unlinked_not_kept_as_a_spare(tmp_path):
    storage = MemoryTierStorage()
    path = str(tmp_path / "model.ckpt-1.data-00000-of-00001")
    storage.put(path, [b"old" * 1000])
    with storage.reading(path), open(path, "rb") as f:
        MemoryTierStorage().delete(path)  # Another instance of the process: the same rule.
        assert storage.spares(str(tmp_path)) == [] and not os.path.exists(path)
        storage.put(str(tmp_path / "model.ckpt-2.data-00000-of-00001"), [b"new" * 1000])
        assert f.read() == b"old" * 1000
    storage.put(path, [b"x"])
    storage.delete(path)  # Read no more: a spare again.
    assert len(storage.spares(str(tmp_path))) == 1
