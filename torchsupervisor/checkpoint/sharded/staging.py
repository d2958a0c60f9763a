"""The training thread's part of a sharded save: what to write, and (asynchronous) a host copy.

A sharded save has two halves. ``prepare`` runs on the training thread at the step boundary:
it flattens the state into its skeleton and its tensors (DTensors as they are), encodes the
skeleton for the manifest and reads the step. The other half, ``collective.write_sharded``
(DCP's planning, every rank's shard, the coordinator's commit), may run on the same thread
(``Saver.save``) or on the background writer thread (``Saver.save_async``).

In the second case the live tensors keep changing while the shards are written, so ``stage``
first copies this rank's *local* data (a DTensor's local shard, a plain tensor whole) into
reusable host staging buffers and replaces each tensor with one over its copy (a DTensor keeps
its mesh, placements, global shape and stride, so DCP plans it exactly as the live one). That
copy is the whole stall of an asynchronous sharded save. The copies are laid out as the rank's
shard most likely will be (``in_place.py``), so that the writer puts the shard from them
without copying the bytes again.

Thread safety: ``prepare`` and ``stage`` on the training thread; ``ShardedSave.release`` on any.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from torchsupervisor.checkpoint.snapshot import Snapshot, Stager
from torchsupervisor.core.global_step import read_checkpoint_step
from torchsupervisor.core.state import dtensor_class
from torchsupervisor.core.walk import WalkMemo, walk_state

if TYPE_CHECKING:
    from torchsupervisor.core.global_step import GlobalStepLike

__all__ = ["ShardedSave", "StageMemo", "failed", "prepare", "stage"]


@dataclasses.dataclass(eq=False)
class ShardedSave:
    """One sharded save as the training thread leaves it for the writer.

    Attributes:
        prefix: The checkpoint prefix.
        tensors: The flat tensor table (``{name: Tensor or DTensor}``): the live tensors, or
            after ``stage`` tensors over host copies of this rank's local data.
        skeleton: The state's skeleton (``TensorRef`` leaves; None when ``error`` is set):
            containers of its own and immutable leaves, so the writer may encode it for the
            manifest after training has changed the state.
        step: The global step recorded in the manifest, or None.
        wall_time: The time of the snapshot, in seconds since the epoch.
        error: What went wrong on this rank before the collective (a ``TypeError`` or
            ``ValueError`` for its state, whatever a ``state_dict`` raised, ...): raised by
            the writer inside the collective, so that every rank learns of it.
        sequence: How many sharded saves this rank's saver began before this one: the
            ranks agree on it, with the checkpoint's name and step, before anything is
            written (``collective.write_sharded``).
        local: Each tensor's local data by name (``prepare`` with ``keep_vars``), for
            ``stage``; None once staged.
    """

    prefix: str
    tensors: dict[str, torch.Tensor]
    skeleton: Any
    step: int | None
    wall_time: float
    error: BaseException | None = None
    sequence: int = 0
    local: dict[str, torch.Tensor] | None = None
    _snapshot: Snapshot | None = None
    _stager: Stager | None = None

    @property
    def snapshot(self) -> Snapshot | None:
        """The host copies ``stage`` made (laid out for ``ShardedStorageWriter``), or None."""
        return self._snapshot

    def release(self) -> None:
        """Give the host staging buffers back for the next save (once it is written)."""
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is not None and self._stager is not None:
            self._stager.release(snapshot)
        self.tensors, self.local = {}, None


def prepare(
    state: Mapping[str, Any],
    prefix: str,
    *,
    global_step: GlobalStepLike,
    wall_time: float,
    keep_vars: bool = False,
    memo: WalkMemo | None = None,
) -> ShardedSave:
    """Flatten ``state`` and read its step (the training thread, at the step boundary).

    What goes wrong is not raised here but kept in ``error``: a state this rank cannot save,
    a ``state_dict`` that raises (only on this rank, say). Every rank must still enter the
    collective, which then fails on every rank with that error: a rank that raised alone
    would leave the others waiting in the collective, then meet their next save with its own.
    ``keep_vars``: the live parameters are kept undetached (``walk_state``), for
    a save that ``stage`` copies at once; a save written from the live tensors needs them
    detached. ``memo``: the walk's memo, kept between saves (with ``keep_vars``).
    """
    local: dict[str, torch.Tensor] | None = {} if keep_vars else None
    try:
        step = read_checkpoint_step(global_step)
        skeleton, tensors = walk_state(state, keep_vars=keep_vars, local=local, memo=memo)
    except Exception as e:
        return failed(prefix, e, wall_time)
    return ShardedSave(prefix, tensors, skeleton, step, wall_time, local=local)


def failed(prefix: str, error: Exception, wall_time: float = 0.0) -> ShardedSave:
    """A save that carries ``error`` into the collective (which raises it on every rank)."""
    return ShardedSave(prefix, {}, None, None, wall_time, error=error)


@dataclasses.dataclass(eq=False, slots=True)
class _Staged:
    """One ``stage``'s table over the staging buffers, with what it was made from."""

    names: list[str]
    live: list[Any]  # The tensors staged, in order, the DTensors among them and their specs.
    dtensors: list[Any]
    specs: list[Any]
    plain: list[str]  # The names of the other tensors.
    shards: tuple[Any, ...]  # The DTensors' names, local dtypes and shapes.
    layout: tuple[list[str], int]  # ``_in_place_layout``'s answer.
    views: dict[str, torch.Tensor]  # The staging buffers' tensors (the Stager's, reused).
    staged: dict[str, Any]


class StageMemo:
    """What ``stage`` made at the last save, for the next one (kept by the caller).

    The DTensors built over the staging buffers are kept by name and reused while a buffer
    holds the same mesh, placements, shape and stride (building one costs about 17 us, per
    tensor and save). When a save stages the very same tensors (DTensors with the very
    same specs) into the same buffers as the last one, its whole table is taken at once:
    the in-place layout and the DTensors over the copies are the last save's (0.9 ms of
    the stall for 1,008 tensors). Only the bytes are copied again, from each tensor's local
    data as it is now. The DTensors' local dtypes and shapes are then not read again (1 us
    a tensor after a training step): the spec gives them (its mesh, placements, global
    shape and dtype; a DTensor's local tensor is of the shape its spec makes this rank's).
    Holds the last save's tensors until the next.

    Thread safety: the training thread.
    """

    def __init__(self) -> None:
        self.wrapped: dict[str, tuple[Any, ...]] = {}
        self.last: _Staged | None = None


def stage(
    save: ShardedSave, stager: Stager, memo: StageMemo | None = None, *, wait: bool = True
) -> None:
    """Copy this rank's local data into ``stager``'s host buffers; point ``save`` at the copies.

    The training step after it may change every tensor: host copies are done when it returns,
    and device-to-host copies are done (``wait``) or queued on the streams that later work
    waits behind (``Stager.stage``). Call ``save.release()`` once the save is written.
    What fails here (a dtype the format cannot hold, ``complex128``; buffers that cannot be
    allocated) is kept in ``save.error``, as ``prepare`` does, for the collective to raise
    on every rank; the buffers are given back.

    Args:
        save: From ``prepare``.
        stager: The host staging buffers (reused while the local shards keep their layout).
        memo: What the last ``stage`` with this ``stager`` made (``StageMemo``), kept by the
            caller between saves; updated. None: nothing is reused.
        wait: Return once the CUDA copies are done. False: once they are queued; whoever
            reads the buffers calls ``save.snapshot.wait_copied()`` first.
    """
    if save.error is not None or not save.tensors:
        return
    try:
        _stage(save, stager, StageMemo() if memo is None else memo, wait)
    except Exception as e:  # Raised inside the collective, so that every rank learns of it.
        if memo is not None:
            memo.last = None
        save.release()
        save.error = e


_spec_of = operator.attrgetter("_spec")


def _stage(save: ShardedSave, stager: Stager, memo: StageMemo, wait: bool) -> None:
    dtensor = dtensor_class()
    local, save.local = save.local, None
    if local is None:
        with torch.no_grad():  # ``to_local`` without an autograd node: 1 us a tensor, not 11.
            local = {
                name: t.to_local() if dtensor is not None and isinstance(t, dtensor) else t
                for name, t in save.tensors.items()
            }
    names, live = list(save.tensors), list(save.tensors.values())
    last = memo.last
    same = (  # The very same tensors as the last save's, each pass in C.
        last is not None
        and names == last.names
        and all(map(operator.is_, live, last.live))
        and all(map(operator.is_, map(_spec_of, last.dtensors), last.specs))
    )
    memo.last = None  # Until this save is staged.
    if same:
        layout, plain, shards = last.layout, last.plain, last.shards  # type: ignore[union-attr]
    else:
        layout = _in_place_layout(dtensor, save.tensors)
        is_d = [dtensor is not None and isinstance(t, dtensor) for t in live]
        plain = [n for n, d in zip(names, is_d) if not d]
        shards = tuple((n, local[n].dtype, local[n].shape) for n, d in zip(names, is_d) if d)
    layout_key = (shards, tuple((n, local[n].dtype, local[n].shape) for n in plain))
    with torch.no_grad():  # The live parameters are kept as they are (``keep_vars``).
        snapshot = stager.stage(
            None,
            local,
            step=save.step,
            wall_time=save.wall_time,
            tail=layout[0],
            header_spare=layout[1],
            keep_sources=False,  # No incremental saves of sharded states.
            layout_key=layout_key,
            wait=wait,
        )
    save._snapshot, save._stager = snapshot, stager
    if same and snapshot.views is last.views:  # type: ignore[union-attr]
        save.tensors = dict(last.staged)  # type: ignore[union-attr]
        memo.last = last
        return
    staged = _wrap(dtensor, save.tensors, snapshot.tensors(), memo.wrapped)
    save.tensors = dict(staged)
    dtensors = [t for t in live if dtensor is not None and isinstance(t, dtensor)]
    specs = [getattr(t, "_spec", None) for t in dtensors]
    if all(spec is not None for spec in specs):  # Else no whole table is reused.
        memo.last = _Staged(
            names, live, dtensors, specs, plain, shards, layout, snapshot.views, staged
        )


def _wrap(
    dtensor: torch.Tensor,
    tensors: Mapping[str, Any],
    copies: Mapping[str, torch.Tensor],
    cache: dict[str, tuple[Any, ...]],
) -> dict[str, Any]:
    """The staged table: each DTensor of ``tensors`` as one over its copy, the others their
    copies; DTensors built at an earlier save are reused from ``cache`` (updated)."""
    staged: dict[str, Any] = {}
    for name, t in tensors.items():
        copy = copies[name]
        if dtensor is not None and isinstance(t, dtensor):
            key = _wrap_key(copy, t)
            known = cache.get(name)
            if known is not None and known[0] == key:
                copy = known[1]
            else:
                copy = _over(dtensor, copy, t)
                cache[name] = (key, copy, t.device_mesh)  # The mesh: its id stays its own.
        staged[name] = copy
    for name in [n for n in cache if n not in staged]:
        del cache[name]  # It would keep an old staging buffer alive.
    return staged


def _in_place_layout(dtensor: torch.Tensor, tensors: Mapping[str, Any]) -> tuple[list[str], int]:
    """The staging layout that lets the writer put the shard from the staging buffer itself.

    Each rank writes all of its sharded DTensors' local data, but a replicated tensor (a
    plain tensor, a replicated DTensor) only on the rank DCP picks: those go to the layout's
    tail (the writer copies the ones it writes after the others). The header keeps room
    for the chunk names, ``name[o0:e0,...]``, that replace the state's names in the shard.

    Returns:
        ``(tail, header_spare)`` for ``Stager.stage``.
    """
    tail: list[str] = []
    spare = 64
    room: dict[tuple[Any, Any], int] = {}  # (placements, shape) -> header room; 0: the tail.
    for name, t in tensors.items():
        if dtensor is None or not isinstance(t, dtensor):
            tail.append(name)
            continue
        # The spec's fields (attribute reads) rather than ``placements`` and ``shape`` (a
        # property and a new ``torch.Size``): 0.27 ms a save for 1,000 tensors.
        spec = getattr(t, "_spec", None)
        meta = getattr(spec, "tensor_meta", None)
        key = (spec.placements, meta.shape) if meta is not None else (t.placements, t.shape)
        extra = room.get(key)
        if extra is None:
            # "[" + "o:e" per dimension, each as long as the dimension at most, "," + "]".
            sharded = any(p.is_shard() for p in key[0])
            extra = room[key] = 2 + sum(2 * len(str(n)) + 2 for n in key[1]) if sharded else 0
        if extra:
            spare += extra
        else:
            tail.append(name)
    return tail, spare


def _wrap_key(copy: torch.Tensor, live: object) -> tuple[Any, ...]:
    """What a DTensor over ``copy`` like ``live`` depends on: the buffer, the mesh (by id),
    the placements, the global shape and stride (and dtype)."""
    spec = getattr(live, "_spec", None)  # Three attribute reads, not five dispatched ones.
    if spec is not None and getattr(spec, "tensor_meta", None) is not None:
        return (copy.data_ptr(), id(spec.mesh), spec.placements, spec.tensor_meta)
    return (
        copy.data_ptr(),
        id(live.device_mesh),
        tuple(live.placements),
        live.shape,
        live.stride(),
    )


def _over(dtensor: torch.Tensor, local: torch.Tensor, live: object) -> Any:
    """A DTensor like ``live`` (mesh, placements, global shape and stride) over ``local``.

    ``DTensor.from_local`` would move a host copy back to the mesh's device (a GPU), so the
    DTensor is built from ``live``'s spec, as DCP builds its own staged copies; on a torch
    whose DTensor takes other arguments, ``from_local`` does for a CPU mesh.
    """
    try:
        return dtensor(local, live._spec, requires_grad=False)
    except (AttributeError, TypeError):
        if live.device_mesh.device_type != local.device.type:
            raise
        return dtensor.from_local(
            local,
            live.device_mesh,
            live.placements,
            run_check=False,
            shape=live.shape,
            stride=live.stride(),
        )
