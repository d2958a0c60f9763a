"""Sharded checkpoints: every rank writes its own part of the state, in parallel.

A model sharded between ranks (FSDP2's ``fully_shard``, or any state holding ``DTensor`` s)
cannot be checkpointed by one rank without first gathering the whole state to it. Instead,
``save_sharded`` is called by every rank of the process group at the same step:

1. each rank collects its state (``state_dict()`` of each entry: DTensors for FSDP2 models);
2. ``torch.distributed.checkpoint`` plans the save: which rank writes which chunk (a DTensor's
   local shard; a tensor every rank holds once, by the coordinator);
3. every rank copies its chunks into a host buffer and writes its own safetensors shard
   ``P.data-<i>-of-<N>`` with per-chunk CRC-32C, under the commit protocol (temporary name,
   fsync, rename, fsync of the directory);
4. once every rank has succeeded, the coordinator (rank 0 of the group) writes ``P.index``
   last (the commit point: the manifest of ``format.py`` with the chunk layout of
   ``sharded_metadata.py``; non-tensor values come from the coordinator's state), then the
   ``checkpoint`` state file.

A failure on any rank (disk full, a value that cannot be saved without pickle) reaches every
rank as an error; nothing is committed and each rank removes its temporary and shard files.

``load_sharded`` (again on every rank) reads the manifest, lets DCP plan which chunks each rank
needs for its local shards, reads only those, verifies each chunk's CRC-32C, and loads the
values into the live objects. The world size may differ from the one that saved (resharding):
a checkpoint of 2 ranks restores on 1 or 4, and one written by ``Saver`` (every tensor whole)
restores into a sharded model. A corrupt chunk raises ``CorruptCheckpointError`` naming the
file on every rank (the rank that found it, and the others with a copy of its error).

``CheckpointReader`` reads such a checkpoint in one process, without a process group
(inspection, conversion to an unsharded model), assembling each tensor from its chunks.
Nothing is ever pickled to disk.

TF name: none; TF 1 wrote sharded checkpoints from the parameter servers
(``Saver(sharded=True)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import warnings
from collections.abc import Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from torchsupervisor.checkpoint import commit
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.checkpoint.sharded.metadata import ShardedManifest
from torchsupervisor.checkpoint.sharded.plan import rename_positions
from torchsupervisor.checkpoint.sharded.replay import PlanCache
from torchsupervisor.checkpoint.sharded.staging import ShardedSave, prepare
from torchsupervisor.checkpoint.sharded.targets import load_targets
from torchsupervisor.checkpoint.snapshot import Stager
from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.state_load import find_subtree, load_state
from torchsupervisor.core.tree import decode_tree
from torchsupervisor.distributed.env import communication_device
from torchsupervisor.errors import (
    CheckpointError,
    CheckpointSaveError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NotFoundError,
    UnknownError,
)
from torchsupervisor.storage import Storage, storage_for

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from torchsupervisor.core.global_step import GlobalStepLike

__all__ = ["load_sharded", "save_sharded", "write_sharded"]

logger = logging.getLogger("torchsupervisor")


# --------------------------------------------------------------------------- save / load


def _group(process_group: ProcessGroup | None, no_dist: bool) -> dict[str, Any]:
    """DCP's arguments naming the process group of a save or load."""
    return {"process_group": process_group, "no_dist": no_dist}


@contextlib.contextmanager
def _dcp_call(process_group: ProcessGroup | None) -> Iterator[bool]:
    """Yield DCP's ``no_dist`` (no process group initialized), silencing its warning then."""
    dist = torch.distributed
    no_dist = not (dist.is_available() and dist.is_initialized())
    if process_group is not None and no_dist:
        raise ValueError("process_group was given but torch.distributed is not initialized")
    if not no_dist:
        yield False
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield True


def _agreed_error(error: BaseException, own: BaseException | None) -> BaseException:
    """The error to raise on this rank for a failed DCP step (``CheckpointException``).

    This rank's own exception if it failed; else a copy of the exception of the lowest
    failing rank, with the DCP error (every rank's traceback) as its cause.
    """
    if own is not None:
        return own
    failures = getattr(error, "failures", {}) or {}
    if not failures:
        return CheckpointError(f"A checkpoint step failed on another rank: {error}")
    rank = min(failures)
    exc = failures[rank][0]
    if not isinstance(exc, Exception):
        exc = UnknownError(f"Rank {rank} failed: {exc!r}")
    exc.add_note(f"(raised on rank {rank} of the process group)")
    exc.__cause__ = error
    return exc


def save_sharded(
    state: Mapping[str, Any],
    prefix: str,
    *,
    global_step: GlobalStepLike | None = None,
    process_group: ProcessGroup | None = None,
    write_state: bool = True,
    latest_filename: str | None = None,
    storage: Storage | None = None,
    clock: Clock | None = None,
    stager: Stager | None = None,
) -> ShardedManifest:
    """Save the state as checkpoint ``prefix``, every rank writing its own shard in parallel.

    Call it on every rank of the process group with the same prefix and a state of the same
    structure. Without an initialized process group it saves the state of this process alone
    (one shard).

    Args:
        state: Mapping of names to stateful objects: an FSDP2 model (its state dict holds
            DTensors), a ``ShardedOptimizerState``, tensors, values, ... Non-tensor values
            are taken from the coordinator's state.
        prefix: The checkpoint prefix, e.g. ``logdir/model.ckpt-100``; its directory must
            exist and be shared by all ranks.
        global_step: Recorded in the manifest (int, ``GlobalStep`` or integer tensor); None:
            no step.
        process_group: The group of the ranks that save; None: the default group.
        write_state: After the commit, make the coordinator record ``prefix`` as the newest
            checkpoint in the state file (appended to its list; deleting old checkpoints is
            left to the caller, e.g. a ``Saver``).
        latest_filename: The state file's name; None means ``"checkpoint"``.
        storage: Where the checkpoint goes (tests inject faults here); None: chosen by the
            prefix.
        clock: Time source of the manifest's wall time; None: the real clock.
        stager: Staging buffers to reuse between saves of the same state; None: new ones.

    Returns:
        The committed manifest (on every rank).

    Raises:
        TypeError: For a value that cannot be saved without pickle (on every rank; nothing
            is written).
        ValueError: For a missing directory, a negative ``global_step`` or a tensor that
            cannot be saved (ditto).
        CheckpointSaveError: If writing fails on any rank (disk full, permission denied):
            raised on every rank; nothing is committed and every rank has removed its files.
            Also when the checkpoint was committed but the state file could not be updated,
            and when the ranks are at different saves (another prefix or step on some
            rank): nothing is written.
        Exception: Whatever a ``state_dict`` of the state raised on any rank, on every rank
            (nothing is written).

    Thread safety: call from one thread per rank (the training thread).
    Distributed: a collective; every rank of ``process_group`` must call it.

    TF name: none (``Saver(sharded=True).save`` for TF's parameter servers).
    """
    save = prepare(state, prefix, global_step=global_step, wall_time=(clock or REAL_CLOCK).time())
    committed = write_sharded(
        save,
        process_group=process_group,
        write_state=write_state,
        latest_filename=latest_filename,
        storage=storage,
        stager=stager,
    )
    return ShardedManifest.from_bytes(committed)


def write_sharded(
    save: ShardedSave,
    *,
    process_group: ProcessGroup | None = None,
    write_state: bool = True,
    latest_filename: str | None = None,
    storage: Storage | None = None,
    stager: Stager | None = None,
    plans: PlanCache | None = None,
) -> bytes:
    """Write and commit a prepared sharded save (``staging.prepare``): the collective half.

    Runs on the training thread (``save_sharded``) or on the writer thread for a save whose
    local data was staged (``staging.stage``); every rank of ``process_group`` calls it for
    the same save. Arguments and errors are ``save_sharded``'s; ``save.error`` is raised on
    every rank. ``plans``: the plan of the previous save of the same state, replayed if no
    rank's layout changed (``replay.PlanCache``; every rank passes one, or none does).

    Returns:
        The bytes of the committed ``P.index`` (on every rank; ``ShardedManifest.from_bytes``
        parses them, which a background save has no use for).

    Distributed: a collective of ``process_group``. A background save must use a group that
    the training thread does not use at the same time (``Saver`` makes one).
    """
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from torchsupervisor.checkpoint.sharded.writer import ShardedStorageWriter

    prefix = save.prefix
    storage = storage_for(prefix, storage)
    writer = ShardedStorageWriter(
        prefix,
        skeleton=save.skeleton,
        global_step=save.step,
        wall_time=save.wall_time,
        write_state=write_state,
        latest_filename=latest_filename,
        storage=storage,
        stager=stager,
        staged=save.snapshot,
        error=save.error,
        tensor_names=save.tensors.keys(),
    )
    planner = _save_planner(DefaultSavePlanner)
    failure: BaseException | None = None
    outcome = None
    agreed = None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        agreed = _agree_on_the_save(save, process_group, plans, storage)
    try:
        with _dcp_call(process_group) as no_dist:
            if plans is not None and agreed is not None and agreed.replay and not no_dist:
                outcome = plans.replay(save, writer, process_group, retire=agreed.older)
            if outcome is None:
                metadata = dcp_save(
                    save.tensors,
                    storage_writer=writer,
                    planner=planner,
                    **_group(process_group, no_dist),
                )
                outcome = metadata.storage_data
                if plans is not None:
                    plans.remember(save, writer, process_group)
    except CheckpointException as e:
        failure = _agreed_error(e, writer.error)
    except BaseException:
        # A collective failed (a rank died, a timeout). Only the coordinator knows whether it
        # committed; the other ranks leave their shard to the clean-up at the next start.
        if plans is not None:
            plans.forget()
        if writer.is_coordinator and not writer.committed:
            writer.roll_back()
        else:
            logger.warning("Sharded save of %s was interrupted; files left to clean up", prefix)
        raise
    if failure is not None:
        if plans is not None:
            plans.forget()
        writer.roll_back()
        raise failure
    if outcome.state_file_error is not None:
        raise CheckpointSaveError(
            f"Checkpoint {prefix} was committed but the state file could not be updated (a "
            f"restart still finds it by scanning the directory): {outcome.state_file_error}",
            path=prefix,
        )
    return outcome.manifest


def _save_planner(planner_class: Any) -> Any:
    """DCP's planner, a tensor that every rank holds (not a DTensor's shard) written by the
    coordinator, as the non-tensor values are: DCP's default, the least loaded rank, mixed
    ranks within one entry (the torch generator state of rank 1 beside rank 0's Python and
    NumPy states in ``rng``: the chief then continued another rank's stream). A torch whose
    planner lacks the option (older releases): the least loaded rank, as before."""
    options = {"flatten_state_dict": False, "flatten_sharded_tensors": False}
    try:
        return planner_class(**options, dedup_save_to_lowest_rank=True)
    except TypeError:
        return planner_class(**options)


@dataclasses.dataclass(frozen=True)
class _Agreed:
    """What the ranks agreed on before a save: whether it replays the kept plan (every rank
    can), and whether the checkpoint's prefix holds files of an older save (the coordinator
    found some: it retires them before any rank writes)."""

    replay: bool
    older: bool


def _agree_on_the_save(
    save: ShardedSave, process_group: ProcessGroup | None, plans: PlanCache | None, storage: Storage
) -> _Agreed:
    """Check, before anything is written, that every rank is at the same save; and agree
    whether it replays the kept plan (``plans``).

    One all-reduce compares a hash of the checkpoint's file name, its step and the count of
    sharded saves this rank's saver began (``ShardedSave.sequence``). Ranks at different saves
    (a save called on some ranks only) would otherwise write one checkpoint from two steps'
    states, and every later save likewise. A rank that carries an error skips the comparison:
    the save then fails on every rank with that error. The same all-reduce carries whether
    each rank can replay its kept plan (``PlanCache.fits``) and whether the coordinator found
    an older save's files under the prefix (a second collective each, before).

    Raises:
        CheckpointSaveError: On every rank, if the ranks are at different saves.
    """
    import torch.distributed as dist

    name = f"{os.path.basename(save.prefix)}\0{save.step}\0{save.sequence}"
    key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "little")
    try:
        fits = plans is not None and plans.fits(save, process_group)
    except Exception:  # Raised here, it would leave the other ranks in the all-reduce;
        fits = False  # DCP plans the save instead, and reports what fails to every rank.
    older = fits and dist.get_rank(process_group) == 0 and _older_files(save.prefix, storage)
    device = communication_device(dist.get_backend(process_group))  # CUDA for NCCL.
    agreed = torch.tensor(
        [key, -key, save.error is not None, not fits, older], dtype=torch.int64, device=device
    )
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=process_group)
    highest, lowest, errors, unfit, older = agreed.tolist()
    if not errors and highest != -lowest:
        raise CheckpointSaveError(
            f"Sharded save of {save.prefix} failed on every rank before anything was written: "
            f"the ranks are at different saves (this rank, {dist.get_rank()}, at "
            f"{os.path.basename(save.prefix)}, step {save.step}, its saver's save "
            f"#{save.sequence + 1}). Every rank must save the same checkpoint at the same step; "
            "a save called on some ranks only leaves them at different saves from then on",
            path=save.prefix,
        )
    return _Agreed(replay=not errors and not unfit, older=bool(older))


def _older_files(prefix: str, storage: Storage) -> bool:
    """Whether ``prefix`` holds an index or data files (an older save's); True when that
    cannot be told (the retirement, which reports its errors to every rank, then finds out)."""
    try:
        return commit.needs_retirement(storage, prefix)
    except Exception:
        return True


def load_sharded(
    state: Mapping[str, Any],
    prefix: str,
    *,
    process_group: ProcessGroup | None = None,
    allow_missing: Collection[str] = (),
    storage: Storage | None = None,
) -> ShardedManifest:
    """Restore the state from checkpoint ``prefix``, each rank reading only what it needs.

    Call it on every rank of the process group. Any world size can restore any checkpoint
    of this format: one written by ``save_sharded`` with another number of ranks (the
    chunks are resharded), or by ``Saver``. Every chunk read is verified against its
    CRC-32C; values are loaded into the live objects only after every rank has read its
    part without error. Without an initialized process group it restores this process.

    Args:
        state: Mapping of names to stateful objects, as given to ``save_sharded``. An entry
            name may be a ``/`` path into the checkpoint (see ``state.find_subtree``).
        prefix: The checkpoint prefix.
        process_group: The group of the ranks that restore; None: the default group.
        allow_missing: Names of state entries that the checkpoint may lack (they keep their
            value, with a warning).
        storage: Where the checkpoint lives; None: chosen by the prefix.

    Returns:
        The checkpoint's manifest (its ``global_step``, ...).

    Raises:
        NotFoundError: If ``prefix.index`` does not exist, or an entry of the state is not in
            the checkpoint (raised on every rank).
        CorruptCheckpointError: If the manifest or a chunk is damaged, naming the file (on
            every rank); the live state is then unchanged.
        InvalidArgumentError: If a value does not fit its object (another shape, a module's
            missing keys).

    Thread safety: call from one thread per rank.
    Distributed: a collective; every rank of ``process_group`` must call it.

    TF name: none (``Saver.restore`` of a sharded TF checkpoint).
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from torchsupervisor.checkpoint.sharded.reader import ShardedStorageReader

    storage = storage_for(prefix, storage)
    found: BaseException | None = None
    manifest: ShardedManifest | None = None
    targets: dict[str, torch.Tensor] = {}
    renames: dict[str, dict[int, str]] = {}
    try:
        manifest = _read_manifest(prefix, storage)
        targets, renames = load_targets(state, manifest, prefix)
    except Exception as e:  # Raised in the collective, on every rank (not here alone).
        found, targets = e, {}
    reader = ShardedStorageReader(prefix, manifest, storage=storage, error=found)
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    failure: BaseException | None = None
    try:
        with _dcp_call(process_group) as no_dist:
            dcp_load(
                targets, storage_reader=reader, planner=planner, **_group(process_group, no_dist)
            )
    except CheckpointException as e:
        failure = _agreed_error(e, reader.error)
    if failure is not None:
        raise failure
    assert manifest is not None
    error: BaseException | None = None
    try:
        _load_into(state, manifest, targets, renames, prefix, allow_missing, process_group)
    except Exception as e:
        error = e
    _agree(error, process_group, no_dist)
    return manifest


def _load_into(
    state: Mapping[str, Any],
    manifest: ShardedManifest,
    targets: dict[str, torch.Tensor],
    renames: dict[str, dict[int, str]],
    prefix: str,
    allow_missing: Collection[str],
    process_group: ProcessGroup | None,
) -> None:
    def leaf(name: str, ndarray: bool) -> Any:
        tensor = targets.get(name)
        if tensor is not None and ndarray:
            return tensor.numpy()
        return tensor  # None for the tensors of entries that are not restored.

    tree = decode_tree(manifest.tree, leaf)
    if renames:  # An entry's own name is found first (``find_subtree``).
        tree = {**tree, **{n: rename_positions(find_subtree(tree, n), renames[n]) for n in renames}}
    world_size = _world_size(process_group)
    if manifest.world_size != world_size:
        logger.info(
            "Resharding checkpoint %s written by %d ranks onto %d",
            prefix,
            manifest.world_size,
            world_size,
        )

    def missing(name: str) -> None:
        if name not in allow_missing:
            raise NotFoundError(f"Key {name} not found in checkpoint {prefix}")
        logger.warning("Checkpoint %s has no %r entry; it keeps its current value", prefix, name)

    load_state(state, tree, source=prefix, on_missing=missing)


def _world_size(process_group: ProcessGroup | None) -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(process_group)
    return 1


_REBUILD: dict[str, Any] = {
    "CorruptCheckpointError": lambda m, p, r: CorruptCheckpointError(m, path=p, reason=r),
    "CheckpointSaveError": lambda m, p, r: CheckpointSaveError(m, path=p),
    "NotFoundError": lambda m, p, r: NotFoundError(m),
    "InvalidArgumentError": lambda m, p, r: InvalidArgumentError(m),
    "TypeError": lambda m, p, r: TypeError(m),
    "ValueError": lambda m, p, r: ValueError(m),
}


def _agree(error: BaseException | None, process_group: ProcessGroup | None, no_dist: bool) -> None:
    """Raise on every rank if any rank failed: its own error, or a copy of the first one."""
    if no_dist:
        if error is not None:
            raise error
        return
    summary = None
    if error is not None:
        summary = (
            type(error).__name__,
            str(error),
            getattr(error, "path", None),
            getattr(error, "reason", ""),
        )
    gathered: list[Any] = [None] * torch.distributed.get_world_size(process_group)
    torch.distributed.all_gather_object(gathered, summary, group=process_group)
    if error is not None:
        raise error
    for rank, item in enumerate(gathered):
        if item is not None:
            kind, message, path, reason = item
            build = _REBUILD.get(kind)
            copy = build(message, path, reason) if build else UnknownError(f"{kind}: {message}")
            copy.add_note(f"(raised on rank {rank} of the process group)")
            raise copy


def _read_manifest(prefix: str, storage: Storage) -> ShardedManifest:
    reader = CheckpointReader(prefix, storage=storage)
    manifest = reader.manifest
    if isinstance(manifest, ShardedManifest):
        return manifest
    fields = {f.name: getattr(manifest, f.name) for f in dataclasses.fields(manifest)}
    return ShardedManifest(**fields)
