"""Sharded checkpoints of an FSDP2 model (CPU, gloo): every rank writes its part; any world
size restores; damage and write failures reach every rank and commit nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from repo_paths import worker

from torchsupervisor import CheckpointReader, get_checkpoint_state
from torchsupervisor.errors import CorruptCheckpointError

WORKER = worker("sharded_worker.py")


def _run(scenario: str, directory, world_size: int, arg: str | None = None) -> list[str]:
    """Run ``world_size`` ranks of the worker; return each rank's stdout (all must exit 0)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    extra = [] if arg is None else [arg]
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, scenario, str(directory), str(rank), str(world_size), *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        outputs.append(out)
    return outputs


def _lines(out: str, kind: str) -> list[list[str]]:
    return [line.split(" ", 3) for line in out.splitlines() if line.startswith(kind + " ")]


def _files(directory) -> set[str]:
    return {n for n in os.listdir(directory) if n.startswith(("model.ckpt", "checkpoint"))}


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory):
    """A checkpoint of an FSDP2 model + Adam state saved by 2 ranks, with its full values."""
    directory = tmp_path_factory.mktemp("sharded2")
    outputs = _run("save", directory, 2)
    return directory, outputs


def test_each_rank_writes_its_own_shard_and_the_coordinator_commits(saved_by_two):
    directory, outputs = saved_by_two
    created = [[line[1] for line in _lines(out, "CREATED")] for out in outputs]
    assert [name.split(".tmp")[0] for name in created[0]] == [
        "model.ckpt-3.data-00000-of-00002",
        "model.ckpt-3.index",  # The coordinator writes the manifest last ...
        "checkpoint",  # ... then the state file.
    ]
    assert [name.split(".tmp")[0] for name in created[1]] == ["model.ckpt-3.data-00001-of-00002"]
    assert all(_lines(out, "SAVED") == [["SAVED", "True"]] for out in outputs)
    assert _files(directory) == {
        "model.ckpt-3.data-00000-of-00002",
        "model.ckpt-3.data-00001-of-00002",
        "model.ckpt-3.index",
        "checkpoint",
    }
    state = get_checkpoint_state(str(directory))
    assert state.model_checkpoint_path == str(directory / "model.ckpt-3")


def test_one_process_reads_the_whole_tensors_and_every_chunk_verifies(saved_by_two):
    directory, _ = saved_by_two
    reference = safetensors.torch.load_file(str(directory / "reference.safetensors"))
    reader = CheckpointReader(str(directory / "model.ckpt-3"))
    assert reader.manifest.global_step == 3
    shapes = reader.get_variable_to_shape_map()
    for name, tensor in reference.items():
        assert shapes[name] == list(tensor.shape)
        assert torch.equal(reader.get_tensor(name), tensor), name
    tensors = reader.read_tensors()
    assert sorted(tensors) == sorted(reference)
    # The parameters really were split between the ranks: chunks in both shards.
    assert len(reader.manifest.sharded_tensors["model/0.weight"].chunks) == 2
    assert reader.is_sharded
    # The chunk entries are readable by name, and the whole-file check covers them.
    (chunk, _) = reader.manifest.sharded_tensors["model/0.weight"].chunks
    assert reader.has_tensor(chunk.entry) and chunk.entry.startswith("model/0.weight[0:")
    assert torch.equal(reader.get_tensor(chunk.entry), reference["model/0.weight"][:5])
    reader.verify()


@pytest.mark.parametrize("world_size", [1, 2])
def test_restores_with_the_same_or_another_world_size(saved_by_two, world_size):
    directory, _ = saved_by_two
    outputs = _run("load", directory, world_size)
    for out in outputs:
        (match,) = _lines(out, "MATCH")
        assert match[2] == "3"  # The step in the manifest.
        assert int(match[1]) >= 10  # Parameters and Adam moments, all compared bitwise.


def test_saved_by_one_rank_restores_on_two(tmp_path):
    _run("save", tmp_path, 1)
    assert _files(tmp_path) >= {"model.ckpt-3.data-00000-of-00001", "model.ckpt-3.index"}
    outputs = _run("load", tmp_path, 2)
    assert all(_lines(out, "MATCH") for out in outputs)


def _copy_checkpoint(source, target) -> None:
    for name in os.listdir(source):
        if name.startswith("model.ckpt") or name in ("checkpoint", "reference.safetensors"):
            with open(source / name, "rb") as f, open(target / name, "wb") as g:
                g.write(f.read())


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_flipped_bit_in_one_rank_shard_fails_the_restore_on_every_rank(
    saved_by_two, tmp_path, where
):
    directory, _ = saved_by_two
    _copy_checkpoint(directory, tmp_path)
    shard = tmp_path / "model.ckpt-3.data-00001-of-00002"
    data = bytearray(shard.read_bytes())
    data[-5 if where == "payload" else 20] ^= 0x10  # The header comes first.
    shard.write_bytes(bytes(data))
    with pytest.raises(
        CorruptCheckpointError, match="header damaged" if where == "header" else "checksum mismatch"
    ):
        CheckpointReader(str(tmp_path / "model.ckpt-3")).read_tensors()
    outputs = _run("load-error", tmp_path, 2)
    errors = [_lines(out, "ERROR")[0] for out in outputs]
    assert {e[1] for e in errors} == {"CorruptCheckpointError"}
    assert all(e[2] == str(shard) for e in errors), errors  # Names the file.
    # The rank that read the damaged chunk raises its own error; a rank that read only sound
    # chunks raises a copy of it (not a hang, not a partial load).
    assert "own" in {e[3] for e in errors} and {e[3] for e in errors} <= {"own", "copy"}


def test_a_missing_shard_fails_the_restore_on_every_rank(saved_by_two, tmp_path):
    directory, _ = saved_by_two
    _copy_checkpoint(directory, tmp_path)
    os.remove(tmp_path / "model.ckpt-3.data-00000-of-00002")
    outputs = _run("load-error", tmp_path, 2)
    errors = [_lines(out, "ERROR")[0] for out in outputs]
    assert {e[1] for e in errors} == {"CorruptCheckpointError"}, errors


@pytest.mark.parametrize("failing_rank", ["0", "1"])
def test_a_disk_full_on_one_rank_fails_the_save_everywhere_and_leaves_nothing(
    tmp_path, failing_rank
):
    outputs = _run("save-fail", tmp_path, 2, failing_rank)
    for out in outputs:
        (error,) = [line.split(" ", 2) for line in out.splitlines() if line.startswith("ERROR")]
        assert error[1] == "CheckpointSaveError", error
        # Every rank names the rank that failed and why.
        assert f"failed on rank {failing_rank}: [Errno 28] No space left" in error[2], error
    assert _files(tmp_path) == set()  # No shard, no temporary, no index, no state file.


def test_a_failed_manifest_write_commits_nothing(tmp_path):
    outputs = _run("index-fail", tmp_path, 2)
    for out in outputs:
        (error,) = [line.split(" ", 2) for line in out.splitlines() if line.startswith("ERROR")]
        assert error[1] == "CheckpointSaveError", error
        assert "Input/output error" in error[2] and ".index" in error[2], error
    assert _files(tmp_path) == set()
