"""``torchsupervisor ls``: every checkpoint, checked byte by byte, and the one a restart uses."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from torchsupervisor import CheckpointReader, GlobalStep, Saver, Supervisor
from torchsupervisor.errors import DataLossError

from .conftest import HOUR, cli, data_file, flip_byte


def rows(out: str) -> dict[str, list[str]]:
    """The table rows of ``ls`` output, by checkpoint name."""
    table = {}
    for line in out.splitlines():
        parts = line.split()
        if not parts or not (parts[0].isdigit() or parts[0] == "-"):
            continue
        for i, part in enumerate(parts):
            if part.startswith("model.ckpt-") and ":" not in part:
                table[part] = [*parts[:i], *parts[i + 1 :]]
    return table


def test_lists_steps_sizes_status_and_why_each_is_kept(saver_run, capsys):
    status, out, _ = cli(capsys, "ls", saver_run.logdir)
    assert status == 0
    table = rows(out)
    assert list(table) == ["model.ckpt-5", "model.ckpt-4", "model.ckpt-2"]  # newest first
    for step in (5, 4, 2):
        row = table[f"model.ckpt-{step}"]
        assert row[0] == str(step)
        assert "valid" in row
    assert "max_to_keep" in table["model.ckpt-5"] and "max_to_keep" in table["model.ckpt-4"]
    # Step 2 was evicted from max_to_keep's list and preserved by keep_checkpoint_every_n_hours
    # (steps 1 and 3 were deleted: see the fixture); the directory cannot tell that from
    # max_to_keep=0, so it is labelled for what is known.
    assert "unlisted" in table["model.ckpt-2"]
    assert "<- a restart restores this" in out.splitlines()[2]
    assert out.rstrip().endswith("A restart restores model.ckpt-5 (step 5).")


def test_json_output_has_sizes_on_disk(saver_run, capsys):
    status, out, _ = cli(capsys, "ls", saver_run.logdir, "--json")
    assert status == 0
    listing = json.loads(out)
    assert listing["restore"] == saver_run.prefix(5)
    by_step = {c["step"]: c for c in listing["checkpoints"]}
    assert set(by_step) == {5, 4, 2}
    prefix = saver_run.prefix(4)
    on_disk = os.path.getsize(prefix + ".index") + os.path.getsize(data_file(prefix))
    assert by_step[4]["size_bytes"] == on_disk
    assert by_step[4]["status"] == "valid" and by_step[4]["kept_by"] == "max_to_keep"
    assert by_step[2]["kept_by"] == "unlisted"


def test_max_to_keep_0_keeps_everything_and_lists_only_the_newest(tmp_path, capsys, fake_clock):
    logdir = str(tmp_path)
    saver = Saver(
        {"model": torch.nn.Linear(2, 2), "global_step": GlobalStep()},
        max_to_keep=0,
        clock=fake_clock,
    )
    for step in (1, 2, 3):
        fake_clock.advance(60.0)
        saver.save(None, os.path.join(logdir, "model.ckpt"), global_step=step)
    status, out, _ = cli(capsys, "ls", logdir)
    assert status == 0
    table = rows(out)
    assert list(table) == ["model.ckpt-3", "model.ckpt-2", "model.ckpt-1"]
    assert "max_to_keep" in table["model.ckpt-3"]
    for name in ("model.ckpt-2", "model.ckpt-1"):
        assert "unlisted" in table[name] and "valid" in table[name]
    assert "every_n_hours" not in out  # no keep_checkpoint_every_n_hours was involved
    assert out.rstrip().endswith("A restart restores model.ckpt-3 (step 3).")
    status, out, _ = cli(capsys, "ls", logdir, "--json")
    kept_by = {c["step"]: c["kept_by"] for c in json.loads(out)["checkpoints"]}
    assert kept_by == {3: "max_to_keep", 2: "unlisted", 1: "unlisted"}


def test_help_explains_what_unlisted_means(capsys):
    with pytest.raises(SystemExit):
        cli(capsys, "ls", "--help")
    help_text = " ".join(capsys.readouterr().out.split())
    explained = help_text[help_text.index("unlisted") : help_text.index("not yet in state file")]
    assert "keep_checkpoint_every_n_hours" in explained
    assert "max_to_keep=0 or None" in explained


@pytest.fixture
def utc(monkeypatch):
    """Show local times in UTC, so that the expected text does not depend on the machine."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_saved_column_and_json_give_the_manifests_wall_time(saver_run, capsys, utc):
    # The fake clock starts at 1_700_001_000 (2023-11-14 22:30:00 UTC); saves are 0.6 h apart.
    expected = {5: "2023-11-15 01:30:00", 4: "2023-11-15 00:54:00", 2: "2023-11-14 23:42:00"}
    status, out, _ = cli(capsys, "ls", saver_run.logdir)
    assert status == 0
    header = next(line for line in out.splitlines() if line.startswith("STEP"))
    assert header.split()[:3] == ["STEP", "SAVED", "SIZE"]
    table = rows(out)
    for step, text in expected.items():
        assert " ".join(table[f"model.ckpt-{step}"][1:3]) == text
    status, out, _ = cli(capsys, "ls", saver_run.logdir, "--json")
    assert status == 0
    for entry in json.loads(out)["checkpoints"]:
        step = entry["step"]
        manifest = CheckpointReader(saver_run.prefix(step)).manifest
        assert entry["wall_time"] == manifest.wall_time == 1_700_001_000 + 0.6 * HOUR * step
        # Not the files' modification times (the real clock's now).
        assert abs(os.path.getmtime(saver_run.prefix(step) + ".index") - entry["wall_time"]) > HOUR


def test_a_corrupt_checkpoint_is_reported_and_skipped_like_a_restart_does(
    saver_run, capsys, fake_clock
):
    flip_byte(data_file(saver_run.prefix(5)))
    status, out, _ = cli(capsys, "ls", saver_run.logdir)
    assert status == 0
    table = rows(out)
    assert "CORRUPT" in table["model.ckpt-5"] and "skipped" in " ".join(table["model.ckpt-5"])
    assert "<-" in table["model.ckpt-4"]
    assert f"model.ckpt-5: Checkpoint shard {data_file(saver_run.prefix(5))} is corrupt" in out
    assert "A restart restores model.ckpt-4 (step 4). It skips model.ckpt-5" in out
    # A real restart agrees: the Supervisor restores the same checkpoint.
    model, step = torch.nn.Linear(4, 3), GlobalStep()
    sv = Supervisor(
        logdir=saver_run.logdir,
        state={"model": model, "global_step": step, "config": {"lr": 0.0, "name": ""}},
        save_model_secs=0,
        save_summaries_secs=0,
        summary_writer=None,
        clock=fake_clock,
    )
    with sv.managed_session() as sess:
        assert sess.restored_checkpoint == saver_run.prefix(4)
        assert step.value == 4
        for name, value in model.state_dict().items():
            assert torch.equal(value, saver_run.weights[4][name])


def restored_by_a_real_restart(logdir, clock) -> str:
    sv = Supervisor(
        logdir=logdir,
        state={"model": torch.nn.Linear(4, 3), "global_step": GlobalStep(), "config": {}},
        save_model_secs=0,
        save_summaries_secs=0,
        summary_writer=None,
        clock=clock,
    )
    with sv.managed_session() as sess:
        return sess.restored_checkpoint


@pytest.mark.parametrize("damage", ["truncated shard", "missing shard", "bad manifest"])
def test_other_kinds_of_damage(saver_run, capsys, damage, fake_clock):
    prefix = saver_run.prefix(5)
    if damage == "truncated shard":
        with open(data_file(prefix), "r+b") as f:
            f.truncate(100)
        expected = "is truncated"
    elif damage == "missing shard":
        os.remove(data_file(prefix))
        expected = "is missing"
    else:
        flip_byte(prefix + ".index", 10)
        expected = f"Checkpoint index {prefix}.index is corrupt"
    status, out, _ = cli(capsys, "ls", saver_run.logdir)
    assert status == 0
    assert "CORRUPT" in rows(out)["model.ckpt-5"]
    assert expected in out
    restored = restored_by_a_real_restart(saver_run.logdir, fake_clock)
    step = int(restored.rsplit("-", 1)[1])
    assert f"A restart restores model.ckpt-{step} (step {step})." in out
    if damage != "bad manifest":
        assert step == 4


def test_every_checkpoint_corrupt_means_a_restart_fails(saver_run, capsys, fake_clock):
    for step in (5, 4, 2):
        flip_byte(data_file(saver_run.prefix(step)))
    status, out, _ = cli(capsys, "ls", saver_run.logdir)
    assert status == 0
    assert out.count("CORRUPT") == 3
    assert "No valid checkpoint: a restart fails with DataLossError" in out
    sv = Supervisor(
        logdir=saver_run.logdir,
        state={"model": torch.nn.Linear(4, 3), "global_step": GlobalStep()},
        save_model_secs=0,
        save_summaries_secs=0,
        summary_writer=None,
        clock=fake_clock,
    )
    with pytest.raises(DataLossError), sv.managed_session():
        pass


def test_checkpoint_committed_after_the_last_state_file_update(saver_run, capsys):
    saver_run.save(6, write_state=False)  # as if killed between the commit and the update
    status, out, _ = cli(capsys, "ls", saver_run.logdir)
    assert status == 0
    table = rows(out)
    assert next(iter(table)) == "model.ckpt-6"
    assert "not yet in state file" in " ".join(table["model.ckpt-6"])
    assert "A restart restores model.ckpt-6 (step 6)." in out


def test_no_state_file_incomplete_checkpoints_and_temporaries(saver_run, capsys):
    os.remove(os.path.join(saver_run.logdir, "checkpoint"))
    shutil.copy(data_file(saver_run.prefix(5)), data_file(saver_run.prefix(7)))  # no index
    temp = os.path.join(saver_run.logdir, "model.ckpt-8.index.tmp" + "0" * 32)
    open(temp, "w").close()
    status, out, _ = cli(capsys, "ls", saver_run.logdir)
    assert status == 0
    assert "state file: no state file" in out
    assert all("no state file" in " ".join(r) for r in rows(out).values())
    assert "model.ckpt-7: incomplete (data files but no index" in out
    assert os.path.basename(temp) + ": temporary file of an interrupted write" in out
    assert "A restart restores model.ckpt-5 (step 5)." in out


def test_empty_and_missing_directories(tmp_path, capsys):
    status, out, _ = cli(capsys, "ls", str(tmp_path))
    assert status == 0
    assert "(no committed checkpoint)" in out
    assert "No checkpoint: a restart starts from scratch." in out
    status, out, err = cli(capsys, "ls", str(tmp_path / "nope"))
    assert status == 1
    assert f"torchsupervisor ls: error: no such file or directory: {tmp_path / 'nope'}" in err


def test_no_verify_reads_manifests_only(saver_run, capsys):
    flip_byte(data_file(saver_run.prefix(5)))
    status, out, _ = cli(capsys, "ls", saver_run.logdir, "--no-verify")
    assert status == 0
    assert "CORRUPT" not in out and "unchecked" in rows(out)["model.ckpt-5"]


def test_incremental_checkpoints_show_shared_bytes(tmp_path, capsys):
    logdir = str(tmp_path)
    frozen = torch.nn.Linear(64, 64).requires_grad_(False)
    head = torch.nn.Linear(64, 1)
    saver = Saver({"frozen": frozen, "head": head}, incremental=True)
    prefix = os.path.join(logdir, "model.ckpt")
    saver.save(None, prefix, global_step=1)  # Full.
    with torch.no_grad():
        head.weight.add_(1.0)
    # Full again: the first chain needs an independent one to fall back on.
    second = saver.save(None, prefix, global_step=2)
    with torch.no_grad():
        head.weight.add_(1.0)
    saver.save(None, prefix, global_step=3)  # Incremental: frozen/ read from step 2's file.
    status, out, _ = cli(capsys, "ls", logdir, "--json")
    assert status == 0
    by_step = {c["step"]: c for c in json.loads(out)["checkpoints"]}
    assert by_step[2]["size_bytes"] == by_step[2]["own_bytes"]
    assert by_step[3]["size_bytes"] > by_step[3]["own_bytes"]
    assert by_step[3]["size_bytes"] - by_step[3]["own_bytes"] == os.path.getsize(data_file(second))
