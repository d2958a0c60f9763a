"""Paths and retention: no way of saving may delete, break or leak another checkpoint.

* a copy of a logdir (``cp -r``) is independent of its original;
* a second save prefix (PTB's ``sv.saver.save(sess, logdir, step)``) leaves every checkpoint
  listed in every state file restorable; incremental references never cross families;
* a checkpoint committed before a crash, before the state file was updated, is adopted;
* a state file that cannot be written does not stop retention nor fail the run;
* an empty or garbled state file does not stop the restart.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil

import pytest
import torch
from supervisor_helpers import Trainer

import torchsupervisor as ts
from torchsupervisor import CheckpointReader, Saver, Session, get_checkpoint_state
from torchsupervisor.checkpoint.recovery import clean_checkpoint_dir, plan_restore
from torchsupervisor.storage.lock import LOCK_FILENAME
from torchsupervisor.testing import FakeClock, FaultyStorage


def _tree(directory):
    """{name: (sha256, mtime_ns)} of every file under ``directory``."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = (
                    hashlib.sha256(f.read()).hexdigest(),
                    os.stat(path).st_mtime_ns,
                )
    return out


def _supervisor(logdir, trainer, **kwargs):
    kwargs.setdefault("save_model_secs", 3600)
    kwargs.setdefault("save_summaries_secs", 0)
    return ts.Supervisor(logdir=str(logdir), state=trainer.state, **kwargs)


def _train(sv, trainer, steps, checkpoint_every=1):
    with sv.managed_session() as sess:
        for i in range(steps):
            sess.run(trainer.train_step)
            if (i + 1) % checkpoint_every == 0:
                sv.checkpoint()
    return trainer.global_step.value


def _restorable(prefix):
    reader = CheckpointReader(prefix)
    reader.verify()
    return reader.read_tree()


@pytest.mark.parametrize("relative", [True, False])
def test_training_in_a_copy_never_touches_the_original(tmp_path, relative):
    run_a, run_b = tmp_path / "runA", tmp_path / "runB"
    trainer = Trainer()
    saver = Saver(max_to_keep=3, save_relative_paths=relative)
    _train(_supervisor(run_a, trainer, saver=saver), trainer, 6)
    text = (run_a / "checkpoint").read_text()
    assert (str(run_a) in text) is not relative  # TF 1's absolute form, read as before.
    shutil.copytree(run_a, run_b)
    before = _tree(run_a)
    trainer_b = Trainer(seed=1)
    sv = _supervisor(run_b, trainer_b, saver=Saver(max_to_keep=3))
    with sv.managed_session() as sess:
        # Restored from the copy's own files, not from runA's that its state file names.
        assert sess.restored_checkpoint == str(run_b / "model.ckpt-6")
        for _ in range(8):
            sess.run(trainer_b.train_step)
            sv.checkpoint()
    assert _tree(run_a) == before  # Not one file of runA deleted or modified.
    state = get_checkpoint_state(str(run_b))
    assert state.model_checkpoint_path == str(run_b / "model.ckpt-14")
    assert all(p.startswith(str(run_b)) for p in state.all_model_checkpoint_paths)
    assert 'model_checkpoint_path: "model.ckpt-14"' in (run_b / "checkpoint").read_text()


def test_a_saver_never_deletes_outside_the_directory_of_its_save_path(tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sess = Session({"w": torch.zeros(2)})
    outside = Saver().save(sess, str(elsewhere / "model.ckpt"), 1)
    saver = Saver(max_to_keep=2)
    saver.set_last_checkpoints_with_time([(outside, 0.0)])  # Listed, but in another directory.
    for step in (10, 20, 30):
        saver.save(sess, str(tmp_path / "model.ckpt"), step)
    assert os.path.exists(outside + ".index")
    assert saver.last_checkpoints == [str(tmp_path / f"model.ckpt-{s}") for s in (20, 30)]


def test_a_second_save_prefix_leaves_every_listed_checkpoint_restorable(tmp_path):
    """PTB's last line: ``sv.saver.save(sess, FLAGS.save_path, global_step=...)`` with the
    logdir itself as the path, so that its files land beside the directory."""
    logdir = tmp_path / "logdir"
    frozen = torch.nn.Linear(64, 64).requires_grad_(False)  # Referenced by incremental saves.
    trainer = Trainer()
    state = {**trainer.state, "frozen": frozen}
    sv = ts.Supervisor(
        logdir=str(logdir),
        state=state,
        saver=Saver(max_to_keep=5),
        save_model_secs=3600,
        save_summaries_secs=0,
    )
    with sv.managed_session() as sess:
        for _ in range(12):
            sess.run(trainer.train_step)
            sv.checkpoint()
            sv.saver.save(sess, str(logdir), global_step=trainer.global_step)
    for directory in (logdir, tmp_path):
        listed = get_checkpoint_state(str(directory)).all_model_checkpoint_paths
        assert len(listed) == 5
        for prefix in listed:
            assert os.path.dirname(prefix) == str(directory)
            assert torch.equal(_restorable(prefix)["frozen"]["weight"], frozen.weight)


def test_incremental_references_never_cross_prefix_families(tmp_path):
    frozen = torch.randn(256)
    trained = torch.zeros(4)
    sess = Session({"frozen": frozen, "trained": trained})
    saver = Saver(max_to_keep=6)
    for step in range(1, 9):
        trained.add_(1)
        for family in ("a", "b"):
            saver.save(sess, str(tmp_path / family), step)
    for family in ("a", "b"):
        for prefix in get_checkpoint_state(str(tmp_path)).all_model_checkpoint_paths:
            if os.path.basename(prefix).startswith(family + "-"):
                shards = CheckpointReader(prefix).manifest.shards
                assert all(s.file.startswith(family + "-") for s in shards)
    # Incremental saves did happen (the rule is about where they point, not whether).
    manifests = [CheckpointReader(str(tmp_path / f"a-{s}")).manifest for s in (7, 8)]
    assert any(len(m.shards) > 1 for m in manifests)


def test_a_checkpoint_committed_before_the_state_file_update_is_adopted(tmp_path):
    """The crash between the commit and the state file: the restart lists the checkpoint and
    retention deletes it in its turn (a torture run once ended with 29 under max_to_keep=5)."""
    trainer = Trainer()
    sv = _supervisor(tmp_path, trainer, saver=Saver(max_to_keep=3))
    _train(sv, trainer, 3)
    sess = Session(trainer.state)
    for _ in range(2):  # Two commits that a crash kept out of the state file.
        trainer.train_step()
        Saver().save(sess, str(tmp_path / "model.ckpt"), trainer.global_step, write_state=False)
    assert get_checkpoint_state(str(tmp_path)).model_checkpoint_path.endswith("model.ckpt-3")
    plan = plan_restore(str(tmp_path))
    assert plan.adopted == [str(tmp_path / "model.ckpt-4"), str(tmp_path / "model.ckpt-5")]
    sv = _supervisor(tmp_path, trainer, saver=Saver(max_to_keep=3))
    with sv.managed_session() as sess:
        assert sess.restored_checkpoint == str(tmp_path / "model.ckpt-5")
        assert sv.saver.last_checkpoints[-2:] == plan.adopted
        # Recorded at the start, before any save: a run with nothing left to do makes none.
        assert ts.latest_checkpoint(str(tmp_path)) == str(tmp_path / "model.ckpt-5")
        listed = get_checkpoint_state(str(tmp_path)).all_model_checkpoint_paths
        assert [os.path.basename(p) for p in listed][-2:] == ["model.ckpt-4", "model.ckpt-5"]
        for _ in range(3):
            sess.run(trainer.train_step)
            sv.checkpoint()
    committed = sorted(n for n in os.listdir(tmp_path) if n.endswith(".index"))
    assert committed == ["model.ckpt-6.index", "model.ckpt-7.index", "model.ckpt-8.index"]


def test_the_start_records_checkpoints_committed_after_the_state_file(tmp_path, caplog):
    """``clean_checkpoint_dir`` (the chief's start) brings the state file up to date, with
    relative paths, and says so; an unlisted older checkpoint leaves it alone."""
    sess = Session({"w": torch.zeros(1)})
    Saver().save(sess, str(tmp_path / "m"), 1, write_state=False)  # Older, unlisted: kept as is.
    saver = Saver()
    for step in (2, 3):
        saver.save(sess, str(tmp_path / "m"), step)
    state_file = tmp_path / "checkpoint"
    before = (state_file.read_bytes(), state_file.stat().st_mtime_ns)
    clean_checkpoint_dir(str(tmp_path))
    assert (state_file.read_bytes(), state_file.stat().st_mtime_ns) == before

    Saver().save(sess, str(tmp_path / "m"), 4, write_state=False)  # The crash came here.
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        clean_checkpoint_dir(str(tmp_path))
    assert state_file.read_text() == (
        'model_checkpoint_path: "m-4"\n'
        'all_model_checkpoint_paths: "m-2"\n'
        'all_model_checkpoint_paths: "m-3"\n'
        'all_model_checkpoint_paths: "m-4"\n'
    )
    assert f"Recorded {tmp_path / 'm-4'} in the state file of {tmp_path}" in caplog.text
    caplog.clear()
    clean_checkpoint_dir(str(tmp_path))  # Up to date now: not written again.
    assert "Recorded" not in caplog.text


def test_a_state_file_that_cannot_be_updated_at_the_start_is_reported(tmp_path, caplog):
    sess = Session({"w": torch.zeros(1)})
    Saver().save(sess, str(tmp_path / "m"), 1)
    Saver().save(sess, str(tmp_path / "m"), 2, write_state=False)
    storage = FaultyStorage()
    storage.fail("rename", path_contains="checkpoint", errno=errno.EPERM, times=None)
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        clean_checkpoint_dir(str(tmp_path), storage=storage)
    assert f"Could not record {tmp_path / 'm-2'} in the state file of {tmp_path}" in caplog.text
    assert get_checkpoint_state(str(tmp_path)).model_checkpoint_path == str(tmp_path / "m-1")
    assert plan_restore(str(tmp_path)).candidates[0] == str(tmp_path / "m-2")


def test_without_a_state_file_every_committed_checkpoint_is_adopted(tmp_path):
    sess = Session({"w": torch.zeros(1)})
    for step in (1, 2, 3):
        Saver().save(sess, str(tmp_path / "m"), step, write_state=False)
    assert plan_restore(str(tmp_path)).tracked == [str(tmp_path / f"m-{s}") for s in (1, 2, 3)]


def test_an_unusable_state_file_adopts_nothing(tmp_path):
    sess = Session({"w": torch.zeros(1)})
    for step in (1, 2, 3):
        Saver().save(sess, str(tmp_path / "m"), step)
    (tmp_path / "checkpoint").write_text("garbage {{{")
    plan = plan_restore(str(tmp_path))
    assert plan.tracked == [] and plan.candidates[0] == str(tmp_path / "m-3")
    assert "is not a checkpoint state" in plan.state_file_error


@pytest.mark.parametrize("kind", ["directory", "immutable"])
def test_an_unwritable_state_file_keeps_retention_and_the_run_ends_cleanly(tmp_path, caplog, kind):
    storage = FaultyStorage()
    if kind == "directory":
        (tmp_path / "checkpoint").mkdir()
    else:  # chattr +i needs root: a rename over the state file refused, as it would be.
        (tmp_path / "checkpoint").write_text('model_checkpoint_path: "old"\n')
        storage.fail("rename", path_contains=os.sep + "checkpoint", errno=errno.EPERM, times=None)
    trainer = Trainer()
    saver = Saver(max_to_keep=2, storage=storage)
    with caplog.at_level(logging.ERROR, logger="torchsupervisor"):
        _train(_supervisor(tmp_path, trainer, saver=saver), trainer, 6)  # No raise at exit.
    committed = sorted(n for n in os.listdir(tmp_path) if n.endswith(".index"))
    assert committed == ["model.ckpt-5.index", "model.ckpt-6.index"]
    state_path = str(tmp_path / "checkpoint")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and state_path in errors[0]  # Named once, not at every save.
    restarted = Trainer(seed=3)
    sv = _supervisor(tmp_path, restarted, saver=Saver(max_to_keep=2, storage=storage))
    with sv.managed_session() as sess:
        assert sess.restored_checkpoint == str(tmp_path / "model.ckpt-6")


@pytest.mark.parametrize("content", ["", "garbage {{{", "model_checkpoint_path: 3", "dir"])
def test_an_empty_or_garbled_state_file_restores_the_newest_valid(tmp_path, content):
    trainer = Trainer()
    _train(_supervisor(tmp_path, trainer), trainer, 3)
    os.remove(tmp_path / "checkpoint")
    if content == "dir":
        (tmp_path / "checkpoint").mkdir()
    else:
        (tmp_path / "checkpoint").write_text(content)
    restarted = Trainer(seed=5)
    with _supervisor(tmp_path, restarted).managed_session() as sess:
        assert sess.restored_checkpoint == str(tmp_path / "model.ckpt-3")
    assert restarted.global_step.value == 3
    assert torch.equal(restarted.weights()["weight"], trainer.weights()["weight"])


def test_the_state_file_may_be_a_fifo(tmp_path):
    trainer = Trainer()
    _train(_supervisor(tmp_path, trainer), trainer, 2)
    os.remove(tmp_path / "checkpoint")
    os.mkfifo(tmp_path / "checkpoint")
    plan = plan_restore(str(tmp_path))  # Returns: a FIFO is never read.
    assert plan.candidates[0] == str(tmp_path / "model.ckpt-2")
    assert "not a regular file (a FIFO)" in plan.state_file_error


def test_retention_times_come_from_the_injected_clock(tmp_path):
    """keep_checkpoint_every_n_hours with a fake clock: the policy sees synthetic time."""
    clock = FakeClock()
    saver = Saver(max_to_keep=1, keep_checkpoint_every_n_hours=1, clock=clock)
    sess = Session({"w": torch.zeros(1)})
    for step in range(1, 6):
        clock.advance(1800)  # Half an hour per save.
        saver.save(sess, str(tmp_path / "m"), step)
    kept = sorted(n for n in os.listdir(tmp_path) if n.endswith(".index"))
    assert kept == ["m-3.index", "m-5.index"]  # Strictly later than the keep time.


def test_the_lock_file_is_not_a_checkpoint_file(tmp_path):
    Saver().save(Session({"w": torch.zeros(1)}), str(tmp_path / "m"), 1)
    assert LOCK_FILENAME in os.listdir(tmp_path)
    assert plan_restore(str(tmp_path)).candidates == [str(tmp_path / "m-1")]


class _Crash(BaseException):
    """Stands for the process dying at that instant (nothing after it runs)."""


def test_a_crash_between_the_state_file_and_the_deletion_does_not_leak(tmp_path, caplog):
    """The state file no longer lists an evicted checkpoint, and the process dies before
    deleting it: the state file names it as being deleted, and the next start deletes it."""

    def crash(path):
        raise _Crash(path)

    storage = FaultyStorage()
    trainer = Trainer()
    saver = Saver(max_to_keep=2, storage=storage)
    sess = Session(trainer.state)
    for _ in range(2):
        trainer.train_step()
        saver.save(sess, str(tmp_path / "model.ckpt"), trainer.global_step)
    trainer.train_step()
    storage.fail("delete", path_contains="model.ckpt-1.index", before=crash)
    with pytest.raises(_Crash):
        saver.save(sess, str(tmp_path / "model.ckpt"), trainer.global_step)
    text = (tmp_path / "checkpoint").read_text()
    assert '# torchsupervisor deleting: "model.ckpt-1"' in text
    assert get_checkpoint_state(str(tmp_path)).all_model_checkpoint_paths == [
        str(tmp_path / "model.ckpt-2"),
        str(tmp_path / "model.ckpt-3"),
    ]  # TF's parser ignores the comment.
    assert os.path.exists(tmp_path / "model.ckpt-1.index")  # Committed, unlisted: a leak...
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        sv = _supervisor(tmp_path, Trainer(seed=2), saver=Saver(max_to_keep=2))
        with sv.managed_session() as session:
            assert session.restored_checkpoint == str(tmp_path / "model.ckpt-3")
    assert not os.path.exists(tmp_path / "model.ckpt-1.index")  # ... finished at the start.
    assert "retention was deleting it when the last run stopped" in caplog.text


def test_a_pending_deletion_never_removes_a_listed_or_newer_checkpoint(tmp_path):
    sess = Session({"w": torch.zeros(1)})
    saver = Saver()
    for step in (1, 2, 3):
        saver.save(sess, str(tmp_path / "m"), step)  # All three listed.
    with open(tmp_path / "checkpoint", "a") as f:  # A damaged or hostile list.
        f.write('# torchsupervisor deleting: "m-3"\n# torchsupervisor deleting: "m-2"\n')
        f.write('# torchsupervisor deleting: "../elsewhere"\n')
    ts.checkpoint.recovery.clean_checkpoint_dir(str(tmp_path))
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".index")) == [
        "m-1.index",
        "m-2.index",
        "m-3.index",
    ]
