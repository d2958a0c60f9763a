"""The walk of a state at a save: its skeleton and its flat table of tensors.

``walk_state`` turns a state into its flat table of tensors by state path and the tree the
manifest records, as ``core.state.flatten_state`` does. Both writers use it: a sharded save
(DTensors kept as they are, the table DCP plans from) and a save of one process's state
(``sharded=False``: the live tensors, copied into the staging buffers at once). It runs at
every save, on the training thread, over every tensor and value of the state (a
transformer's: thousands), so a save's stall depends on it.

Between two saves of a training run the state is mostly the very same objects: a model's
state dict with ``keep_vars`` holds its parameters themselves, an optimizer's state dict its
state tensors. ``WalkMemo`` keeps what the last walk made of each mapping of leaves, and
the next walk takes it at once while that mapping holds the same keys and the same objects.
It also keeps each module's state dict (``module_memo.ModuleStateMemo``), taken again while
the module is made of the very same objects.

A state of 1,008 small tensors (LayerNorm + Linear blocks and Adam), one process, after
training steps: 3.3 ms a walk with the frozen tensors told apart (``flatten_state``), 1.3 ms
with the memo (``benchmarks/checkpoint.py --blocks-sizes``).
"""

from __future__ import annotations

import dataclasses
import operator
from collections import OrderedDict
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from torchsupervisor.core.module_memo import ModuleStateMemo
from torchsupervisor.core.same_objects import Contents, contents, same_contents
from torchsupervisor.core.state import (
    _BARE,
    _MODULE,
    _OTHER,
    _PLAIN_TENSOR_TYPES,
    MAX_STATE_DEPTH,
    TensorRef,
    check_saveable,
    dtensor_class,
    frozen_among,
    not_saveable,
    state_entries,
    uncompiled,
)
from torchsupervisor.errors import ShardedStateError

__all__ = ["WalkMemo", "walk_state"]

_PLAIN = (str, int, float, bool, type(None), bytes, torch.dtype, torch.device)
_EXACT_PLAIN = frozenset({str, int, float, bool, type(None)})  # Kept as they are; not subclasses.
_MEMO_MAPPINGS = frozenset({dict, OrderedDict})  # Not a Mapping whose items() may differ.
_requires_grad = operator.attrgetter("requires_grad")
_MODULE_STATE_DICT = torch.nn.Module.state_dict
_local_tensor = operator.attrgetter("_local_tensor")  # A DTensor's local shard, itself.
_make_ref = tuple.__new__  # ``TensorRef(name, ndarray)`` without its Python ``__new__``.


@dataclasses.dataclass(eq=False, slots=True)
class _Leaves:
    """What one walk made of a mapping of leaves (at one state path), or of a mapping of
    leaves and of such mappings (an optimizer's state: a mapping of leaves per parameter).

    Leaves: exact ``str``/``int``/``float``/``bool``/None values and tensors kept as they are
    (DTensors; plain tensors outside autograd), each tensor named by its path alone.
    """

    out: dict[Any, Any]  # The skeleton's mapping.
    contents: Contents | None = None  # Of the mapping, then of ``inner``.
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # In order.
    local: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # Their data.
    dtensors: list[Any] = dataclasses.field(default_factory=list)  # The DTensors, in order...
    shards: list[torch.Tensor] = dataclasses.field(default_factory=list)  # ... their shards.
    plain: list[torch.Tensor] = dataclasses.field(default_factory=list)  # The plain tensors...
    grads: list[bool] = dataclasses.field(default_factory=list)  # ... their ``requires_grad``.
    origin: int = _BARE  # Where the mapping was met (``flatten_state``'s frozen tracking).
    candidates: list[str] = dataclasses.field(default_factory=list)  # Frozen unless volatile.
    # A mapping of mappings of leaves: those mappings, and their records.
    inner: list[dict[Any, Any]] = dataclasses.field(default_factory=list)
    records: dict[str, _Leaves] = dataclasses.field(default_factory=dict)


class WalkMemo:
    """What the last walk (``walk_state`` with ``keep_vars``) made of each mapping of
    leaves, by state path, for the next walk to take while nothing of it changed.

    A mapping is taken as it was when it is a ``dict`` (or ``OrderedDict``) met at the same
    kind of place (in a module's state, another object's, or neither: what tells frozen
    tensors), with the same keys in the same order and the very same value objects, each
    DTensor with the very same local tensor (FSDP2 may swap a parameter's) and each plain
    tensor requiring gradients as it did then; its tensors' names must still be free in the
    table. So is a mapping of such mappings (one
    level), checked the same way, each pass over all of them at once. A value that is a new
    object (a float a scheduler assigned, a tensor replaced) makes the walk visit its
    mapping again. A 1,008-tensor FSDP2 state (2 ranks, alternated in one process): 0.43-0.51
    ms a walk instead of 1.7-2.1.

    A list of exact ``str``/``int``/``bool``/None values (an optimizer's ``params``, new at
    every ``state_dict``) equal to the last walk's at its path, item for item and type for
    type, is handed over as the last walk's very own skeleton list, which lets the manifest's
    encoding of it be taken again (``tree_memo.TreeMemo``: 264 parameter names or indices a
    save). Not a list with a float: ``0.0 == -0.0``, and their texts differ.

    Holds the objects of the last walk's mappings of leaves (the state's own tensors) until
    the next walk, which keeps only what it met.

    Thread safety: one walk at a time (the training thread).
    """

    def __init__(self) -> None:
        self._last: dict[str, _Leaves] = {}
        self._lists: dict[str, tuple[list[Any], list[type]]] = {}  # Skeleton lists, by path.
        self.modules = ModuleStateMemo()  # The modules' state dicts.

    @property
    def last(self) -> Mapping[str, Any]:
        """What the last walk kept, by state path (read-only; for tests and diagnostics)."""
        return MappingProxyType(self._last)


def walk_state(
    state: Mapping[str, Any],
    *,
    keep_vars: bool = False,
    local: dict[str, torch.Tensor] | None = None,
    memo: WalkMemo | None = None,
    sharded: bool = True,
    detach: bool = True,
    frozen: set[str] | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Split the state into a skeleton and a flat table of tensors, DTensors included.

    ``state.flatten_state`` is this walk with ``sharded=False`` (its docstring tells the
    names, the skeleton, the frozen tensors and the errors). With ``sharded``, ``DTensor``
    leaves are accepted and kept as they are (detached if they require gradients): each
    rank holds only its local shard of them.

    Args:
        state: Mapping of names (str) to stateful objects, tensors, arrays or values.
        keep_vars: Modules give their parameters as they are (``state_dict(keep_vars=True)``)
            and the DTensors among them are kept undetached: ``detach`` of a DTensor is a
            dispatched operation (15-18 us, 6 ms for a model of 400 parameters). For a save,
            which only reads the local shards (``to_local`` under ``no_grad``); a restore
            needs detached destinations.
        local: If given, receives each tensor's local data by name (a DTensor's local shard,
            ``to_local``, which the walk reads anyway; another tensor as in ``tensors``).
        memo: What the previous walk made of the state's mappings of leaves, reused where
            nothing changed and updated (``WalkMemo``); used with ``keep_vars`` only. The
            result is the same with or without it.
        sharded: False: the state of one process, as ``state.flatten_state`` takes it: a
            ``DTensor`` or an entry that needs a sharded save (``ShardedOptimizerState``)
            raises ``ShardedStateError``.
        detach: False (with ``keep_vars``): plain tensors that require gradients (a model's
            parameters) are kept as they are too, for a caller that reads them under
            ``no_grad`` at once (a snapshot's copy); the memo can then take them again.
        frozen: If given, receives the names of the frozen tensors, as ``state.flatten_state``
            tells them.

    Returns:
        ``(skeleton, tensors)``: the skeleton with ``TensorRef`` leaves, and ``{name: tensor}``:
        a tensor that requires gradients, and a parameter, detached (but see ``keep_vars``
        and ``detach``); another tensor itself; a numpy array wrapped by ``torch.from_numpy``.
        Every container of the skeleton is the walk's own (never one of the state's) and
        every leaf immutable, so a background save may encode it after training has changed
        the state (``staging.ShardedSave``). No container is ever changed once made: with
        ``memo``, a mapping (or a list of leaves) taken again is the last walk's very own
        skeleton container, which lets the manifest's encoding be taken again too
        (``tree_memo.TreeMemo``).

    Raises:
        TypeError: For a leaf that cannot be saved without pickle, or a bad dict key.
        ValueError: For a tensor that cannot be saved (uninitialized, sparse, quantized, or a
            tensor subclass other than DTensor), or a state nested deeper than
            ``MAX_STATE_DEPTH`` containers (a container that holds itself, say).
        ShardedStateError: (a ``ValueError``) With ``sharded=False``, for a DTensor or an
            entry that needs a sharded save.
    """
    if not keep_vars:
        memo = None
    options = (keep_vars, local, sharded, detach or not keep_vars, frozen is not None)
    walker = _Walker(*options) if memo is None else _MemoWalker(memo, *options)
    skeleton = walker.run(state)
    if frozen is not None:
        frozen.update(frozen_among(walker.candidates, walker.tensors, walker.stateful))
    return skeleton, walker.tensors


class _Walker:
    """One walk of a state, without a memo (``walk_state``; its arguments, by name).

    The walk visits every tensor and value of the state at each save (a transformer's state:
    thousands), so the common cases come first and cheapest: exact plain types by a set
    lookup, then DTensors, tensors, then dicts (``dict`` before the slower ``Mapping`` check).
    A mapping's plain values and DTensors are taken without a call of ``walk``.

    The memo layer (``_MemoWalker``) overrides the four places where a walk may take what
    the last one made: ``take_mapping``/``made_mapping``, ``plain_list`` and
    ``module_state``.
    """

    def __init__(
        self,
        keep_vars: bool,
        local: dict[str, torch.Tensor] | None,
        sharded: bool,
        detach: bool,
        track: bool,
    ) -> None:
        self.keep_vars = keep_vars
        self.local = local
        self.sharded = sharded
        self.detach = detach
        self.track = track
        self.dtensor = dtensor_class() if sharded else None
        self.tensors: dict[str, torch.Tensor] = {}
        self.candidates: list[str] = []  # Frozen unless they share memory with a volatile one.
        self.stateful: list[Any] = []  # The modules and optimizers met (they make volatile).

    def run(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The skeleton of ``state`` (the table is ``tensors``)."""
        with torch.no_grad():  # Once for the walk (entering it costs ~2 us a time).
            return {key: self.walk(value, key, 0, _BARE) for key, value in state_entries(state)}

    def add(
        self, path: str, tensor: torch.Tensor, ndarray: bool, data: torch.Tensor, origin: int
    ) -> TensorRef:
        tensors = self.tensors
        name = path
        if name in tensors:  # Two paths alike (keys with "/"): "#1", "#2", ...
            k = 1
            while f"{path}#{k}" in tensors:
                k += 1
            name = f"{path}#{k}"
        tensors[name] = tensor
        if self.local is not None:
            self.local[name] = data
        if self.track and origin != _OTHER:
            self.candidates.append(name)
        return _make_ref(TensorRef, (name, ndarray))

    def add_dtensor(self, obj: object, path: str) -> TensorRef:
        # The local tensor itself: outside autograd (the walk runs under ``no_grad``) that
        # is what ``to_local`` returns, but for a parameter a new view of it at each call
        # (torch 2.13: 1 us a parameter, and the memo would never see the same shard).
        # ``detach`` of a DTensor is a dispatched operation (16 us) that state dicts have
        # already done. Never frozen (no storage of its own: ``state._storage_key``).
        data = getattr(obj, "_local_tensor", None)
        if data is None:
            data = obj.to_local()
        check_saveable(data, path)
        tensor = obj if self.keep_vars or not obj.requires_grad else obj.detach()
        return self.add(path, tensor, False, data, _OTHER)

    def add_tensor(self, obj: torch.Tensor, path: str, origin: int) -> TensorRef:
        check_saveable(obj, path)  # A DTensor of an unsharded walk: ``ShardedStateError``.
        if obj.requires_grad:
            origin = _OTHER  # Trained: never frozen.
            tensor = obj if not self.detach else obj.detach()
        else:
            # A tensor outside autograd is kept as it is (``detach`` makes a new tensor
            # object: 1.5 us); without ``keep_vars``, a parameter is detached all the same.
            tensor = obj if self.keep_vars or type(obj) is torch.Tensor else obj.detach()
        return self.add(path, tensor, False, tensor, origin)

    def walk(self, obj: object, path: str, depth: int, origin: int) -> Any:
        kind = type(obj)
        if kind in _EXACT_PLAIN:
            return obj
        dtensor = self.dtensor
        if kind is dtensor:
            return self.add_dtensor(obj, path)
        if isinstance(obj, torch.Tensor):
            if dtensor is not None and isinstance(obj, dtensor):
                return self.add_dtensor(obj, path)
            return self.add_tensor(obj, path, origin)
        if kind is dict:
            return self.walk_mapping(obj, path, depth, origin)
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in "biufc":
                raise TypeError(
                    f"Cannot save {path!r}: numpy arrays of dtype {obj.dtype} need pickle"
                )
            tensor = torch.from_numpy(np.ascontiguousarray(obj))
            return self.add(path, tensor, True, tensor, _OTHER)
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, torch.Size):
            return tuple(int(d) for d in obj)
        if isinstance(obj, _PLAIN):
            return obj
        if isinstance(obj, Mapping):
            return self.walk_mapping(obj, path, depth, origin)
        if isinstance(obj, list):
            deeper = _below(path, depth)
            if all(type(value) in _EXACT_PLAIN for value in obj):  # An optimizer's "params".
                return self.plain_list(obj, path)
            return [self.walk(v, f"{path}/{i}", deeper, origin) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            deeper = _below(path, depth)
            return tuple(self.walk(v, f"{path}/{i}", deeper, origin) for i, v in enumerate(obj))
        return self.walk_stateful(obj, path, depth)

    def walk_stateful(self, obj: object, path: str, depth: int) -> Any:
        """A stateful object stands for its state dict, at its own depth."""
        if not self.sharded and getattr(obj, "is_sharded_state", False):
            raise ShardedStateError(path)
        obj = uncompiled(obj)  # A torch.compile or DDP wrapper: its module's own names.
        if isinstance(obj, torch.nn.Module):
            self.stateful.append(obj)
            # A class's own ``state_dict`` may not take ``keep_vars``: called as it is.
            if self.keep_vars and type(obj).state_dict is _MODULE_STATE_DICT:
                return self.walk(self.module_state(obj, path), path, depth, _MODULE)
            return self.walk(obj.state_dict(), path, depth, _MODULE)
        state_dict = getattr(obj, "state_dict", None)
        if callable(state_dict):
            self.stateful.append(obj)
            return self.walk(state_dict(), path, depth, _OTHER)
        raise not_saveable(path, obj)

    def walk_mapping(self, obj: Mapping, path: str, depth: int, origin: int) -> dict:
        deeper = _below(path, depth)
        taken = self.take_mapping(obj, path, origin)
        if taken is not None:
            return taken
        out = {}
        dtensor = self.dtensor
        for key, value in obj.items():
            if type(key) is not str and not isinstance(key, (str, int, float, bool, type(None))):
                raise TypeError(
                    f"Cannot save {path!r}: dict key {key!r} has type {type(key).__name__}; "
                    "keys must be str, int, float, bool or None"
                )
            kind = type(value)
            if kind in _EXACT_PLAIN:
                out[key] = value
            elif kind is dtensor:
                out[key] = self.add_dtensor(value, f"{path}/{key}")
            else:
                out[key] = self.walk(value, f"{path}/{key}", deeper, origin)
        self.made_mapping(obj, path, out, origin)
        return out

    # The places where the memo layer takes what the last walk made.

    def take_mapping(self, obj: Mapping, path: str, origin: int) -> dict | None:
        """The last walk's skeleton mapping of ``obj``, or None: walk it."""
        return None

    def made_mapping(self, obj: Mapping, path: str, out: dict, origin: int) -> None:
        """``obj`` was walked into ``out``."""

    def plain_list(self, obj: list, path: str) -> list:
        """The skeleton of a list of exact plain values."""
        return list(obj)

    def module_state(self, module: torch.nn.Module, path: str) -> dict[str, Any]:
        """``module.state_dict(keep_vars=True)``."""
        return module.state_dict(keep_vars=True)


class _MemoWalker(_Walker):
    """A walk that takes what the last one made where nothing changed (``WalkMemo``)."""

    def __init__(self, memo: WalkMemo, *options: Any) -> None:
        super().__init__(*options)
        self.memo = memo
        self.last = memo._last
        self.met: dict[str, _Leaves] = {}  # This walk's mappings of leaves, for the memo.
        self.last_lists = memo._lists
        self.met_lists: dict[str, tuple[list[Any], list[type]]] = {}  # Its lists of leaves.

    def run(self, state: Mapping[str, Any]) -> dict[str, Any]:
        self.memo.modules.begin_walk()
        skeleton = super().run(state)
        memo = self.memo  # Only what this walk met: nothing older is kept alive.
        memo._last, memo._lists = self.met, self.met_lists
        memo.modules.end_walk()
        return skeleton

    def module_state(self, module: torch.nn.Module, path: str) -> dict[str, Any]:
        return self.memo.modules.state_dict(module, path)

    def plain_list(self, obj: list, path: str) -> list:
        # The last walk's list where this one is equal to it, item for item and type for type
        # (``WalkMemo``): never changed once made, like every container of a skeleton.
        types = list(map(type, obj))
        known = self.last_lists.get(path)
        if known is not None and known[1] == types and known[0] == obj:
            self.met_lists[path] = known
            return known[0]
        out = list(obj)
        if float not in types:
            self.met_lists[path] = (out, types)
        return out

    def take_mapping(self, obj: Mapping, path: str, origin: int) -> dict | None:
        if type(obj) not in _MEMO_MAPPINGS:
            return None
        known = self.last.get(path)
        if known is None or known.origin != origin or not self.same_leaves(obj, known):
            return None
        self.tensors.update(known.tensors)
        if self.local is not None:
            self.local.update(known.local)
        self.candidates.extend(known.candidates)
        self.met[path] = known
        self.met.update(known.records)  # For a later walk that finds only some the same.
        return known.out  # The last walk's, never changed (see ``walk_state``'s Returns).

    def same_leaves(self, obj: dict, known: _Leaves) -> bool:
        # Each test a pass in C (no Python step per value). The inner mappings are the very
        # same objects as the mapping's values, once those are checked.
        return (
            same_contents([obj, *known.inner], known.contents)  # type: ignore[arg-type]
            and all(map(operator.is_, map(_local_tensor, known.dtensors), known.shards))
            and list(map(_requires_grad, known.plain)) == known.grads
            and self.tensors.keys().isdisjoint(known.tensors)
        )

    def made_mapping(self, obj: Mapping, path: str, out: dict, origin: int) -> None:
        # Recorded only if each value is a leaf or a mapping of leaves just recorded (met at
        # the same origin), and each tensor went into the table as it is, under its path.
        if type(obj) not in _MEMO_MAPPINGS:
            return
        leaves = _Leaves(out, origin=origin)
        for key, value in obj.items():
            kind = type(value)
            if kind in _EXACT_PLAIN:
                continue
            name = f"{path}/{key}"
            if kind in _MEMO_MAPPINGS:
                if not self._add_inner(leaves, value, name, origin):
                    return
            elif not self._add_leaf(leaves, value, name, kind, origin):
                return
        leaves.contents = contents([obj, *leaves.inner])
        self.met[path] = leaves

    def _add_inner(self, leaves: _Leaves, value: dict, name: str, origin: int) -> bool:
        inner = self.met.get(name)
        if (
            inner is None
            or inner.inner  # One level only.
            or inner.origin != origin
            or not same_contents([value], inner.contents)  # type: ignore[arg-type]
        ):
            return False
        leaves.inner.append(value)
        leaves.records[name] = inner
        leaves.tensors.update(inner.tensors)
        leaves.local.update(inner.local)
        leaves.dtensors.extend(inner.dtensors)
        leaves.shards.extend(inner.shards)
        leaves.plain.extend(inner.plain)
        leaves.grads.extend(inner.grads)
        leaves.candidates.extend(inner.candidates)
        return True

    def _add_leaf(self, leaves: _Leaves, value: Any, name: str, kind: type, origin: int) -> bool:
        if self.tensors.get(name) is not value:
            return False  # Detached, converted, renamed ("#1") or not a tensor.
        data = self.local[name] if self.local is not None else value
        if kind is self.dtensor:
            if data is not getattr(value, "_local_tensor", None):
                return False  # A DTensor without one (another torch): not checked cheaply.
            leaves.dtensors.append(value)
            leaves.shards.append(data)
        elif kind in _PLAIN_TENSOR_TYPES:
            grad = value.requires_grad
            leaves.plain.append(value)
            leaves.grads.append(grad)
            if self.track and origin != _OTHER and not grad:
                leaves.candidates.append(name)
        else:
            return False
        leaves.tensors[name] = value
        leaves.local[name] = data
        return True


def _below(path: str, depth: int) -> int:
    # The limit of ``state.flatten_state``: no manifest reader takes a deeper tree, and a
    # container holding itself is refused here instead of exhausting the stack.
    if depth >= MAX_STATE_DEPTH:
        raise ValueError(
            f"Cannot save {path!r}: the state nests deeper than {MAX_STATE_DEPTH} levels"
        )
    return depth + 1
