"""``torchsupervisor export``: a checkpoint's tensors as a plain .safetensors file."""

from __future__ import annotations

import os
import stat

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from torchsupervisor import CheckpointReader

from .conftest import cli, data_file, flip_byte


def test_exports_every_tensor_with_its_state_path(saver_run, tmp_path, capsys):
    out = str(tmp_path / "all.safetensors")
    status, stdout, _ = cli(capsys, "export", saver_run.prefix(4), out)
    assert status == 0
    expected = CheckpointReader(saver_run.prefix(4)).read_tensors()
    assert f"Wrote {len(expected)} tensors" in stdout
    loaded = load_file(out)
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype
    with safe_open(out, "pt") as f:
        metadata = f.metadata()
    assert metadata["global_step"] == "4"
    assert metadata["source"] == os.path.abspath(saver_run.prefix(4))
    # Normal permissions, as a checkpoint's files (0644 under the usual umask 022).
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o644 & ~umask


def test_only_gives_the_names_of_the_module_state_dict(saver_run, tmp_path, capsys):
    out = str(tmp_path / "model.safetensors")
    status, _, _ = cli(capsys, "export", saver_run.logdir, out, "--only", "model")
    assert status == 0
    fresh = torch.nn.Linear(4, 3)
    fresh.load_state_dict(load_file(out))  # strict: exactly the module's names
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, saver_run.weights[5][name])  # the newest checkpoint
    status, _, err = cli(capsys, "export", saver_run.logdir, out + "2", "--only", "encoder")
    assert status == 1
    assert (
        "--only encoder: no tensor under 'encoder/'" in err
        and "the state entries with tensors are: model" in err
    )


def test_does_not_replace_a_file_without_force(saver_run, tmp_path, capsys):
    out = tmp_path / "w.safetensors"
    out.write_bytes(b"keep me")
    status, _, err = cli(capsys, "export", saver_run.prefix(5), str(out))
    assert status == 1 and "exists; pass --force to replace it" in err
    assert out.read_bytes() == b"keep me"
    status, _, _ = cli(capsys, "export", saver_run.prefix(5), str(out), "--force")
    assert status == 0 and set(load_file(str(out))) >= {"model/weight", "model/bias"}


def test_a_corrupt_checkpoint_is_not_exported(saver_run, tmp_path, capsys):
    flip_byte(data_file(saver_run.prefix(5)))
    out = tmp_path / "w.safetensors"
    status, _, err = cli(capsys, "export", saver_run.prefix(5), str(out))
    assert status == 1
    assert f"Checkpoint shard {data_file(saver_run.prefix(5))} is corrupt" in err
    assert os.listdir(tmp_path) == ["run"]  # nothing written, no temporary left
