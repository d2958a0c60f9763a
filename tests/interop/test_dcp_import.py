"""DCP checkpoints imported without running their pickles: equal to ``dcp_to_torch_save``'s
reading (an FSDP2 save of 2 ranks with uneven chunks), crafted metadata refused before any of
it runs, storage paths kept inside the directory, a bucket read too."""

from __future__ import annotations

import os
import pickle
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp
from rank_processes import run_ranks
from repo_paths import worker
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import torchsupervisor as ts
from torchsupervisor.errors import CorruptCheckpointError, NotFoundError
from torchsupervisor.interop.dcp_import import dcp_import, read_dcp, read_dcp_metadata


def _flat(tree, path=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(value, f"{path}/{key}")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _flat(value, f"{path}/{i}")
    else:
        yield path, tree


def _assert_same(ours, reference):
    a, b = dict(_flat(ours)), dict(_flat(reference))
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


@pytest.fixture(scope="module")
def fsdp_dcp(tmp_path_factory):
    """A DCP checkpoint written by 2 FSDP2 ranks (gloo): tensors in uneven chunks."""
    out = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    results = run_ranks(worker("dcp_save_worker.py"), out)
    assert all(code == 0 for _, _, code in results), [err[-2000:] for _, err, _ in results]
    return out


def test_an_fsdp2_dcp_checkpoint_reads_as_dcp_to_torch_save_reads_it(fsdp_dcp, tmp_path):
    metadata = read_dcp_metadata(fsdp_dcp)
    chunks = metadata.state_dict_metadata["model.0.weight"].chunks
    assert [list(c.sizes) for c in chunks] == [[3, 4], [2, 4]]  # Uneven: 5 rows on 2 ranks.
    ours = read_dcp(fsdp_dcp)
    reference_file = str(tmp_path / "reference.pt")
    dcp_to_torch_save(fsdp_dcp, reference_file)
    _assert_same(ours, torch.load(reference_file, weights_only=True))
    assert ours["epoch"] == 2 and ours["model"]["0.weight"].shape == (5, 4)
    assert "exp_avg" in ours["optim"]["state"]["0.weight"]
    prefix = dcp_import(fsdp_dcp, str(tmp_path / "ours" / "model.ckpt"), global_step=1)
    reader = ts.NewCheckpointReader(prefix)
    reader.verify()
    assert reader.global_step == 1
    assert torch.equal(reader.get_tensor("model/0.weight"), ours["model"]["0.weight"])
    assert reader.read_tree()["epoch"] == 2
    from torchsupervisor.cli import main

    assert main(["import-dcp", fsdp_dcp, str(tmp_path / "cli" / "model.ckpt"), "--step", "4"]) == 0
    assert ts.latest_checkpoint(str(tmp_path / "cli")).endswith("model.ckpt-4")


def test_a_bucket_holds_a_dcp_checkpoint_too(fsdp_dcp, s3_url):
    from torchsupervisor.storage import storage_for

    bucket = storage_for(s3_url)
    for name in os.listdir(fsdp_dcp):
        with open(os.path.join(fsdp_dcp, name), "rb") as f:
            bucket.put(f"{s3_url}/dcp/{name}", [f.read()])
    _assert_same(read_dcp(f"{s3_url}/dcp"), read_dcp(fsdp_dcp))


class _Evil:
    """Unpickling it would run ``os.system`` (creating the marker file)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _EvalEvil:
    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return (eval, (self.code,))


class _CallEvil:
    def __init__(self, argv: list[str]) -> None:
        self.argv = argv

    def __reduce__(self):
        return (subprocess.call, (self.argv,))


class _DottedEvil:
    """A global that an admitted module's name prefixes (``torch.load``)."""

    def __reduce__(self):
        return (torch.load, ("/nonexistent",))


def _saved(tmp_path) -> str:
    directory = str(tmp_path / "small")
    model = torch.nn.Linear(3, 2)
    dcp.save({"model": model.state_dict()}, checkpoint_id=directory, no_dist=True)
    return directory


def _write_metadata(directory: str, payload) -> None:
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        pickle.dump(payload, f)


def test_crafted_metadata_is_refused_before_any_of_it_runs(tmp_path):
    directory = _saved(tmp_path)
    real = read_dcp_metadata(directory)
    marker = tmp_path / "ran"
    payloads = {
        "os.system": _Evil(f"touch {marker}"),
        "eval": _EvalEvil(f"open({str(marker)!r}, 'w')"),
        "torch.load": _DottedEvil(),
        "nested in real metadata": dict(real.state_dict_metadata, evil=_Evil(f"touch {marker}")),
        "subprocess": type(
            "P", (), {"__reduce__": lambda self: (subprocess.call, (["touch", str(marker)],))}
        )(),
    }
    for what, payload in payloads.items():
        _write_metadata(directory, payload)
        with pytest.raises(CorruptCheckpointError, match=r"refused|not DCP metadata") as e:
            read_dcp(directory)
        assert ".metadata" in str(e.value), what
        assert not marker.exists(), what
    # A metadata object that only looks right: it must be DCP's Metadata.
    _write_metadata(directory, {"state_dict_metadata": {}})
    with pytest.raises(CorruptCheckpointError, match="not DCP metadata"):
        read_dcp(directory)
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        f.write(b"not a pickle at all")
    with pytest.raises(CorruptCheckpointError, match="refused"):
        read_dcp(directory)
    os.remove(os.path.join(directory, ".metadata"))
    with pytest.raises(NotFoundError, match="not a DCP checkpoint"):
        read_dcp(directory)


def test_storage_paths_stay_inside_the_directory_and_items_are_checked(tmp_path):
    directory = _saved(tmp_path)
    real = read_dcp_metadata(directory)
    (index, info), *_ = real.storage_data.items()
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(b"x" * 10_000)
    for name in ("../outside.distcp", str(outside), ".."):
        info.relative_path = name
        _write_metadata(directory, real)
        with pytest.raises(CorruptCheckpointError, match="not a file of the directory"):
            read_dcp(directory)
    data_file = next(n for n in os.listdir(directory) if n.endswith(".distcp"))
    info.relative_path = "link.distcp"  # A link out of the directory.
    os.symlink(outside, os.path.join(directory, "link.distcp"))
    _write_metadata(directory, real)
    with pytest.raises(CorruptCheckpointError, match="not a regular file of the directory"):
        read_dcp(directory)
    info.relative_path = data_file
    info.length += 10**9  # Past the file's end.
    _write_metadata(directory, real)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        read_dcp(directory)
    info.length -= 10**9
    entry = real.state_dict_metadata[index.fqn]
    entry.chunks.append(entry.chunks[0])  # The same chunk twice: does not tile the tensor.
    _write_metadata(directory, real)
    with pytest.raises(CorruptCheckpointError, match="do not tile it"):
        read_dcp(directory)
    entry.chunks.pop()
    true_size = entry.size
    entry.size = torch.Size([2**40, *true_size[1:]])  # Terabytes claimed: refused first.
    _write_metadata(directory, real)
    with pytest.raises(CorruptCheckpointError, match="do not tile it"):
        read_dcp(directory)
    entry.size = true_size
    _write_metadata(directory, real)
    read_dcp(directory)  # Intact again.
    with open(os.path.join(directory, data_file), "r+b") as f:
        f.seek(info.offset)
        f.write(b"\x00" * 8)  # The item's torch.save header destroyed.
    with pytest.raises(CorruptCheckpointError, match=r"unreadable|something else"):
        read_dcp(directory)
