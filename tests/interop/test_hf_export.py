"""Export to Hugging Face's layout: loaded by ``transformers``' own ``from_pretrained``
(sharded, with its index) and by ``safetensors``; a 2-rank FSDP2 checkpoint streams chunk by
chunk; a damaged tensor leaves no file with its bytes; a bucket is a source too."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
import transformers
from rank_processes import run_ranks
from repo_paths import worker
from safetensors import safe_open

import torchsupervisor as ts
from torchsupervisor.errors import AlreadyExistsError, CorruptCheckpointError, InvalidArgumentError
from torchsupervisor.interop.hf_export import INDEX_FILE, export_hf, plan_shards

transformers.utils.logging.disable_progress_bar()  # Its bar's monitor thread outlives a test.


def _save(state, save_path, step=3, storage=None) -> str:
    saver = ts.Saver(storage=storage) if storage is not None else ts.Saver()
    try:
        return saver.save(SimpleNamespace(state=state), save_path, global_step=step)
    finally:
        saver.close()


def _files(out):
    with open(os.path.join(out, INDEX_FILE)) as f:
        return json.load(f)


def test_a_gpt2_export_loads_with_from_pretrained_and_computes_the_same(tmp_path):
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    optimizer = torch.optim.Adam(model.parameters())
    run = tmp_path / "run"
    run.mkdir()
    _save({"model": model, "optimizer": optimizer}, str(run / "model.ckpt"))
    out = str(tmp_path / "hf")
    files = export_hf(str(run), out, max_shard_bytes=30_000)
    assert files[-1].endswith(INDEX_FILE) and len(files) > 3  # Several shards, the index last.
    index = _files(out)
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in state.values()
    )
    for name, file in index["weight_map"].items():
        with safe_open(os.path.join(out, file), framework="pt") as f:
            assert torch.equal(f.get_tensor(name), state[name]), name
    config.save_pretrained(out)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    x = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)


def test_dtypes_are_kept_and_bad_arguments_are_refused(tmp_path):
    state = {
        "model": {
            "a": torch.randn(3, 4).to(torch.bfloat16),
            "b": torch.arange(5),
            "c": torch.randn(2).half(),
            "d": torch.tensor([True, False]),
            "empty": torch.zeros(0, 3),
        },
        "other": {"e": torch.ones(2)},
    }
    run = tmp_path / "run"
    run.mkdir()
    _save(state, str(run / "model.ckpt"))
    out = str(tmp_path / "hf")
    export_hf(str(run), out)
    ((file,),) = [set(_files(out)["weight_map"].values())]
    with safe_open(os.path.join(out, file), framework="pt") as f:
        assert sorted(f.keys()) == ["a", "b", "c", "d", "empty"]
        for name, tensor in state["model"].items():
            got = f.get_tensor(name)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        assert f.metadata()["global_step"] == "3"
    with pytest.raises(AlreadyExistsError):
        export_hf(str(run), out)
    export_hf(str(run), out, subtree=None, overwrite=True)
    assert "other/e" in _files(out)["weight_map"]
    with pytest.raises(InvalidArgumentError, match="entries with tensors are: model, other"):
        export_hf(str(run), str(tmp_path / "x"), subtree="nothing")
    assert plan_shards([("a", 5), ("b", 5), ("c", 20), ("d", 1)], 10) == [
        [("a", 5), ("b", 5)], [("c", 20)], [("d", 1)],
    ]  # fmt: skip


def test_a_damaged_tensor_leaves_no_file_with_its_bytes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    prefix = _save(
        {"model": {"a": torch.ones(1000), "b": torch.zeros(1000)}}, str(run / "model.ckpt")
    )
    reader = ts.NewCheckpointReader(prefix)
    entry = reader.manifest.tensors["model/b"]
    shard = reader.manifest.shards[entry.shard]
    with open(os.path.join(str(run), shard.file), "r+b") as f:
        f.seek(shard.data_offset + entry.begin + 100)
        f.write(b"\x01")
    out = tmp_path / "hf"
    with pytest.raises(CorruptCheckpointError, match="model/b"):
        export_hf(str(run), str(out), max_shard_bytes=4000)
    # The first file (tensor a) was committed; the second (b) and the index were not.
    assert sorted(os.listdir(out)) == ["model-00001-of-00002.safetensors"]


def test_an_fsdp2_checkpoint_exports_as_its_consolidated_tensors(tmp_path):
    logdir = tmp_path / "fsdp"
    results = run_ranks(worker("fsdp_worker.py"), logdir, 5)
    assert all(code == 0 for _, _, code in results), [err[-2000:] for _, err, _ in results]
    reader = ts.load_checkpoint(str(logdir))
    assert reader.is_sharded
    out = str(tmp_path / "hf")
    export_hf(str(logdir), out, max_shard_bytes=300)
    weight_map = _files(out)["weight_map"]
    names = [n for n in reader.get_variable_to_shape_map() if n.startswith("model/")]
    assert sorted(weight_map) == sorted(n[len("model/") :] for n in names)
    for name in names:
        with safe_open(os.path.join(out, weight_map[name[len("model/") :]]), framework="pt") as f:
            assert torch.equal(f.get_tensor(name[len("model/") :]), reader.get_tensor(name))


def test_a_checkpoint_in_a_bucket_exports_and_the_command_line(s3_url, tmp_path, capsys):
    from torchsupervisor.cli import main
    from torchsupervisor.storage import storage_for

    state = {"model": torch.nn.Linear(8, 3)}
    _save(state, f"{s3_url}/model.ckpt", storage=storage_for(s3_url))
    out = str(tmp_path / "hf")
    assert main(["export", s3_url, out, "--format", "hf", "--max-shard-size", "100B"]) == 0
    assert "Wrote 2 safetensors file(s)" in capsys.readouterr().out
    weight_map = _files(out)["weight_map"]
    for name, tensor in state["model"].state_dict().items():
        with safe_open(os.path.join(out, weight_map[name]), framework="pt") as f:
            assert torch.equal(f.get_tensor(name), tensor)
    assert main(["export", s3_url, out, "--format", "hf", "--max-shard-size", "lots"]) != 0
    assert "expected a size such as 5GB" in capsys.readouterr().err


def test_read_ahead_gives_its_buffers_back_and_stops_with_its_consumer():
    from torchsupervisor.interop.hf_export import BufferPool, ReadAhead

    pool = BufferPool(8, depth=2)

    def produce(buffer_for, fail_at=None):
        for i in range(100):
            if i == fail_at:
                raise OSError("the disk went away")
            piece = buffer_for(8)
            piece[:] = bytes([i]) * 8
            yield piece

    pieces = iter(ReadAhead(produce, pool))
    assert bytes(next(pieces)) == b"\x00" * 8 and bytes(next(pieces)) == b"\x01" * 8
    pieces.close()  # The consumer stops early: the thread ends, every buffer is back.
    assert pool.free.qsize() == 2
    got = []
    with pytest.raises(OSError, match="the disk went away"):
        for piece in ReadAhead(lambda b: produce(b, fail_at=3), pool):
            got.append(bytes(piece)[0])
    assert got == [0, 1, 2] and pool.free.qsize() == 2


def save_columns_rank(rank: int, world_size: int, directory: str) -> None:
    """A tensor split along its columns (and one along its rows), saved by every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from torchsupervisor.checkpoint.sharded.collective import save_sharded

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(30, dtype=torch.float32).reshape(6, 5)
    state = {
        "model": {
            "w": distribute_tensor(full, mesh, [Shard(1)]),
            "b": distribute_tensor(full[0].clone(), mesh, [Shard(0)]),
        }
    }
    save_sharded(state, os.path.join(directory, "model.ckpt-1"), global_step=1)


def test_a_tensor_split_along_its_columns_exports_whole(tmp_path):
    from torchsupervisor.testing import run_world

    (tmp_path / "run").mkdir()
    run_world(save_columns_rank, str(tmp_path / "run"), world_size=2)
    reader = ts.load_checkpoint(str(tmp_path / "run"))
    chunks = reader.manifest.sharded_tensors["model/w"].chunks
    assert sorted(c.offsets for c in chunks) == [(0, 0), (0, 3)]  # Columns 0-2 and 3-4.
    out = str(tmp_path / "hf")
    export_hf(str(tmp_path / "run"), out)
    ((file,),) = [set(_files(out)["weight_map"].values())]
    full = torch.arange(30, dtype=torch.float32).reshape(6, 5)
    with safe_open(os.path.join(out, file), framework="pt") as f:
        assert torch.equal(f.get_tensor("w"), full) and torch.equal(f.get_tensor("b"), full[0])
