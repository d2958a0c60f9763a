"""Sharded checkpoints of an FSDP2 model (CPU, gloo): every rank writes its part; any world
size restores; damage and write failures reach every rank and commit nothing.

The ranks are real processes of a real process group (``testing.run_world``); each runs one of
the ``*_rank`` functions below and returns what it saw."""

from __future__ import annotations

import errno
import os

import pytest
import safetensors.torch
import torch
from counting_storage import CountingStorage, held_bytes
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from torchsupervisor import CheckpointReader, Saver, get_checkpoint_state, latest_checkpoint
from torchsupervisor.checkpoint.sharded.collective import load_sharded, save_sharded
from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState, is_sharded
from torchsupervisor.core.state import MAX_STATE_DEPTH
from torchsupervisor.core.walk import walk_state
from torchsupervisor.errors import CorruptCheckpointError
from torchsupervisor.testing import FaultyStorage, run_world

PREFIX = "model.ckpt-3"
REFERENCE = "reference.safetensors"

# ---------------------------------------------------------------- what each rank runs


def _build(seed: int, world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3), torch.nn.Tanh()
    )
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 if seed == 0 else 0.5)
    return model, optimizer


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    model(torch.randn(8, 6, generator=generator)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {
        "model": model,
        "optimizer": ShardedOptimizerState(model, optimizer),
        "global_step": step,
        "extra": {"tag": "run-a" if step else "", "blob": b"\x00\xff" if step else b""},
    }


def _full_tensors(state: dict) -> dict[str, torch.Tensor]:
    _, tensors = walk_state(state)
    out = {}
    for name in sorted(tensors):  # The same order on every rank: full_tensor is a collective.
        tensor = tensors[name]
        out[name] = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return {name: t.contiguous().clone() for name, t in out.items()}


def _created(storage: FaultyStorage) -> list[str]:
    return [os.path.basename(path).split(".tmp")[0] for path in storage.operations("open")]


def save_rank(rank: int, world_size: int, directory: str) -> tuple[list[str], bool]:
    """Train 3 steps and save; rank 0 also writes every full tensor to ``REFERENCE``.

    Returns the files this rank created, and whether the state was sharded."""
    model, optimizer = _build(0, world_size)
    for step in range(3):
        _train_step(model, optimizer, step)
    state = _state(model, optimizer, 3)
    storage = FaultyStorage()
    save_sharded(state, os.path.join(directory, PREFIX), global_step=3, storage=storage)
    reference = _full_tensors(state)
    if rank == 0:
        safetensors.torch.save_file(reference, os.path.join(directory, REFERENCE))
    return _created(storage), is_sharded(state)


def load_rank(rank: int, world_size: int, directory: str) -> tuple[int, int]:
    """Restore into other values and compare every full tensor with ``REFERENCE``.

    Returns the number of tensors compared and the manifest's step."""
    model, optimizer = _build(1, world_size)
    state = _state(model, optimizer, 0)
    manifest = load_sharded(state, os.path.join(directory, PREFIX))
    restored = _full_tensors(state)
    reference = safetensors.torch.load_file(os.path.join(directory, REFERENCE))
    assert sorted(restored) == sorted(reference), (sorted(restored), sorted(reference))
    for name, tensor in reference.items():
        assert torch.equal(restored[name], tensor), name
    assert state["global_step"] == 3 and state["extra"] == {"tag": "run-a", "blob": b"\x00\xff"}
    assert optimizer.param_groups[0]["lr"] == 0.01
    _train_step(model, optimizer, 3)  # The restored optimizer state works.
    return len(reference), manifest.global_step


def load_error_rank(rank: int, world_size: int, directory: str) -> tuple[str, str, str]:
    """Restore a damaged checkpoint: the error's type, the path it names, and ``own`` or
    ``copy`` (another rank's error, sent to this one)."""
    model, optimizer = _build(1, world_size)
    with pytest.raises(Exception) as caught:
        load_sharded(_state(model, optimizer, 0), os.path.join(directory, PREFIX))
    error = caught.value
    origin = "copy" if getattr(error, "__notes__", None) else "own"
    return type(error).__name__, str(getattr(error, "path", None)), origin


def save_fail_rank(
    rank: int, world_size: int, directory: str, operation: str, path_contains: str, on_rank: int
) -> tuple[str, str, list[str]]:
    """Save with ``operation`` on ``path_contains`` failing on rank ``on_rank`` (the error's
    type and message, and the files this rank created)."""
    model, optimizer = _build(0, world_size)
    _train_step(model, optimizer, 0)
    storage = FaultyStorage()
    code = errno.ENOSPC if operation == "write" else errno.EIO
    storage.fail(operation, path_contains=path_contains, errno=code, rank=on_rank)
    with pytest.raises(Exception) as caught:
        save_sharded(_state(model, optimizer, 3), os.path.join(directory, PREFIX), storage=storage)
    return type(caught.value).__name__, str(caught.value), _created(storage)


# ----------------------------------------------------------------------------- the tests


def _files(directory) -> set[str]:
    return {n for n in os.listdir(directory) if n.startswith(("model.ckpt", "checkpoint"))}


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory):
    """A checkpoint of an FSDP2 model + Adam state saved by 2 ranks, with its full values."""
    directory = tmp_path_factory.mktemp("sharded2")
    return directory, run_world(save_rank, str(directory))


def test_each_rank_writes_its_own_shard_and_the_coordinator_commits(saved_by_two):
    directory, results = saved_by_two
    (created0, sharded0), (created1, sharded1) = results
    assert created0 == [
        "model.ckpt-3.data-00000-of-00002",
        "model.ckpt-3.index",  # The coordinator writes the manifest last ...
        "checkpoint",  # ... then the state file.
    ]
    assert created1 == ["model.ckpt-3.data-00001-of-00002"]
    assert sharded0 and sharded1
    assert _files(directory) == {
        "model.ckpt-3.data-00000-of-00002",
        "model.ckpt-3.data-00001-of-00002",
        "model.ckpt-3.index",
        "checkpoint",
    }
    state = get_checkpoint_state(str(directory))
    assert state.model_checkpoint_path == str(directory / PREFIX)


def test_one_process_reads_the_whole_tensors_and_every_chunk_verifies(saved_by_two):
    directory, _ = saved_by_two
    reference = safetensors.torch.load_file(str(directory / REFERENCE))
    reader = CheckpointReader(str(directory / PREFIX))
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
    for compared, step in run_world(load_rank, str(directory), world_size=world_size):
        assert step == 3  # The step in the manifest.
        assert compared >= 10  # Parameters and Adam moments, all compared bitwise.


def test_saved_by_one_rank_restores_on_two(tmp_path):
    run_world(save_rank, str(tmp_path), world_size=1)
    assert _files(tmp_path) >= {"model.ckpt-3.data-00000-of-00001", "model.ckpt-3.index"}
    assert len(run_world(load_rank, str(tmp_path))) == 2


def _copy_checkpoint(source, target) -> None:
    for name in os.listdir(source):
        if name.startswith("model.ckpt") or name in ("checkpoint", REFERENCE):
            (target / name).write_bytes((source / name).read_bytes())


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
        CheckpointReader(str(tmp_path / PREFIX)).read_tensors()
    errors = run_world(load_error_rank, str(tmp_path))
    assert {kind for kind, _, _ in errors} == {"CorruptCheckpointError"}
    assert all(path == str(shard) for _, path, _ in errors), errors  # Names the file.
    # The rank that read the damaged chunk raises its own error; a rank that read only sound
    # chunks raises a copy of it (not a hang, not a partial load).
    origins = {origin for _, _, origin in errors}
    assert "own" in origins and origins <= {"own", "copy"}


def test_a_missing_shard_fails_the_restore_on_every_rank(saved_by_two, tmp_path):
    directory, _ = saved_by_two
    _copy_checkpoint(directory, tmp_path)
    os.remove(tmp_path / "model.ckpt-3.data-00000-of-00002")
    errors = run_world(load_error_rank, str(tmp_path))
    assert {kind for kind, _, _ in errors} == {"CorruptCheckpointError"}, errors


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_disk_full_on_one_rank_fails_the_save_everywhere_and_leaves_nothing(
    tmp_path, failing_rank
):
    results = run_world(save_fail_rank, str(tmp_path), "write", ".data-", failing_rank)
    for kind, message, _ in results:
        assert kind == "CheckpointSaveError", message
        # Every rank names the rank that failed and why.
        assert f"failed on rank {failing_rank}: [Errno 28] No space left" in message, message
    assert _files(tmp_path) == set()  # No shard, no temporary, no index, no state file.


def test_a_failed_manifest_write_commits_nothing(tmp_path):
    results = run_world(save_fail_rank, str(tmp_path), "open", ".index.tmp", 0)
    for kind, message, _ in results:
        assert kind == "CheckpointSaveError", message
        assert "Input/output error" in message and ".index" in message, message
    (_, _, created0), _ = results
    assert "checkpoint" not in created0  # The state file is never touched.
    assert _files(tmp_path) == set()


def deep_save_rank(rank: int, world_size: int, directory: str) -> list[tuple[str, str]]:
    """A good save, then saves of states nested too deep for any manifest reader: on rank 0
    a list that holds itself, on rank 1 dicts 65 deep (asynchronous, then synchronous, then
    on rank 1 alone); the error each save raised, then the newest checkpoint after all."""
    model, optimizer = _build(0, world_size)
    _train_step(model, optimizer, 0)
    state = _state(model, optimizer, 1)
    saver = Saver(state, max_to_keep=1)  # A committed bad save would delete the good one.
    prefix = os.path.join(directory, "model.ckpt")
    saver.save_async(None, prefix, global_step=1).result(120)
    deep: dict = {}
    node = deep
    for _ in range(MAX_STATE_DEPTH):
        node["a"] = {}
        node = node["a"]
    looped: list = []
    looped.append(looped)
    outcomes = []
    for step, bad in ((2, looped if rank == 0 else deep), (3, deep), (4, deep if rank else 0)):
        state["extra"] = {"bad": bad}
        try:
            if step == 2:
                saver.save_async(None, prefix, global_step=step).result(120)
            else:
                saver.save(None, prefix, global_step=step)
            outcomes.append(("saved", str(step)))
        except Exception as e:
            outcomes.append((type(e).__name__, str(e)))
    state["extra"] = {"bad": 0}
    saver.close()
    outcomes.append(("newest", os.path.basename(latest_checkpoint(directory) or "")))
    return outcomes


def test_a_state_nested_too_deep_fails_on_every_rank_and_keeps_the_older_checkpoint(tmp_path):
    """A sharded save of a state no manifest reader would take (a container holding itself,
    nesting deeper than ``MAX_STATE_DEPTH``) is refused on every rank before anything is
    written, as an unsharded save refuses it (it was committed, then found unreadable, and
    retention had deleted the good checkpoint before it)."""
    for outcomes in run_world(deep_save_rank, str(tmp_path)):
        *failed, newest = outcomes
        assert len(failed) == 3
        for kind, message in failed:
            assert kind == "ValueError" and "nests deeper than 64 levels" in message, failed
        assert newest == ("newest", "model.ckpt-1")
    assert _files(tmp_path) == {"checkpoint", "model.ckpt-1.index", *_shards("model.ckpt-1")}
    CheckpointReader(str(tmp_path / "model.ckpt-1")).verify()


def _shards(prefix: str, world_size: int = 2) -> set[str]:
    return {f"{prefix}.data-{i:05d}-of-{world_size:05d}" for i in range(world_size)}


class _Loader:
    """A stateful object whose ``state_dict`` raises on rank 1 (its worker died there)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        if self.rank == 1:
            raise RuntimeError("the loader's worker died")
        return {"position": 7}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = dict(state)


def restore_fails_on_one_rank_rank(rank: int, world_size: int, directory: str) -> tuple:
    """Restore while rank 1's loader cannot give its state: what each rank raised, and
    whether its live state was left as it was."""
    model, optimizer = _build(1, world_size)
    state = _state(model, optimizer, 0)
    before = _full_tensors(state)
    state["loader"] = _Loader(rank)
    try:
        load_sharded(state, os.path.join(directory, PREFIX), allow_missing=["loader"])
        outcome = "restored"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    state.pop("loader")
    after = _full_tensors(state)
    untouched = all(torch.equal(after[n], t) for n, t in before.items())
    return outcome, untouched and state["global_step"] == 0


def test_an_error_on_one_rank_before_a_restore_fails_it_on_every_rank(saved_by_two):
    """It was raised on that rank alone, and the other waited in the collective until the
    process group's timeout."""
    directory, _ = saved_by_two
    for outcome, untouched in run_world(
        restore_fails_on_one_rank_rank, str(directory), timeout_secs=60
    ):
        assert outcome.startswith("RuntimeError: the loader's worker died"), outcome
        assert untouched


def restore_unseen_rank(rank: int, world_size: int, directory: str) -> str:
    """``Saver.restore`` where rank 1 cannot find the checkpoint (a directory that is not
    shared, say): what each rank raised."""
    model, optimizer = _build(1, world_size)
    saver = Saver(_state(model, optimizer, 0))
    prefix = os.path.join(directory, PREFIX) if rank == 0 else os.path.join(directory, "gone")
    try:
        saver.restore(None, prefix)
    except ValueError as e:
        return str(e)
    return "restored"


def test_a_checkpoint_one_rank_cannot_find_fails_the_restore_on_every_rank(saved_by_two):
    """It was raised on that rank alone, and the other went on into the collective."""
    directory, _ = saved_by_two
    chief, other = run_world(restore_unseen_rank, str(directory), timeout_secs=60)
    assert chief.startswith("The passed save_path is not a valid checkpoint: ")
    assert chief.endswith("(another rank cannot find it)")
    assert other == f"The passed save_path is not a valid checkpoint: {directory / 'gone'}"


def reshard_rank(rank: int, world_size: int, source: str, target: str) -> tuple[int, int]:
    """Restore ``source`` (written by another world size), compare every full tensor with its
    ``REFERENCE``, then save the state again into ``target`` with the reference beside it.

    Returns the bytes this rank read and the bytes of the state it holds."""
    model, optimizer = _build(1, world_size)
    state = _state(model, optimizer, 0)
    storage = CountingStorage()
    load_sharded(state, os.path.join(source, PREFIX), storage=storage)
    held = held_bytes(state)
    restored = _full_tensors(state)
    reference = safetensors.torch.load_file(os.path.join(source, REFERENCE))
    assert sorted(restored) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(restored[name], tensor), name
    save_sharded(state, os.path.join(target, PREFIX), global_step=3)
    if rank == 0:
        safetensors.torch.save_file(reference, os.path.join(target, REFERENCE))
    return storage.bytes_read, held


def test_any_world_size_restores_any_other_bitwise_and_back(saved_by_two, tmp_path):
    # 2 -> 3 -> 4 -> 1 -> 2 ranks: layers of 10 and 3 rows, which 3 and 4 do not divide (4
    # ranks: a rank holds no row of the second layer); each restore bitwise the first state,
    # parameters and Adam moments, then saved again by that world size.
    source = str(saved_by_two[0])
    for n, world_size in enumerate((3, 4, 1, 2)):
        target = tmp_path / f"w{n}-{world_size}"
        target.mkdir()
        results = run_world(reshard_rank, source, str(target), world_size=world_size)
        assert len(results) == world_size
        assert all(read > 0 for read, _ in results if world_size == 1)
        reader = CheckpointReader(str(target / PREFIX))
        reader.verify()
        assert len(reader.manifest.shards) == world_size
        source = str(target)


def rng_save_rank(rank: int, world_size: int, directory: str) -> tuple[bytes, list[float]]:
    """Every rank's generators in another state (dropout draws differ by rank); a sharded
    save, then a restore of it: this rank's state at the save and its draws after."""
    from torchsupervisor.core.rng import RNGState

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)  # Rank 1 plans fewer bytes: DCP's default picked it.
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    torch.manual_seed(100 + rank)
    mine = bytes(torch.get_rng_state().numpy())
    state = {"model": model, "rng": RNGState()}
    prefix = os.path.join(directory, "rng.ckpt-1")
    save_sharded(state, prefix, global_step=1)
    torch.manual_seed(7)  # Moved on; the restore sets it back.
    load_sharded(state, prefix)
    return mine, torch.rand(3).tolist()


def test_a_state_every_rank_holds_is_written_by_the_coordinator_whole(tmp_path):
    """A tensor every rank holds (not a DTensor's shard) is written from the coordinator, as
    its non-tensor values are: the generator states in ``rng`` are rank 0's, all of them (DCP
    picked the least loaded rank: rank 1's torch state beside rank 0's Python state). After
    the restore rank 0 continues its own streams; rank 1 gets streams derived from them."""
    (mine0, draws0), (mine1, draws1) = run_world(rng_save_rank, str(tmp_path), world_size=2)
    reader = CheckpointReader(str(tmp_path / "rng.ckpt-1"))
    assert bytes(reader.get_tensor("rng/torch").numpy()) == mine0 != mine1
    torch.set_rng_state(torch.frombuffer(bytearray(mine0), dtype=torch.uint8))
    assert draws0 == torch.rand(3).tolist()
    assert draws1 != draws0


def test_a_planner_without_the_coordinator_option_is_made_as_before():
    """A torch whose ``DefaultSavePlanner`` lacks ``dedup_save_to_lowest_rank`` (older
    releases) still gets its planner, with DCP's own choice of rank."""
    from torchsupervisor.checkpoint.sharded.collective import _save_planner

    class OlderPlanner:
        def __init__(self, flatten_state_dict: bool, flatten_sharded_tensors: bool) -> None:
            self.options = (flatten_state_dict, flatten_sharded_tensors)

    assert _save_planner(OlderPlanner).options == (False, False)
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    assert _save_planner(DefaultSavePlanner).dedup_save_to_lowest_rank is True
