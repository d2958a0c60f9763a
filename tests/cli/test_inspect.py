"""``torchsupervisor inspect``: tensors with dtypes, shapes and checksums; values on request."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from torchsupervisor import CheckpointReader, Saver

from .conftest import cli, data_file, flip_byte


def test_lists_tensors_with_dtypes_shapes_checksums_and_other_values(saver_run, capsys):
    prefix = saver_run.prefix(5)
    status, out, _ = cli(capsys, "inspect", prefix)
    assert status == 0
    manifest = CheckpointReader(prefix).manifest
    assert f"Checkpoint {prefix}" in out
    assert "global step  5" in out
    shard = manifest.shards[0]
    assert f"{shard.file}" in out and f"crc32c {shard.crc32c:08x}" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    for name, entry in manifest.tensors.items():
        row = lines[name]
        assert row[1] == str(entry.dtype).removeprefix("torch.")
        assert " ".join(row[2:-3]) == "[" + ", ".join(str(d) for d in entry.shape) + "]"
        assert row[-3] == str(entry.nbytes)
        assert row[-2] == f"{entry.crc32c:08x}"
    assert "model/weight" in lines and lines["model/weight"][2:4] == ["[3,", "4]"]
    assert "  config/lr = 0.5" in out and "  config/name = 'demo'" in out
    assert "  global_step/value = 5" in out


def test_tensor_values_like_tf_inspect_checkpoint(saver_run, capsys):
    status, out, _ = cli(capsys, "inspect", saver_run.prefix(4), "--tensor", "model/bias")
    assert status == 0
    first, *rest = out.splitlines()
    assert first == "tensor_name:  model/bias"
    assert "\n".join(rest) == str(saver_run.weights[4]["bias"].numpy())


def test_all_tensors(saver_run, capsys):
    status, out, _ = cli(capsys, "inspect", saver_run.prefix(4), "--all-tensors")
    assert status == 0
    names = [line.split("  ", 1)[1] for line in out.splitlines() if line.startswith("tensor_name")]
    assert names == sorted(CheckpointReader(saver_run.prefix(4)).manifest.tensors)


def test_a_directory_means_its_newest_checkpoint(saver_run, capsys):
    status, out, _ = cli(capsys, "inspect", saver_run.logdir)
    assert status == 0
    assert f"Checkpoint {saver_run.prefix(5)} (the newest checkpoint of" in out


def test_unknown_tensor_and_corrupt_tensor(saver_run, capsys):
    status, _, err = cli(capsys, "inspect", saver_run.prefix(5), "--tensor", "bias")
    assert status == 1
    assert "Key bias not found in checkpoint. Similar names: model/bias" in err
    flip_byte(data_file(saver_run.prefix(5)))
    reader = CheckpointReader(saver_run.prefix(5))
    last = max(reader.manifest.tensors.items(), key=lambda item: item[1].end)[0]
    status, _, err = cli(capsys, "inspect", saver_run.prefix(5), "--tensor", last)
    assert status == 1
    assert f"Tensor {last!r} in {data_file(saver_run.prefix(5))} is corrupt" in err
    missing = os.path.join(saver_run.logdir, "model.ckpt-9")
    status, _, err = cli(capsys, "inspect", missing)
    assert status == 1 and f"no such file or directory: {missing}" in err


def test_dtypes_numpy_lacks_and_json(tmp_path, capsys):
    state = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "n": torch.tensor(3)}
    prefix = Saver(state).save(None, str(tmp_path / "model.ckpt"), global_step=1)
    status, out, _ = cli(capsys, "inspect", prefix, "--tensor", "w")
    assert status == 0
    assert out.splitlines()[0] == "tensor_name:  w (bfloat16 shown as float32)"
    assert "\n".join(out.splitlines()[1:]) == str(np.arange(6, dtype=np.float32).reshape(2, 3))
    status, out, _ = cli(capsys, "inspect", prefix, "--json")
    assert status == 0
    listing = json.loads(out)
    assert listing["global_step"] == 1
    assert listing["tensors"]["w"]["dtype"] == "bfloat16"
    assert listing["tensors"]["w"]["shape"] == [2, 3]
    assert (
        listing["tensors"]["n"]["crc32c"] == CheckpointReader(prefix).manifest.tensors["n"].crc32c
    )
