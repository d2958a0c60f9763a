"""Which checkpoint a restart tries first, and the fallback when it is damaged."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from torchsupervisor import GlobalStep, Saver, Session, SessionManager
from torchsupervisor.checkpoint.recovery import plan_restore, restore_candidates, scan_checkpoints
from torchsupervisor.errors import DataLossError


def _save_steps(directory, steps, max_to_keep=5):
    saver = Saver(max_to_keep=max_to_keep)
    gs = GlobalStep()
    sess = Session({"w": torch.zeros(2), "global_step": gs})
    out = []
    for step in steps:
        gs.assign(step)
        sess.state["w"].fill_(step)
        out.append(saver.save(sess, os.path.join(directory, "model.ckpt"), global_step=gs))
    return out


def test_state_file_order_then_directory_scan(tmp_path):
    a, b, c = _save_steps(str(tmp_path), [10, 20, 30])
    assert restore_candidates(str(tmp_path)) == [c, b, a]
    # A hand-edited state file pointing to an older checkpoint is obeyed first.
    text = (tmp_path / "checkpoint").read_text()
    name_a, name_c = os.path.basename(a), os.path.basename(c)
    (tmp_path / "checkpoint").write_text(text.replace(f'path: "{name_c}"', f'path: "{name_a}"', 1))
    assert restore_candidates(str(tmp_path)) == [a, c, b]


def _written_before(path, other) -> None:
    """Date ``path`` one second before ``other``'s index was written."""
    committed = os.stat(f"{other}.index").st_mtime
    os.utime(path, (committed - 1, committed - 1))


def test_a_commit_the_state_file_missed_is_tried_first(tmp_path):
    a, b, c = _save_steps(str(tmp_path), [10, 20, 30])
    # As if the process died after committing c and before updating the state file: the
    # state file was last written before c's commit.
    (tmp_path / "checkpoint").write_text(
        f'model_checkpoint_path: "{b}"\nall_model_checkpoint_paths: "{a}"\n'
        f'all_model_checkpoint_paths: "{b}"\n'
    )
    _written_before(tmp_path / "checkpoint", c)
    assert restore_candidates(str(tmp_path)) == [c, b, a]


@pytest.mark.parametrize("form", ["first line", "trimmed", "one line"])
def test_a_state_file_edited_by_hand_wins(tmp_path, form):
    # The README: edit the state file to make a restart use an older checkpoint. Only an
    # edited first line worked: newer checkpoints it did not list were adopted again.
    a, b, c = _save_steps(str(tmp_path), [10, 20, 30])
    state = tmp_path / "checkpoint"
    if form == "first line":
        text = state.read_text().replace(
            f'model_checkpoint_path: "{os.path.basename(c)}"',
            f'model_checkpoint_path: "{os.path.basename(b)}"',
            1,
        )
    elif form == "trimmed":
        text = f'model_checkpoint_path: "{b}"\nall_model_checkpoint_paths: "{a}"\n'
        text += f'all_model_checkpoint_paths: "{b}"\n'
    else:
        text = f'model_checkpoint_path: "{os.path.basename(b)}"\n'
    state.write_text(text)
    assert restore_candidates(str(tmp_path))[0] == b
    plan = plan_restore(str(tmp_path))
    assert plan.adopted == []
    # A checkpoint the edit left out is kept on disk, never deleted by retention.
    assert (c in plan.tracked) == (form == "first line")


@pytest.mark.parametrize("content", [None, "", "garbage {{{", "model_checkpoint_path: 3"])
def test_without_a_usable_state_file_the_directory_is_scanned(tmp_path, content):
    a, b, c = _save_steps(str(tmp_path), [5, 100, 40])
    if content is None:
        os.remove(tmp_path / "checkpoint")
    else:
        (tmp_path / "checkpoint").write_text(content)
    assert restore_candidates(str(tmp_path)) == [b, c, a]  # Newest step first.
    assert scan_checkpoints(str(tmp_path)) == [b, c, a]


def test_moved_logdir_with_absolute_paths(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    _save_steps(str(old), [1, 2])
    new = tmp_path / "new"
    shutil.move(str(old), str(new))
    assert restore_candidates(str(new)) == [str(new / "model.ckpt-2"), str(new / "model.ckpt-1")]


def test_incomplete_checkpoints_are_not_candidates(tmp_path):
    a, b = _save_steps(str(tmp_path), [1, 2])
    os.remove(b + ".index")
    assert restore_candidates(str(tmp_path)) == [a]


def _prepare(directory):
    state = {"w": torch.full((2,), -1.0), "global_step": GlobalStep()}
    sm = SessionManager(state=state)
    sess = sm.prepare_session(saver=Saver(), checkpoint_dir=directory, init_op=lambda: None)
    return sess, state


def test_damaged_newest_falls_back_to_the_previous_with_a_warning(tmp_path, caplog):
    a, b, c, d = _save_steps(str(tmp_path), [10, 20, 30, 40])
    index = d + ".index"  # The newest index is no longer JSON (bad manifest).
    with open(index, "r+b") as f:
        f.seek(os.path.getsize(index) // 2)
        f.write(b"\x00{{")
    with open(c + ".data-00000-of-00001", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x7f")
    os.remove(b + ".data-00000-of-00001")
    assert restore_candidates(str(tmp_path)) == [d, c, b, a]  # The state file's order.
    sess, state = _prepare(str(tmp_path))
    assert sess.restored_checkpoint == a
    assert state["global_step"].value == 10 and torch.equal(state["w"], torch.full((2,), 10.0))
    text = caplog.text
    assert f"Checkpoint index {index} is corrupt: not valid JSON" in text
    assert f"{c}.data-00000-of-00001 is corrupt: checksum mismatch" in text
    assert f"{b}.data-00000-of-00001 is missing" in text
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert next(m for m in warnings if "is not usable" in m).startswith(
        f"Checkpoint {d} is not usable, trying an older one: Checkpoint index {index}"
    )


def test_all_checkpoints_damaged_is_an_error_not_a_silent_restart(tmp_path):
    (a,) = _save_steps(str(tmp_path), [10])
    os.truncate(a + ".data-00000-of-00001", 10)
    with pytest.raises(DataLossError, match=r"No valid checkpoint in .*truncated"):
        _prepare(str(tmp_path))
