"""What a sharded restore reads: a fresh tensor for each checkpoint tensor the state needs.

``load_sharded`` hands DCP one target per checkpoint tensor that some entry of the live state
loads, made like the live tensor (a DTensor of the same mesh and placements: DCP then plans
only this rank's rows). The checkpoint's names are mapped to the live ones first where they
differ: a plain optimizer's state keyed by parameter positions restored into a
``ShardedOptimizerState`` (``plan.positions_to_names``), and a module saved with a wrapper's
prefix (``torch.compile``'s ``_orig_mod.``, DDP's ``module.``; ``state.without_wrapper_prefix``).

TF name: none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torchsupervisor.checkpoint.format import ManifestError
from torchsupervisor.checkpoint.sharded.metadata import ShardedManifest
from torchsupervisor.checkpoint.sharded.plan import (
    ShardedOptimizerState,
    positions_to_names,
    rename_positions,
)
from torchsupervisor.core.state import TensorRef, uncompiled, without_wrapper_prefix
from torchsupervisor.core.state_load import find_subtree
from torchsupervisor.core.tree import decode_tree
from torchsupervisor.core.walk import walk_state
from torchsupervisor.errors import CorruptCheckpointError, InvalidArgumentError

__all__ = ["load_targets"]


def load_targets(
    state: Mapping[str, Any], manifest: ShardedManifest, prefix: str
) -> tuple[dict[str, torch.Tensor], dict[str, dict[int, str]]]:
    """Fresh tensors to read the needed checkpoint tensors into, sharded like the live ones
    (a plain optimizer's state, or a module saved with a wrapper's prefix, like the live
    tensors it loads into); and the positions to rename, by state entry
    (``plan.rename_positions``, which ``load_sharded`` applies to the values read)."""
    try:
        template = decode_tree(manifest.tree, lambda name, ndarray: TensorRef(name, ndarray))
    except ManifestError as e:
        index = prefix + ".index"
        raise CorruptCheckpointError(
            f"Checkpoint index {index} is corrupt: {e}", path=index, reason=str(e)
        ) from None
    if not isinstance(template, Mapping):
        raise CorruptCheckpointError(
            f"Checkpoint index {prefix}.index is corrupt: its tree is not a mapping",
            path=prefix + ".index",
            reason="bad tree",
        )
    skeleton, live = walk_state(state)
    renames: dict[str, dict[int, str]] = {}
    needed: dict[str, str] = {}  # Checkpoint tensor name: the live tensor's name.
    for name in state:
        try:
            subtree = find_subtree(template, name)
        except KeyError:
            continue  # Reported by load_state (NotFoundError) once every rank has read.
        renamed = None  # The entry's path where its live names differ from the saved ones.
        entry = state[name]
        if isinstance(entry, ShardedOptimizerState):
            names = positions_to_names(subtree, skeleton.get(name))
            if names is not None:  # A plain optimizer's state (DDP): read as the live one's.
                renames[name] = names
                subtree, renamed = rename_positions(subtree, names), name
        elif isinstance(entry, torch.nn.Module):  # Saved with a wrapper's prefix?
            plain = without_wrapper_prefix(subtree, uncompiled(entry))
            if plain is not subtree:  # ``load_state`` drops it too.
                subtree, renamed = plain, name
        _collect_refs(subtree, needed, renamed)
    specs = manifest.tensor_specs()
    targets: dict[str, torch.Tensor] = {}
    for name in sorted(needed):
        if name not in specs:
            raise CorruptCheckpointError(
                f"Checkpoint index {prefix}.index is corrupt: the tree names an unknown tensor "
                f"{name!r}",
                path=prefix + ".index",
                reason="unknown tensor",
            )
        dtype, shape = specs[name]
        current = live.get(needed[name])
        if current is None:
            targets[name] = torch.empty(shape, dtype=dtype)
            continue
        if tuple(current.shape) != shape:
            raise InvalidArgumentError(
                f"Shape of {needed[name]!r} in the state {tuple(current.shape)} does not match "
                f"the checkpoint {prefix}: {shape}"
            )
        targets[name] = torch.empty_like(current)
    return targets, renames


def _collect_refs(node: object, out: dict[str, str], path: str | None = None) -> None:
    """``out[checkpoint tensor name] = live tensor name`` for the tensors under ``node``: the
    same name, or (``path`` given: a renamed subtree) the path of the tensor in it."""
    if isinstance(node, TensorRef):
        out[node.name] = node.name if path is None else path
    elif isinstance(node, Mapping):
        for key, value in node.items():
            _collect_refs(value, out, None if path is None else f"{path}/{key}")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _collect_refs(value, out, None if path is None else f"{path}/{i}")
