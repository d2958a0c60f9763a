"""Sharded saves that replay the previous save's plan while no rank's layout has changed.

DCP plans every save from scratch: each rank builds its write items, the coordinator gathers
the pickled plans, removes the duplicates, builds the global metadata and scatters the plans
back, every step wrapped in DCP's logging. On 2 ranks at 50 MB that is 2.5 to 5 ms of CPU per
rank and save, plus DCP's broadcast of the whole metadata after the commit: time a
background save takes from training on a machine without a spare core.

A plan depends only on what the ranks save: the tensors' names, dtypes and shapes, and each
DTensor's mesh and placements (its local chunk follows from them). ``PlanCache`` keeps the
plan of the last save that committed, with the layout it was made for. At the next save every
rank compares its layout with the kept one and the ranks agree: if no rank's layout changed,
the save replays the plan (each rank writes the same chunks under the same names into the
same shard file; the coordinator builds the manifest from the kept metadata). Otherwise DCP
plans again, and a failed save forgets the plan. The files are the same either way.

The ranks agree in an all-reduce of one number; the coordinator then retires an older index
of the same prefix (only once every rank will write, and before any rank puts its shard) and
broadcasts whether it could. The write-and-commit step is DCP's own exception-safe collective
(a gather of every rank's results or error, the commit, a broadcast of its outcome), so a
failure on any rank still reaches every rank and commits nothing.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchsupervisor.checkpoint.sharded.in_place import ShardMemo
from torchsupervisor.checkpoint.sharded.packed import SentRows, TableMemo
from torchsupervisor.checkpoint.sharded.staging import ShardedSave
from torchsupervisor.checkpoint.tree_memo import TreeMemo
from torchsupervisor.core.same_objects import Contents, contents, same_contents
from torchsupervisor.core.state import dtensor_class
from torchsupervisor.distributed.env import communication_device

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["PlanCache", "layout_of"]


def layout_of(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[Any, ...], list[Any]]:
    """What a rank's part of a DCP save plan is made from, and the objects it names by id.

    Returns:
        ``(layout, held)``: per tensor, in order, its name, dtype and shape, and for a
        DTensor its placements and the id of its mesh; ``held``: the meshes (kept alive
        with the layout, so that their ids stay theirs).
    """
    dtensor = dtensor_class()
    layout: list[tuple[Any, ...]] = []
    held: list[Any] = []
    for name, tensor in tensors.items():
        entry: tuple[Any, ...] = (name, tensor.dtype, tuple(tensor.shape))
        if dtensor is not None and isinstance(tensor, dtensor):
            mesh = tensor.device_mesh
            entry += (tuple(tensor.placements), id(mesh))
            held.append(mesh)
        layout.append(entry)
    return tuple(layout), held


@dataclass(frozen=True)
class _Kept:
    """A committed save's plan: what replaying it needs."""

    layout: tuple[Any, ...]
    held: tuple[Any, ...]  # The meshes, named in the layout by id.
    group: Callable[[], Any]  # A weak reference (``_weak``): compared by identity.
    plan: Any  # This rank's final ``SavePlan``.
    world_size: int
    num_files: int
    tensors_metadata: dict[str, Any] | None  # The coordinator's global metadata.
    chunk_layout: Any  # The coordinator's ``writer.ChunkLayout`` (None on other ranks).


def _weak(group: ProcessGroup | None) -> Callable[[], Any]:
    """A weak reference to ``group`` (None: the default group, or none at all).

    A kept plan must not keep its process group alive: after ``destroy_process_group`` a
    group still referenced lives on, with its gloo threads, until the interpreter's shutdown,
    where those threads can abort the process (``env.background_group``).
    """
    if group is None:
        return lambda: None
    return weakref.ref(group)


class _Resolver:
    """The part of DCP's planner that ``ShardedStorageWriter.write_data`` uses."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors  # The staged table (``ShardMemo`` compares it).
        self._dtensor = dtensor_class()

    def resolve_data(self, item: object) -> Any:
        """This rank's chunk of the item's tensor, as DCP's default planner resolves it.

        A DTensor over a plain local tensor is its local tensor (``to_local``), as DCP
        resolves it; the checks DCP makes first (no ``Partial`` placement) held when the plan
        was made, and the placements have not changed since (the layout is the plan's). DCP's
        own lookup takes 5 us a chunk, 1,000 a save.
        """
        tensor = self.tensors.get(item.index.fqn)
        if (
            tensor is not None
            and type(tensor) is self._dtensor
            and type(tensor._local_tensor) is torch.Tensor
        ):
            return tensor.to_local()
        from torch.distributed.checkpoint.utils import find_state_dict_object

        return find_state_dict_object(self.tensors, item.index)


class PlanCache:
    """The plan of the last committed sharded save of one state, for the next save to replay.

    Kept by the caller between saves (``ShardedWriter``, one per ``Saver``); passed to
    ``collective.write_sharded``.

    Attributes:
        replayed: How many saves replayed a kept plan (for tests and benchmarks).

    Thread safety: one save at a time (the thread that writes the saves).
    Distributed: every rank keeps its own; ``replay`` is a collective of the save's group.
    """

    def __init__(self) -> None:
        self._kept: _Kept | None = None
        self.replayed = 0
        self.shards = ShardMemo()  # This rank's last shard under the kept plan.
        self.table = TableMemo()  # The coordinator's last tensor table under it.
        self.sent = SentRows()  # This rank's rows last sent to the coordinator under it.
        self.trees = TreeMemo()  # The coordinator's last skeleton's encoding and texts.
        # The staged table last laid out (``layout_of``), and its answer.
        self._laid_out: tuple[Contents, tuple[tuple[Any, ...], list[Any]]] | None = None

    @property
    def chunk_layout(self) -> Any:
        """The kept plan's chunk layout (``writer.ChunkLayout``): the coordinator's; None on
        the other ranks, or with no plan kept."""
        return None if self._kept is None else self._kept.chunk_layout

    def forget(self) -> None:
        """Drop the kept plan (after a failed save): the next save is planned by DCP."""
        self._kept = None
        self.shards.forget()
        self.table.forget()
        self.sent.forget()
        self._laid_out = None

    def remember(self, save: ShardedSave, writer: Any, group: ProcessGroup | None) -> None:
        """Keep the plan of ``save``, just committed through DCP by ``writer``."""
        # The shard of an older plan: every save DCP plans ends here or in ``forget``.
        self.shards.forget()
        self.table.forget()
        self.sent.forget()
        if writer.final_plan is None or (writer.is_coordinator and writer.tensors_metadata is None):
            self._kept = None
            return
        layout, held = self._layout_of(save)
        self._kept = _Kept(
            layout=layout,
            held=tuple(held),
            group=_weak(group),
            plan=writer.final_plan,
            world_size=writer.world_size,
            num_files=writer.num_files,
            tensors_metadata=writer.tensors_metadata,
            chunk_layout=writer.chunk_layout,
        )

    def _layout_of(self, save: ShardedSave) -> tuple[tuple[Any, ...], list[Any]]:
        """``layout_of(save.tensors)``; for a staged save, the last answer while its table
        holds the very same objects (1 ms a save of 1,000 tensors on the writer thread,
        holding the GIL). Those are the staging's own tensors over the copies, reused while
        nothing changed (``staging.StageMemo``), whose dtypes, shapes, placements and meshes
        never change. Not so a live tensor: ``t.data = t.data.half()`` changes the dtype of
        the same object, so an unstaged (synchronous) save is always laid out anew."""
        if save.snapshot is None:
            self._laid_out = None
            return layout_of(save.tensors)
        laid_out = self._laid_out
        if laid_out is not None and same_contents([save.tensors], laid_out[0]):
            return laid_out[1]
        answer = layout_of(save.tensors)
        self._laid_out = (contents([save.tensors]), answer)
        return answer

    def fits(self, save: ShardedSave, group: ProcessGroup | None) -> bool:
        """Whether this rank can replay the kept plan for ``save`` through ``group``: it has
        one, made through that group for the same layout, and ``save`` carries no error.
        Every rank must agree before any replays (``collective.write_sharded``)."""
        kept = self._kept
        return (
            kept is not None
            and save.error is None
            and kept.group() is group
            and kept.layout == self._layout_of(save)[0]
        )

    def replay(
        self, save: ShardedSave, writer: Any, group: ProcessGroup | None, *, retire: bool
    ) -> Any:
        """Write and commit ``save`` with the kept plan, once every rank agreed that it
        ``fits``.

        A collective of ``group``: every rank calls it for the same save. ``retire``: the
        prefix holds an older save's files (the coordinator found them): the coordinator
        retires them first, and if it cannot, every rank gets None (nothing written yet: plan
        the save with DCP, which retires again and reports its error to every rank).

        Returns:
            The coordinator's ``SaveOutcome`` (on every rank), or None.

        Raises:
            CheckpointException: If the write or the commit failed on any rank (on every
                rank, with every rank's failure), as DCP raises it.
        """
        import torch.distributed as dist
        from torch.distributed.checkpoint.metadata import Metadata

        try:  # DCP's exception-safe collectives; private, so a torch without them plans.
            from torch.distributed.checkpoint.utils import _DistWrapper
        except ImportError:  # pragma: no cover - every torch since 2.0 has it.
            return None
        kept = self._kept
        assert kept is not None  # ``fits`` said so.
        wrapper = _DistWrapper(group, True, 0)
        writer.set_up_storage_writer(wrapper.is_coordinator, rank=wrapper.rank)
        if retire:
            # The retirement happens only once every rank will write, and before any rank
            # puts its shard; its outcome is the coordinator's (a one-number broadcast; DCP's
            # pickled one costs 3 times more).
            device = communication_device(dist.get_backend(group))  # CUDA for NCCL.
            flag = torch.tensor([1], dtype=torch.int32, device=device)
            if wrapper.is_coordinator:
                try:
                    writer.adopt_global_plan(kept.world_size, kept.num_files)
                except Exception:
                    flag[0] = 0
            coordinator = 0 if group is None else dist.get_global_rank(group, 0)
            dist.broadcast(flag, src=coordinator, group=group)
            if not flag.item():
                return None
        if not wrapper.is_coordinator or not retire:
            writer.adopt_global_plan(kept.world_size, kept.num_files, retire=False)
        self.replayed += 1
        writer.previous_layout = kept.chunk_layout
        writer.shard_memo = self.shards
        writer.table_memo = self.table
        writer.tree_memo = self.trees
        resolver = _Resolver(save.tensors)

        def write() -> Any:
            plan = writer.prepare_replayed_plan(kept.plan)
            # Cheaper to gather than DCP's results, the more so without rows sent before.
            return self.sent.pack(writer.write_packed(plan, resolver))

        def commit(results: list[Any]) -> Any:
            metadata = Metadata(state_dict_metadata=dict(kept.tensors_metadata or {}))
            writer.finish(metadata, results)
            return metadata.storage_data

        outcome = wrapper.all_reduce("write", write, commit)
        layout = writer.chunk_layout  # The coordinator's: the kept one, or equal to it.
        if layout is not None and layout is not kept.chunk_layout:
            # Held with this save's chunk names, which the next save's are while the table
            # of the ranks' rows holds (``packed.TableMemo``): compared by identity then.
            self._kept = dataclasses.replace(kept, chunk_layout=layout)
        return outcome
