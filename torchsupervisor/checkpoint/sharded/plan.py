"""What a sharded state is, and its plan: the entries every rank flattens for DCP.

``is_sharded`` tells whether a state holds ``DTensor`` s (FSDP2): such a state is saved and
restored by every rank together (``collective.py``). ``flatten_sharded_state`` turns it into
the flat mapping DCP plans from (tensors by state path, DTensors as they are) and the tree the
manifest records. ``ShardedOptimizerState`` gives an optimizer of a sharded model a
``state_dict`` keyed by parameter names, which any world size can load.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from torchsupervisor.core.state import (
    MAX_STATE_DEPTH,
    TensorRef,
    check_saveable,
    not_saveable,
    state_entries,
)

__all__ = ["ShardedOptimizerState", "dtensor_class", "flatten_sharded_state", "is_sharded"]


def dtensor_class() -> type | None:
    """The DTensor class if it was imported (no DTensor can exist otherwise), else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


# ------------------------------------------------------------------------------ the state


class ShardedOptimizerState:
    """The state of an optimizer of a sharded model, keyed by parameter names.

    ``optimizer.state_dict()`` keys its state by parameter position, and loading it needs an
    optimizer whose state already exists with the same sharding. This adapter uses
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` /
    ``set_optimizer_state_dict`` instead: the state is keyed by parameter names, its tensors
    are DTensors sharded like the parameters (so they reshard on restore), and a fresh
    optimizer gets its state created before it is loaded. Put it in the state next to the
    model: ``{"model": model, "optimizer": ShardedOptimizerState(model, optimizer)}``.

    Args:
        model: The (FSDP2-sharded, or plain) model whose parameters the optimizer updates.
        optimizer: The optimizer.
        options: ``torch.distributed.checkpoint.state_dict.StateDictOptions``; None: the
            defaults (sharded state, not offloaded to the CPU).

    Thread safety: like the optimizer itself (the training thread).
    Distributed: ``state_dict`` and ``load_state_dict`` may run collectives for some
    wrappings (FSDP1); call them on every rank.

    TF name: none (the optimizer's slot variables were ordinary variables in TF).
    """

    is_sharded_state = True
    """Tells ``flatten_state`` (the unsharded path) that this entry needs ``save_sharded``."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, options: Any = None
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = options
        self._names: _ParamNames | None = None

    def state_dict(self) -> dict[str, Any]:
        """Return the optimizer's state keyed by parameter names (creating it if empty).

        The first call asks DCP; later calls (default ``options``) remap
        ``optimizer.state_dict()`` with the names DCP gave, as long as the optimizer's
        parameters and the model's named parameters are the same objects under the same
        names (DCP re-derives every name at each call: 0.15-0.4 ms of a save's stall).

        Returns:
            ``{"state": {param_name: {...}}, "param_groups": [...]}``, the tensors of a
            sharded model's parameters as DTensors.
        """
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if self._names is not None:
            remapped = self._names.state_dict(self.model, self.optimizer)
            if remapped is not None:
                return remapped
        with _without_step_hooks(self.optimizer):
            result = get_optimizer_state_dict(self.model, self.optimizer, options=self.options)
        self._names = None
        if self.options is None:
            self._names = _ParamNames.learn(self.model, self.optimizer, result)
        return result

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state returned by ``state_dict`` (possibly of another world size)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        with _without_step_hooks(self.optimizer):
            set_optimizer_state_dict(
                self.model, self.optimizer, dict(state_dict), options=self.options
            )


class _ParamNames:
    """The names DCP gives an optimizer's parameters, kept while they cannot have changed.

    DCP names a parameter after the model's module path, less the wrappers' parts
    (``torch.compile``, activation checkpointing). The names are a function of the model's
    named parameters and of the optimizer's parameter list; both are compared, by object
    identity, at every call (about 10 us for a small model). ``learn`` keeps the names only
    if remapping ``optimizer.state_dict()`` with them gives exactly what DCP returned (the
    same keys in the same order, the same state objects): not so for FSDP1's flattened
    parameters or a flattened optimizer state, which stay with DCP.
    """

    def __init__(self, key: tuple[Any, ...], held: list[Any], names: list[str]) -> None:
        self._key = key
        self._held = held  # Keeps the objects alive, so that their ids stay theirs.
        self._names = names

    @staticmethod
    def identities(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
        """The optimizer's parameters and the model's named parameters, by object id."""
        params = tuple(id(p) for group in optimizer.param_groups for p in group["params"])
        named = tuple((name, id(p)) for name, p in model.named_parameters())
        return params, named

    @classmethod
    def learn(
        cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, result: Mapping[str, Any]
    ) -> _ParamNames | None:
        """The names in ``result`` (DCP's state dict), or None where remapping would differ."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if len({id(p) for p in params}) != len(params):
            return None  # A parameter twice: torch and DCP number it differently.
        try:
            names = [name for group in result["param_groups"] for name in group["params"]]
        except (KeyError, TypeError):
            return None
        if len(names) != len(params) or not all(isinstance(n, str) for n in names):
            return None
        held = [*params, *model.parameters()]
        learnt = cls(cls.identities(model, optimizer), held, names)
        remapped = learnt._remap(optimizer.state_dict())
        try:
            same = remapped is not None and _identical(remapped, result)
        except (TypeError, ValueError, RuntimeError):  # A value whose == is not a bool.
            same = False
        return learnt if same else None

    def state_dict(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        """The state keyed by the known names; None if they may have changed (ask DCP)."""
        if not optimizer.state or self.identities(model, optimizer) != self._key:
            return None  # An empty state is created by DCP.
        return self._remap(optimizer.state_dict())

    def _remap(self, packed: Mapping[str, Any]) -> dict[str, Any] | None:
        names = self._names
        state = {}
        for index, value in packed["state"].items():
            if not isinstance(index, int) or not 0 <= index < len(names):
                return None
            state[names[index]] = value
        groups = []
        for group in packed["param_groups"]:
            group = dict(group)
            group["params"] = [names[i] for i in group["params"]]
            groups.append(group)
        return {"state": state, "param_groups": groups}


def _identical(ours: Any, theirs: Any) -> bool:
    """Same structure, same keys in the same order, tensors the very same objects."""
    if isinstance(ours, torch.Tensor) or isinstance(theirs, torch.Tensor):
        return ours is theirs
    if type(ours) is not type(theirs):
        return False
    if isinstance(ours, dict):
        return list(ours) == list(theirs) and all(_identical(ours[k], theirs[k]) for k in ours)
    if isinstance(ours, (list, tuple)):
        return len(ours) == len(theirs) and all(map(_identical, ours, theirs))
    return bool(ours == theirs)


@contextlib.contextmanager
def _without_step_hooks(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Silence the optimizer's step hooks while DCP creates an empty optimizer's state.

    DCP creates the state of an optimizer that has not stepped yet by calling ``step()`` once
    with zero gradients and a zero learning rate. That is not a training step: a
    ``GlobalStep`` bound to the optimizer (``GlobalStep.bind``, a step post-hook) must not
    count it.
    """
    hooks = getattr(optimizer, "_optimizer_step_post_hooks", None)
    if optimizer.state or not isinstance(hooks, dict) or not hooks:
        yield
        return
    saved = hooks.copy()
    hooks.clear()
    try:
        yield
    finally:
        hooks.update(saved)


def is_sharded(state: Mapping[str, Any]) -> bool:
    """Return True if the state holds a ``DTensor`` (and so needs ``save_sharded``).

    Cheap (it runs at every save): modules are checked through their parameters and buffers
    and optimizers through their parameters (the state of a DTensor parameter is made of
    DTensors), without collecting state dicts; other entries through their state dicts. False
    at once when DTensors were never imported.

    Args:
        state: Mapping of names to stateful objects (a session's state, a saver's var_list).
    """
    dtensor = dtensor_class()
    if dtensor is None:
        return False
    from torchsupervisor.core.state import iter_state_tensors

    for name, value in state.items():
        if isinstance(value, ShardedOptimizerState):
            value = value.model
        if isinstance(value, torch.nn.Module):
            tensors = itertools.chain(value.parameters(), value.buffers())
            if any(isinstance(t, dtensor) for t in tensors):
                return True
            continue
        if isinstance(value, torch.optim.Optimizer):
            params = (p for group in value.param_groups for p in group["params"])
            if any(isinstance(p, dtensor) for p in params):
                return True
            continue
        if any(isinstance(t, dtensor) for _, t in iter_state_tensors({name: value})):
            return True
    return False


_PLAIN = (str, int, float, bool, type(None), bytes, torch.dtype, torch.device)
_EXACT_PLAIN = frozenset({str, int, float, bool, type(None)})  # Kept as they are; not subclasses.


def flatten_sharded_state(
    state: Mapping[str, Any],
    *,
    keep_vars: bool = False,
    local: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Split the state into a skeleton and a flat table of tensors, DTensors included.

    The same as ``state.flatten_state`` (same names, same skeleton, same errors), except that
    ``DTensor`` leaves are accepted and kept as they are (detached if they require
    gradients): each rank holds only its local shard of them.

    Args:
        state: Mapping of names (str) to stateful objects, tensors, arrays or values.
        keep_vars: Modules give their parameters as they are (``state_dict(keep_vars=True)``)
            and the DTensors among them are kept undetached: ``detach`` of a DTensor is a
            dispatched operation (15-18 us, 6 ms for a model of 400 parameters). For a save,
            which only reads the local shards (``to_local`` under ``no_grad``); a restore
            needs detached destinations.

        local: If given, receives each tensor's local data by name (a DTensor's local shard,
            ``to_local``, which the walk reads anyway; another tensor as in ``tensors``).

    Returns:
        ``(skeleton, tensors)``: the skeleton with ``TensorRef`` leaves, and ``{name: tensor}``.
        Every container of the skeleton is new and every leaf immutable, so a background
        save may encode it after training has changed the state (``staging.ShardedSave``).

    Raises:
        TypeError: For a leaf that cannot be saved without pickle, or a bad dict key.
        ValueError: For a tensor that cannot be saved (uninitialized, sparse, quantized, or a
            tensor subclass other than DTensor), or a state nested deeper than
            ``MAX_STATE_DEPTH`` containers (a container that holds itself, say).
    """
    dtensor = dtensor_class()
    tensors: dict[str, torch.Tensor] = {}
    make_ref = tuple.__new__  # ``TensorRef(name, ndarray)`` without its Python ``__new__``.

    def add(path: str, tensor: torch.Tensor, ndarray: bool, data: torch.Tensor) -> TensorRef:
        name = path
        if name in tensors:  # Two paths alike (keys with "/"): "#1", "#2", ...
            k = 1
            while f"{path}#{k}" in tensors:
                k += 1
            name = f"{path}#{k}"
        tensors[name] = tensor
        if local is not None:
            local[name] = data
        return make_ref(TensorRef, (name, ndarray))

    def add_dtensor(obj: Any, path: str) -> TensorRef:
        # Outside autograd (the walk runs under ``no_grad``) ``to_local`` is an attribute
        # read (1 us, not 11); ``detach`` of a DTensor is a dispatched operation (16 us)
        # that state dicts have already done.
        data = obj.to_local()
        check_saveable(data, path)
        return add(path, obj if keep_vars or not obj.requires_grad else obj.detach(), False, data)

    # The walk visits every tensor and value of the state at each save (a transformer's
    # state: thousands), so the common cases come first and cheapest: exact plain types by a
    # set lookup, then DTensors, tensors, then dicts (``dict`` before the slower ``Mapping``
    # check). A mapping's plain values and DTensors are taken without a call of ``walk``.
    def walk(obj: Any, path: str, depth: int) -> Any:
        kind = type(obj)
        if kind in _EXACT_PLAIN:
            return obj
        if kind is dtensor:
            return add_dtensor(obj, path)
        if isinstance(obj, torch.Tensor):
            if dtensor is not None and isinstance(obj, dtensor):
                return add_dtensor(obj, path)
            check_saveable(obj, path)
            # With ``keep_vars`` a tensor outside autograd is kept as it is (``detach`` makes
            # a new tensor object: 1.5 us); one that requires gradients is still detached.
            tensor = obj if keep_vars and not obj.requires_grad else obj.detach()
            return add(path, tensor, False, tensor)
        if kind is dict:
            return walk_mapping(obj, path, depth)
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in "biufc":
                raise TypeError(
                    f"Cannot save {path!r}: numpy arrays of dtype {obj.dtype} need pickle"
                )
            tensor = torch.from_numpy(np.ascontiguousarray(obj))
            return add(path, tensor, True, tensor)
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, torch.Size):
            return tuple(int(d) for d in obj)
        if isinstance(obj, _PLAIN):
            return obj
        if isinstance(obj, Mapping):
            return walk_mapping(obj, path, depth)
        if isinstance(obj, list):
            deeper = below(path, depth)
            if all(type(value) in _EXACT_PLAIN for value in obj):  # An optimizer's "params".
                return list(obj)
            return [walk(value, f"{path}/{i}", deeper) for i, value in enumerate(obj)]
        if isinstance(obj, tuple):
            deeper = below(path, depth)
            return tuple(walk(value, f"{path}/{i}", deeper) for i, value in enumerate(obj))
        # A stateful object stands for its state dict, at its own depth.
        if keep_vars and isinstance(obj, torch.nn.Module):
            return walk(obj.state_dict(keep_vars=True), path, depth)
        state_dict = getattr(obj, "state_dict", None)
        if callable(state_dict):
            return walk(state_dict(), path, depth)
        raise not_saveable(path, obj)

    def below(path: str, depth: int) -> int:
        # The limit of ``state.flatten_state``: no manifest reader takes a deeper tree, and
        # a container holding itself is refused here instead of exhausting the stack.
        if depth >= MAX_STATE_DEPTH:
            raise ValueError(
                f"Cannot save {path!r}: the state nests deeper than {MAX_STATE_DEPTH} levels"
            )
        return depth + 1

    def walk_mapping(obj: Mapping, path: str, depth: int) -> dict:
        out = {}
        deeper = below(path, depth)
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
                out[key] = add_dtensor(value, f"{path}/{key}")
            else:
                out[key] = walk(value, f"{path}/{key}", deeper)
        return out

    with torch.no_grad():  # Once for the walk (entering it costs ~2 us a time).
        skeleton = {key: walk(value, key, 0) for key, value in state_entries(state)}
    return skeleton, tensors
