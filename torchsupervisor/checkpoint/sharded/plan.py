"""What a sharded state is, and the state of its optimizer.

``is_sharded`` tells whether a state holds ``DTensor`` s (FSDP2): such a state is saved and
restored by every rank together (``collective.py``); ``core/walk.py`` walks it into the flat
mapping DCP plans from and the tree the manifest records. ``ShardedOptimizerState`` gives an
optimizer of a sharded model a ``state_dict`` keyed by parameter names, which any world size
can load; ``positions_to_names`` lets it restore a plain optimizer's state (keyed by
parameter positions: a checkpoint of one process or of DDP) as well.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from torchsupervisor.core.module_memo import NAME_PARTS, ModuleTree
from torchsupervisor.core.state import dtensor_class
from torchsupervisor.errors import InvalidArgumentError

__all__ = ["ShardedOptimizerState", "is_sharded", "positions_to_names", "rename_positions"]


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

    @property
    def is_sharded_state(self) -> bool:
        """Whether this entry needs ``save_sharded`` (its model holds DTensors: FSDP2), which
        tells ``flatten_state`` (the unsharded path) to refuse it. The state of a plain
        model's optimizer (one process, DDP) is saved like any state, keyed by parameter
        names: a checkpoint that an FSDP2 model at any world size restores."""
        return is_sharded({"model": self.model})

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, options: object = None
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


def positions_to_names(saved: object, live: object) -> dict[int, str] | None:
    """How a plain optimizer's saved state maps onto a ``ShardedOptimizerState``'s.

    ``torch.optim.Optimizer.state_dict`` keys the state by parameter positions
    (``{"state": {0: {...}}, "param_groups": [{"params": [0, 1], ...}]}``), as a checkpoint of
    one process or of DDP holds it; a ``ShardedOptimizerState`` keys it by parameter names.
    The positions of each saved group are matched with the names of the live group at the
    same place, in order: so a DDP run's checkpoint restores into an FSDP2 model's optimizer
    (``rename_positions``), each rank reading only its shard.

    Args:
        saved: The checkpoint's tree of the entry.
        live: The live entry's state dict (or its skeleton): keyed by names.

    Returns:
        ``{position: name}``, or None when ``saved`` is not keyed by positions or ``live`` not
        by names (nothing to map).

    Raises:
        InvalidArgumentError: The groups differ in number or size (another optimizer).
    """
    saved_groups, live_groups = _group_params(saved), _group_params(live)
    if saved_groups is None or live_groups is None:
        return None
    if not all(type(p) is int for g in saved_groups for p in g) or not all(
        isinstance(n, str) for g in live_groups for n in g
    ):
        return None
    if [len(g) for g in saved_groups] != [len(g) for g in live_groups]:
        raise InvalidArgumentError(
            "The optimizer state in the checkpoint (keyed by parameter positions) has param "
            f"groups of {[len(g) for g in saved_groups]} parameters, the live optimizer of "
            f"{[len(g) for g in live_groups]}"
        )
    return {p: n for g, h in zip(saved_groups, live_groups) for p, n in zip(g, h)}


def rename_positions(saved: Mapping[str, Any], names: Mapping[int, str]) -> dict[str, Any]:
    """``saved`` (an optimizer state keyed by positions) keyed by ``names`` instead
    (``positions_to_names``); a position without a name keeps its key."""
    out = dict(saved)
    state = saved.get("state")
    if isinstance(state, Mapping):
        out["state"] = {names.get(k, k): v for k, v in state.items()}
    out["param_groups"] = [
        {**g, "params": [names.get(p, p) for p in g["params"]]} for g in saved["param_groups"]
    ]
    return out


def _group_params(tree: object) -> list[list[Any]] | None:
    """The ``params`` of each of an optimizer state's ``param_groups``; None if it has none."""
    if not isinstance(tree, Mapping):
        return None
    groups = tree.get("param_groups")
    if not isinstance(groups, (list, tuple)) or not groups:
        return None
    params = [g.get("params") if isinstance(g, Mapping) else None for g in groups]
    if not all(isinstance(p, (list, tuple)) for p in params):
        return None
    return [list(p) for p in params]  # type: ignore[arg-type]


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[Any]:
    return list(itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups))


class _ParamNames:
    """The names DCP gives an optimizer's parameters, kept while they cannot have changed.

    DCP names a parameter after the model's module path, less the wrappers' parts
    (``torch.compile``, activation checkpointing). The names are a function of the model's
    modules and parameters and of the optimizer's parameter list; both are compared, by
    object identity, at every call (``module_memo.ModuleTree``: 0.08 ms for 190 modules).
    ``learn`` keeps the names only if remapping ``optimizer.state_dict()`` with them gives
    exactly what DCP returned (the same keys in the same order, the same state objects): not
    so for FSDP1's flattened parameters or a flattened optimizer state, which stay with DCP.
    """

    def __init__(self, params: list[Any], tree: ModuleTree, names: list[str]) -> None:
        self._params = params  # Held: their ids stay theirs.
        self._tree = tree
        self._names = names

    @classmethod
    def learn(
        cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, result: Mapping[str, Any]
    ) -> _ParamNames | None:
        """The names in ``result`` (DCP's state dict), or None where remapping would differ."""
        params = _optimizer_params(optimizer)
        if len({id(p) for p in params}) != len(params):
            return None  # A parameter twice: torch and DCP number it differently.
        try:
            names = [name for group in result["param_groups"] for name in group["params"]]
        except (KeyError, TypeError):
            return None
        if len(names) != len(params) or not all(isinstance(n, str) for n in names):
            return None
        learnt = cls(params, ModuleTree(model, NAME_PARTS), names)
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
        if not optimizer.state:
            return None  # An empty state is created by DCP.
        params = _optimizer_params(optimizer)
        if (
            len(params) != len(self._params)
            or not all(map(operator.is_, params, self._params))
            or not self._tree.same(model)
        ):
            return None
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


def _identical(ours: Any, theirs: object) -> bool:
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
