"""Whatever path a user types: a log directory, a prefix, a file of a checkpoint (what tab
completion gives), a path that does not exist; and output into a pipe closed early."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from torchsupervisor import GlobalStep, Saver

from .conftest import cli, data_file


@pytest.mark.parametrize("command", ["ls", "inspect", "verify"])
@pytest.mark.parametrize("form", ["logdir", "prefix", "index", "data"])
def test_a_logdir_a_prefix_or_any_file_of_a_checkpoint(saver_run, capsys, command, form):
    prefix = saver_run.prefix(5)
    path = {
        "logdir": saver_run.logdir,
        "prefix": prefix,
        "index": prefix + ".index",
        "data": data_file(prefix),
    }[form]
    status, out, err = cli(capsys, command, path)
    assert (status, err) == (0, "")
    if command == "ls":
        assert f"Checkpoints in {saver_run.logdir}" in out
    elif command == "inspect":
        assert "model.ckpt-5" in out
    else:
        assert "model.ckpt-5 (step 5)" in out


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "events", "export"])
def test_a_missing_path_is_named_by_the_command(tmp_path, capsys, command):
    missing = str(tmp_path / "no-such-run")
    argv = [command, missing] + ([str(tmp_path / "out.safetensors")] if command == "export" else [])
    status, out, err = cli(capsys, *argv)
    assert status == 1 and out == ""
    assert err == f"torchsupervisor {command}: error: no such file or directory: {missing}\n"


def test_a_file_that_is_not_a_checkpoint_is_refused_by_name(saver_run, capsys):
    path = os.path.join(saver_run.logdir, "checkpoint")  # The state file.
    status, _, err = cli(capsys, "verify", path)
    assert status == 1
    assert err.startswith(f"torchsupervisor verify: error: {path} is neither a log directory")


def test_output_into_a_closed_pipe_ends_quietly_with_status_0(tmp_path):
    logdir = tmp_path / "run"
    logdir.mkdir()
    state = {"w": torch.arange(20_000, dtype=torch.float32), "global_step": GlobalStep()}
    Saver(state).save(None, str(logdir / "model.ckpt"), global_step=1)
    # About 200 KB printed, far more than a pipe holds (64 KiB): the writer meets the closed pipe.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchsupervisor",
            "inspect",
            str(logdir),
            "--all-tensors",
            "--full",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout.readline().startswith(b"tensor_name:")
    proc.stdout.close()  # As `| head -1` does.
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 0, err
    assert err == ""


@pytest.mark.parametrize("command", ["ls", "inspect", "verify"])
@pytest.mark.parametrize("form", ["logdir", "prefix", "index", "data"])
def test_urls_resolve_as_paths_do(s3_url, capsys, command, form):
    from torchsupervisor.storage import storage_for

    state = {"w": torch.arange(4.0), "global_step": GlobalStep()}
    saver = Saver(state)
    try:
        prefix = saver.save(None, f"{s3_url}/model.ckpt", global_step=5)
    finally:
        saver.close()  # Gives back the prefix's writer lock.
    (data,) = [n for n in storage_for(s3_url).list(s3_url) if ".data-" in n]
    path = {
        "logdir": s3_url,
        "prefix": prefix,
        "index": prefix + ".index",
        "data": f"{s3_url}/{data}",
    }[form]
    status, out, err = cli(capsys, command, path)
    assert (status, err) == (0, "")
    if command == "ls":
        assert f"Checkpoints in {s3_url}" in out
    else:
        assert "model.ckpt-5" in out


@pytest.mark.parametrize("store", ["s3", "gs", "az"])
def test_events_reads_a_run_on_any_object_store(request, capsys, store):
    # Through our storage (a local copy of the events files), not TensorBoard's file layer,
    # which knows only some schemes (gs:// would need gcsfs; az:// it does not know).
    from torchsupervisor import SummaryWriter

    url = request.getfixturevalue(f"{store}_url")
    writer = SummaryWriter(url)
    for step in range(12):
        writer.add_scalar("loss", 1.0 / (step + 1), step)
    writer.close()
    status, out, err = cli(capsys, "events", url)
    assert (status, err) == (0, "")
    assert f"Run . ({url}): 1 events file(s)" in out
    (row,) = [line.split() for line in out.splitlines() if line.startswith("loss ")]
    assert row[:5] == ["loss", "scalar", "12", "0", "11"]
