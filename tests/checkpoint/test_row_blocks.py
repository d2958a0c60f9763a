"""Blocks of rows in sharded checkpoints: each larger chunk's rows checksummed by block, so that
a restore at another world size reads about the bytes each rank ends up holding (ranged reads
of the blocks that hold its rows, each block checked), bitwise the saved state."""

from __future__ import annotations

import os
import re

import crc32c
import pytest
import safetensors.torch
import torch
from counting_storage import CountingStorage, held_bytes
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from torchsupervisor import CheckpointReader
from torchsupervisor.checkpoint.entries import TensorEntry
from torchsupervisor.checkpoint.format import ManifestError
from torchsupervisor.checkpoint.sharded.collective import load_sharded, save_sharded
from torchsupervisor.checkpoint.sharded.metadata import ShardedManifest
from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState
from torchsupervisor.checkpoint.sharded.row_blocks import (
    MAX_BLOCK_BYTES,
    block_rows,
    chunk_checksums,
    covering,
)
from torchsupervisor.core.walk import walk_state
from torchsupervisor.testing import run_world

PREFIX = "model.ckpt-5"
REFERENCE = "reference.safetensors"


def test_block_rows_follow_the_chunk_size():
    assert block_rows((), 4) is None and block_rows((0, 8), 4) is None
    assert block_rows((10, 4), 4) is None  # 160 bytes: one block.
    assert block_rows((1024, 1024), 4) == 8  # 4 MiB: 128 blocks of 32 KiB.
    assert block_rows((1000, 256), 4) == 7  # 1 MB: 143 blocks of 7 KiB.
    assert block_rows((500, 256), 4, 1000 * 256 * 4) == 7  # A chunk: blocks of its tensor.
    assert block_rows((100, 256), 4) == 4  # 100 KB: blocks of the 4 KiB floor.
    assert block_rows((300_000, 1024), 4) * 1024 * 4 == MAX_BLOCK_BYTES  # The ceiling.
    assert block_rows((3, 1 << 20), 4) == 1  # A row over the ceiling: a block a row.


def test_chunk_checksums_give_the_whole_crc_and_each_blocks_in_one_pass():
    data = torch.randn(1000, 256)
    view = memoryview(data.view(torch.uint8).reshape(-1).numpy())
    entry = TensorEntry(0, torch.float32, (1000, 256), 0, len(view))
    whole, (rows, crcs) = chunk_checksums(view, entry)
    assert whole == crc32c.crc32c(view)
    step = rows * 256 * 4
    assert len(crcs) == -(-1000 // rows)
    assert list(crcs) == [crc32c.crc32c(view[i : i + step]) for i in range(0, len(view), step)]
    assert covering((rows, crcs), 0, 1000, 1000) == (0, len(crcs))
    assert covering((16, crcs), 20, 33, 1000) == (1, 3)  # Rows 20-32: blocks 1 and 2.
    small = TensorEntry(0, torch.float32, (4,), 0, 16)
    assert chunk_checksums(view[:16], small) == (crc32c.crc32c(view[:16]), None)


def _manifest_text(blocks: dict) -> bytes:
    from torchsupervisor.checkpoint.entries import ShardEntry

    entry = TensorEntry(0, torch.float32, (10, 4), 0, 160, 1)
    manifest = ShardedManifest(
        global_step=1,
        wall_time=1.0,
        tree={"w": {"__tensor__": "w"}},
        tensors={"w": entry},
        shards=(ShardEntry("m.ckpt-1.data-00000-of-00001", 200, 40, 5, 6),),
        library_version="0",
        torch_version="0",
        row_blocks=blocks,
    )
    return manifest.to_bytes()


def test_the_manifest_keeps_the_blocks_and_refuses_inconsistent_ones():
    text = _manifest_text({"w": (3, (1, 2, 3, 4))})
    assert ShardedManifest.from_bytes(text).row_blocks == {"w": (3, (1, 2, 3, 4))}
    assert ShardedManifest.from_bytes(_manifest_text({})).row_blocks == {}
    for bad in (
        {"w": (3, (1, 2, 3))},  # 10 rows in blocks of 3: four CRCs.
        {"w": (0, ())},
        {"x": (3, (1, 2, 3, 4))},  # No such entry.
        {"w": (3, (1, 2, 3, 1 << 32))},
    ):
        with pytest.raises(ManifestError, match="row_blocks"):
            ShardedManifest.from_bytes(_manifest_text(bad))


# ---------------------------------------------------------------- what each rank runs


def _build(seed: int, world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    # Rows that 2, 3 and 4 ranks do not all divide; chunks of 250-500 KB: blocks of 4 KiB.
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 499), torch.nn.ReLU(), torch.nn.Linear(499, 250)
    )
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model, "optimizer": ShardedOptimizerState(model, optimizer)}


def _full(state: dict) -> dict[str, torch.Tensor]:
    _, tensors = walk_state(state)
    out = {}
    for name in sorted(tensors):  # The same order on every rank: full_tensor is a collective.
        t = tensors[name]
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).contiguous().clone()
    return out


def save_rank(rank: int, world_size: int, directory: str) -> None:
    model, optimizer = _build(0, world_size)
    model(torch.randn(4, 256)).pow(2).mean().backward()
    optimizer.step()
    state = _state(model, optimizer)
    save_sharded(state, os.path.join(directory, PREFIX), global_step=5)
    reference = _full(state)
    if rank == 0:
        safetensors.torch.save_file(reference, os.path.join(directory, REFERENCE))


def load_rank(rank: int, world_size: int, directory: str) -> tuple[int, int]:
    """Restore, compare with the reference; the bytes read and the bytes held."""
    model, optimizer = _build(1, world_size)
    model(torch.randn(4, 256)).pow(2).mean().backward()
    optimizer.step()  # Adam's moments exist, to be overwritten.
    state = _state(model, optimizer)
    storage = CountingStorage()
    load_sharded(state, os.path.join(directory, PREFIX), storage=storage)
    held = held_bytes(state)
    restored = _full(state)
    reference = safetensors.torch.load_file(os.path.join(directory, REFERENCE))
    for name, tensor in reference.items():
        assert torch.equal(restored[name], tensor), name
    return storage.bytes_read, held


def load_error_rank(rank: int, world_size: int, directory: str) -> str:
    model, optimizer = _build(1, world_size)
    with pytest.raises(Exception) as caught:
        load_sharded(_state(model, optimizer), os.path.join(directory, PREFIX))
    return f"{type(caught.value).__name__}: {caught.value}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("row-blocks")
    run_world(save_rank, str(directory), world_size=2)
    return directory


def test_the_sharded_save_records_blocks_of_its_larger_chunks(saved):
    reader = CheckpointReader(str(saved / PREFIX))
    reader.verify()
    manifest = reader.manifest
    assert isinstance(manifest, ShardedManifest)
    big = [n for n, e in manifest.tensors.items() if e.nbytes >= 2 * 4096 and len(e.shape) > 1]
    assert big and sorted(manifest.row_blocks) == sorted(big)


@pytest.mark.parametrize("world_size", [3, 4])
def test_a_restore_at_another_world_size_reads_about_what_each_rank_holds(saved, world_size):
    results = run_world(load_rank, str(saved), world_size=world_size)
    for read, held in results:
        # The rows held, the blocks' partial rows at both ends, and the shards' headers.
        assert read <= 1.1 * held, (world_size, results)


def test_a_damaged_block_fails_the_restore_on_every_rank(saved, tmp_path):
    for name in os.listdir(saved):
        (tmp_path / name).write_bytes((saved / name).read_bytes())
    manifest = CheckpointReader(str(tmp_path / PREFIX)).manifest
    name, (rows, _) = next(iter(sorted(manifest.row_blocks.items())))
    entry = manifest.tensors[name]
    shard = manifest.shards[entry.shard]
    row_bytes = entry.nbytes // entry.shape[0]
    data = tmp_path / shard.file
    damaged = bytearray(data.read_bytes())
    at = shard.data_offset + entry.begin + rows * row_bytes + 5  # In the second block.
    damaged[at] ^= 0x01
    data.write_bytes(bytes(damaged))
    errors = run_world(load_error_rank, str(tmp_path), world_size=3)
    assert all(e.startswith("CorruptCheckpointError") for e in errors), errors
    assert any(f"{shard.file} is corrupt: checksum mismatch" in e for e in errors), errors


def test_verify_checks_the_blocks_as_a_resharded_restore_would(saved, tmp_path):
    """A block CRC that does not match its rows (the whole chunk's CRC does): ``verify`` (and
    so ``ls``) refuses the checkpoint, naming the entry, as a restore at another world size
    would."""
    import dataclasses

    from torchsupervisor.errors import CorruptCheckpointError

    for name in os.listdir(saved):
        (tmp_path / name).write_bytes((saved / name).read_bytes())
    prefix = str(tmp_path / PREFIX)
    manifest = CheckpointReader(prefix).manifest
    name, (rows, crcs) = sorted(manifest.row_blocks.items())[-1]
    wrong = {**manifest.row_blocks, name: (rows, (*crcs[:-1], crcs[-1] ^ 1))}
    text = dataclasses.replace(manifest, row_blocks=wrong).to_bytes()
    (tmp_path / f"{PREFIX}.index").write_bytes(text)
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"damaged tensors: {name}")):
        CheckpointReader(prefix).verify()
    CheckpointReader(str(saved / PREFIX)).verify()
