"""``torchsupervisor verify``: exit status 0 only if the checkpoint a restart would use is valid."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .conftest import cli, data_file, flip_byte

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_valid_logdir(saver_run, capsys):
    status, out, _ = cli(capsys, "verify", saver_run.logdir)
    assert status == 0
    assert out.splitlines()[0].startswith("ok       model.ckpt-5 (step 5):")
    assert "every byte checked" in out
    assert out.rstrip().endswith("A restart restores model.ckpt-5 (step 5).")


def test_corrupt_newest_checkpoint_fails_and_names_the_fallback(saver_run, capsys):
    shard = data_file(saver_run.prefix(5))
    flip_byte(shard)
    status, out, _ = cli(capsys, "verify", saver_run.logdir)
    assert status == 1
    assert f"CORRUPT  model.ckpt-5 (step 5): Checkpoint shard {shard} is corrupt" in out
    assert "checksum mismatch" in out
    assert (
        "A restart would skip model.ckpt-5 (step 5) and fall back to model.ckpt-4 (step 4), "
        "losing 1 steps." in out
    )


def test_a_damaged_older_checkpoint_does_not_matter_unless_all(saver_run, capsys):
    flip_byte(data_file(saver_run.prefix(2)))
    status, out, _ = cli(capsys, "verify", saver_run.logdir)
    assert status == 0 and "model.ckpt-2" not in out  # a restart never reads it
    status, out, _ = cli(capsys, "verify", saver_run.logdir, "--all")
    assert status == 1
    assert "CORRUPT  model.ckpt-2 (step 2)" in out
    assert "2 of 3 checkpoints are valid." in out


def test_all_valid(saver_run, capsys):
    status, out, _ = cli(capsys, "verify", saver_run.logdir, "--all")
    assert status == 0
    assert "3 of 3 checkpoints are valid." in out


def test_no_valid_checkpoint(saver_run, capsys):
    for step in (5, 4, 2):
        flip_byte(data_file(saver_run.prefix(step)))
    status, out, _ = cli(capsys, "verify", saver_run.logdir)
    assert status == 1
    assert out.count("CORRUPT") == 3
    assert "No valid checkpoint in" in out and "DataLossError" in out


def test_no_checkpoint_and_missing_paths(tmp_path, capsys):
    status, out, _ = cli(capsys, "verify", str(tmp_path))
    assert status == 1
    assert "No checkpoint in" in out and "starts from scratch" in out
    status, out, err = cli(capsys, "verify", str(tmp_path / "nope"))
    assert status == 1 and out == ""
    assert err == f"torchsupervisor verify: error: no such file or directory: {tmp_path / 'nope'}\n"


def test_a_single_prefix(saver_run, capsys):
    status, out, _ = cli(capsys, "verify", saver_run.prefix(4))
    assert status == 0 and out.startswith("ok       model.ckpt-4 (step 4)")
    os.remove(data_file(saver_run.prefix(4)))
    status, out, _ = cli(capsys, "verify", saver_run.prefix(4))
    assert status == 1 and "is missing" in out


@pytest.mark.parametrize("how", ["module", "script"])
def test_exit_status_of_the_command(saver_run, how):
    if how == "module":
        command = [sys.executable, "-m", "torchsupervisor"]
    else:
        script = os.path.join(os.path.dirname(sys.executable), "torchsupervisor")
        if not os.path.exists(script):
            pytest.skip("the console script is not installed (pip install -e .)")
        command = [script]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ok = subprocess.run([*command, "verify", saver_run.logdir], capture_output=True, env=env)
    assert ok.returncode == 0, ok.stderr
    flip_byte(data_file(saver_run.prefix(5)))
    bad = subprocess.run([*command, "verify", saver_run.logdir], capture_output=True, env=env)
    assert bad.returncode == 1
    assert b"CORRUPT" in bad.stdout
