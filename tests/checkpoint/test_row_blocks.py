"""Blocks of rows in checkpoints (sharded ones and ``Saver``'s): each larger chunk's rows
checksummed by block, so that a restore at another world size, or of a DDP checkpoint into an
FSDP2 model, reads about the bytes each rank ends up holding (ranged reads of the blocks that
hold its rows, each block checked), bitwise the saved state."""

from __future__ import annotations

import os
import re

import crc32c
import pytest
import safetensors.torch
import torch
from counting_storage import CountingStorage, counting_object_storage, held_bytes
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from torchsupervisor import CheckpointReader, Saver
from torchsupervisor.checkpoint.entries import TensorEntry
from torchsupervisor.checkpoint.format import ManifestError
from torchsupervisor.checkpoint.row_blocks import (
    MAX_BLOCK_BYTES,
    MIN_BLOCK_BYTES,
    block_rows,
    chunk_checksums,
    covering,
)
from torchsupervisor.checkpoint.sharded.collective import load_sharded, save_sharded
from torchsupervisor.checkpoint.sharded.metadata import ShardedManifest
from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState
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


def _assert_as_reference(state: dict, directory: str) -> None:
    """Every tensor of the reference in ``directory`` is bitwise the whole one of ``state``."""
    restored = _full(state)
    reference = safetensors.torch.load_file(os.path.join(directory, REFERENCE))
    for name, tensor in reference.items():
        assert torch.equal(restored[name], tensor), name


def _raised(fn, *args) -> str:
    """``"<type>: <message>"`` of what ``fn(*args)`` raised (it must raise)."""
    with pytest.raises(Exception) as caught:
        fn(*args)
    return f"{type(caught.value).__name__}: {caught.value}"


def save_rank(rank: int, world_size: int, directory: str) -> None:
    """Save at ``directory`` (or a bucket's URL); rank 0 writes the reference of the values
    there, or (a bucket) in ``REFERENCE_DIR``."""
    model, optimizer = _build(0, world_size)
    model(torch.randn(4, 256)).pow(2).mean().backward()
    optimizer.step()
    state = _state(model, optimizer)
    save_sharded(state, f"{directory}/{PREFIX}", global_step=5)
    reference = _full(state)
    if rank == 0:
        where = os.environ.get("REFERENCE_DIR", directory)
        safetensors.torch.save_file(reference, os.path.join(where, REFERENCE))


def load_rank(rank: int, world_size: int, directory: str) -> tuple[int, int]:
    """Restore, compare with the reference; the bytes read and the bytes held."""
    model, optimizer = _build(1, world_size)
    model(torch.randn(4, 256)).pow(2).mean().backward()
    optimizer.step()  # Adam's moments exist, to be overwritten.
    state = _state(model, optimizer)
    storage = CountingStorage()
    load_sharded(state, os.path.join(directory, PREFIX), storage=storage)
    held = held_bytes(state)
    _assert_as_reference(state, directory)
    return storage.bytes_read, held


def bucket_rank(rank: int, world_size: int, url: str, restore: bool) -> tuple[int, int] | None:
    """Save at 2 ranks into the bucket (``restore`` False), or restore from it: the bytes
    this rank's GETs fetched, and the bytes it holds."""
    if not restore:
        save_rank(rank, world_size, url)
        return None
    model, optimizer = _build(1, world_size)
    state = _state(model, optimizer)
    storage = counting_object_storage(url)
    load_sharded(state, f"{url}/{PREFIX}", storage=storage)
    _assert_as_reference(state, os.environ["REFERENCE_DIR"])
    return storage.bytes_read, held_bytes(state)


def load_error_rank(rank: int, world_size: int, directory: str) -> str:
    model, optimizer = _build(1, world_size)
    return _raised(load_sharded, _state(model, optimizer), os.path.join(directory, PREFIX))


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


def test_a_restore_from_a_bucket_at_another_world_size_fetches_about_what_each_rank_holds(
    s3_server, s3_url, tmp_path
):
    """The same ranged reads from S3 (SeaweedFS): each rank's GETs fetch the blocks of its
    rows, not the 8 MiB parts around them nor every chunk it overlaps."""
    env = {**s3_server.env, "REFERENCE_DIR": str(tmp_path)}
    run_world(bucket_rank, s3_url, False, world_size=2, env=env)
    results = run_world(bucket_rank, s3_url, True, world_size=3, env=env)
    for read, held in results:
        assert read <= 1.1 * held, results


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


# ------------------------------------------- checkpoints of one process or DDP (``Saver``)

DDP_PREFIX = "ddp.ckpt-5"


def _plain(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 499), torch.nn.ReLU(), torch.nn.Linear(499, 250)
    )
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def ddp_save_rank(rank: int, world_size: int, directory: str) -> None:
    """A DDP step on every rank; the chief saves the DDP model and the plain optimizer's state
    (keyed by parameter positions) with ``Saver``, and the reference of its values (the
    FSDP2 optimizer's names: the positions in order)."""
    from torch.nn.parallel import DistributedDataParallel

    model, optimizer = _plain(0)
    ddp = DistributedDataParallel(model)
    ddp(torch.randn(4, 256)).pow(2).mean().backward()
    optimizer.step()
    if rank == 0:  # The DDP wrapper: saved under the module's own names.
        Saver({"model": ddp, "optimizer": optimizer}).save(
            None, os.path.join(directory, "ddp.ckpt"), global_step=5
        )
        names = [n for n, _ in model.named_parameters()]
        reference = {f"model/{n}": t for n, t in model.state_dict().items()}
        for i, p in enumerate(model.parameters()):
            for key, value in optimizer.state[p].items():
                reference[f"optimizer/state/{names[i]}/{key}"] = value
        safetensors.torch.save_file(
            {n: t.contiguous() for n, t in reference.items()}, os.path.join(directory, REFERENCE)
        )


def ddp_load_rank(rank: int, world_size: int, directory: str) -> tuple[int, int, list[str]]:
    """Restore the DDP checkpoint into an FSDP2 model and its optimizer, compare, train one
    step: the bytes read, held, and the types of the optimizer's state tensors."""
    model, optimizer = _build(1, world_size)
    state = _state(model, optimizer)
    storage = CountingStorage()
    Saver(state, storage=storage).restore(None, os.path.join(directory, DDP_PREFIX))
    held = held_bytes(state)
    _assert_as_reference(state, directory)
    moments = [v for s in optimizer.state.values() for v in s.values() if v.dim()]
    kinds = sorted({type(v).__name__ for v in moments})
    model(torch.randn(4, 256)).pow(2).mean().backward()
    optimizer.step()  # The restored moments are the parameters' shards: a step works.
    return storage.bytes_read, held, kinds


def prefixed_load_rank(rank: int, world_size: int, directory: str) -> tuple[int, int]:
    """Restore a checkpoint whose model entries carry DDP's ``module.`` prefix (an earlier
    version's, another tool's) into an FSDP2 model: the bytes read and held."""
    model, _ = _build(1, world_size)
    storage = CountingStorage()
    Saver({"model": model}, storage=storage).restore(None, os.path.join(directory, "old.ckpt-1"))
    _assert_as_reference({"model": model}, directory)
    return storage.bytes_read, held_bytes({"model": model})


def ddp_mismatch_rank(rank: int, world_size: int, directory: str) -> str:
    model, _ = _build(1, world_size)
    params = list(model.parameters())
    optimizer = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}])
    saver = Saver(_state(model, optimizer))
    return _raised(saver.restore, None, os.path.join(directory, DDP_PREFIX))


@pytest.fixture(scope="module")
def saved_by_ddp(tmp_path_factory):
    directory = tmp_path_factory.mktemp("row-blocks-ddp")
    run_world(ddp_save_rank, str(directory), world_size=2)
    return directory


def test_saver_records_blocks_unless_told_not_to(saved_by_ddp, tmp_path):
    manifest = CheckpointReader(str(saved_by_ddp / DDP_PREFIX)).manifest
    big = {n for n, e in manifest.tensors.items() if e.nbytes > MIN_BLOCK_BYTES}
    assert big and set(manifest.row_blocks) == big  # Weights and Adam moments, the biases.
    CheckpointReader(str(saved_by_ddp / DDP_PREFIX)).verify()
    model, _ = _plain(0)
    prefix = Saver({"model": model}, row_blocks=False).save(None, str(tmp_path / "m"), 1)
    assert CheckpointReader(prefix).manifest.row_blocks == {}


def test_an_incremental_save_keeps_the_blocks_of_what_it_references(tmp_path):
    model, _ = _plain(0)
    model.requires_grad_(False)  # Frozen: referenced by the next save.
    saver = Saver({"model": model}, max_to_keep=None)
    saved = [CheckpointReader(saver.save(None, str(tmp_path / "m"), s)).manifest for s in (1, 2, 3)]
    # The second save of a run is full (``policy.may_reference``); the third references it.
    assert [len(m.shards) for m in saved] == [1, 1, 2]
    assert saved[2].row_blocks == saved[1].row_blocks == saved[0].row_blocks != {}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_ddp_checkpoint_restores_into_fsdp2_reading_what_each_rank_holds(
    saved_by_ddp, world_size
):
    """The plain optimizer's state, keyed by positions, becomes the FSDP2 optimizer's, keyed
    by names, its moments sharded like the parameters (DTensors, not whole tensors on every
    rank; Adam's ``step`` is a scalar)."""
    results = run_world(ddp_load_rank, str(saved_by_ddp), world_size=world_size)
    for read, held, kinds in results:
        assert read <= 1.1 * held, (world_size, results)
        assert kinds == ["DTensor"], kinds


def test_a_checkpoint_with_ddps_prefix_restores_into_fsdp2_reading_each_ranks_rows(
    saved_by_ddp, tmp_path
):
    reference = safetensors.torch.load_file(str(saved_by_ddp / REFERENCE))
    model = {n[len("model/") :]: t for n, t in reference.items() if n.startswith("model/")}
    old = {f"module.{n}": t for n, t in model.items()}
    Saver({"model": old}).save(None, str(tmp_path / "old.ckpt"), global_step=1)
    safetensors.torch.save_file(
        {f"model/{n}": t for n, t in model.items()}, str(tmp_path / REFERENCE)
    )
    for read, held in run_world(prefixed_load_rank, str(tmp_path), world_size=3):
        assert read <= 1.1 * held, (read, held)


def test_a_ddp_checkpoint_with_other_param_groups_is_refused_on_every_rank(saved_by_ddp):
    errors = run_world(ddp_mismatch_rank, str(saved_by_ddp), world_size=2)
    assert all(e.startswith("InvalidArgumentError") for e in errors), errors
    assert all("param groups of [4] parameters" in e for e in errors), errors


def test_a_plain_models_sharded_optimizer_state_is_saved_by_names_in_one_process(tmp_path):
    """``ShardedOptimizerState`` of a model without DTensors (one process, DDP) is saved like
    any state, keyed by parameter names, and restored."""
    model, optimizer = _plain(0)
    model(torch.randn(4, 256)).pow(2).mean().backward()
    optimizer.step()
    prefix = Saver(_state(model, optimizer)).save(None, str(tmp_path / "m"), 1)
    names = CheckpointReader(prefix).manifest.tensors
    assert "optimizer/state/0.weight/exp_avg" in names and "model/2.bias" in names
    fresh, fresh_optimizer = _plain(1)
    Saver(_state(fresh, fresh_optimizer)).restore(None, prefix)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(optimizer.state[p]["exp_avg"], fresh_optimizer.state[q]["exp_avg"])


def test_an_fsdp2_checkpoint_restores_into_a_plain_model_and_optimizer_in_one_process(saved):
    """The way back: the optimizer state keyed by names loads into a plain ``torch.optim``
    optimizer (which maps the saved groups' parameters onto its own in order, as it does for
    positions), every value bitwise the saved one."""
    model, optimizer = _plain(1)
    Saver({"model": model, "optimizer": optimizer}).restore(None, str(saved / PREFIX))
    reference = safetensors.torch.load_file(str(saved / REFERENCE))
    names = [n for n, _ in model.named_parameters()]
    for name, p in zip(names, model.parameters()):
        assert torch.equal(p.detach(), reference[f"model/{name}"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], reference[f"optimizer/state/{name}/{key}"])
    model(torch.randn(4, 256)).pow(2).mean().backward()
    optimizer.step()


def test_a_plain_optimizers_checkpoint_restores_into_a_sharded_optimizer_state_in_one_process(
    saved_by_ddp,
):
    """A checkpoint keyed by parameter positions (a plain optimizer's, DDP's chief) restored in
    one process into a plain model whose optimizer is wrapped in ``ShardedOptimizerState``
    (keyed by names): every value bitwise the saved one, and the next step works."""
    model, optimizer = _plain(1)
    Saver(_state(model, optimizer)).restore(None, str(saved_by_ddp / DDP_PREFIX))
    reference = safetensors.torch.load_file(str(saved_by_ddp / REFERENCE))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), reference[f"model/{name}"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], reference[f"optimizer/state/{name}/{key}"])
    model(torch.randn(4, 256)).pow(2).mean().backward()
    optimizer.step()
