"""The training state: a mapping of names to stateful objects, flattened to tensors and values.

The state is what TF kept as the graph's variables: ``{"model": module, "optimizer": opt,
"global_step": GlobalStep(), ...}``. Each entry is anything with ``state_dict()`` /
``load_state_dict()`` (modules, optimizers, schedulers, ``GlobalStep``, a stateful data loader), a
bare ``Tensor`` (restored in place), a numpy array, a plain value, or a nested mapping of those.

``flatten_state`` turns it into a *skeleton* (nested containers whose tensor leaves are
``TensorRef``) plus a flat ``{name: tensor}`` table whose names are the ``/``-joined paths
(``model/fc1.weight``, ``optimizer/state/0/exp_avg``); ``tree.py`` encodes the skeleton, and
``state_load.py`` puts a restored tree back into the live objects after checking it. The walk
itself is ``walk.walk_state`` (the one walk: the writers call it with their options and its
memo); this module holds what it is built on. Nothing here touches files.

``flatten_state`` also tells which tensors are *frozen* (``frozen=``): those an incremental
checkpoint may reference instead of copying when their version counter did not move. Version
counters miss writes made by fused optimizer kernels (``Adam(fused=True)`` updates parameters
and moments in place without a bump), by ``batch_norm`` (running statistics) and through
``.data``, so only tensors nothing in the state trains or updates qualify; see
``flatten_state``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from torchsupervisor.errors import (
    ShardedStateError,
)

__all__ = [
    "ShardedStateError",
    "TensorRef",
    "TensorSpec",
    "check_saveable",
    "dtensor_class",
    "flatten_state",
    "frozen_among",
    "is_materialized",
    "iter_state_tensors",
    "not_saveable",
    "state_entries",
    "uncompiled",
    "without_wrapper_prefix",
]

_SCALARS = (str, int, float, bool, type(None), bytes)
MISSING = object()
"""Marks an entry absent from a restored tree."""


class TensorRef(NamedTuple):
    """A tensor leaf of a skeleton: the tensor's name, and whether it was a numpy array."""

    name: str
    ndarray: bool = False


class TensorSpec(NamedTuple):
    """What a checkpoint holds for one tensor, without its data.

    Attributes:
        name: The tensor's name in the checkpoint.
        dtype: Its dtype in the checkpoint.
        shape: Its shape in the checkpoint.
        ndarray: True if it was saved from a numpy array.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    ndarray: bool = False


def dtensor_class() -> type | None:
    """The DTensor class if it was imported (no DTensor can exist otherwise), else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


_COMPILED_PREFIX = "_orig_mod."
_REPLICATED_PREFIX = "module."


def uncompiled(obj: object) -> Any:
    """The module a ``torch.compile`` wrapper compiles or a data-parallel wrapper
    (``DistributedDataParallel``, ``DataParallel``) replicates, or ``obj`` itself.

    ``torch.compile(model)`` returns an ``OptimizedModule`` whose ``state_dict`` names every
    entry ``_orig_mod.<name>``, and ``DistributedDataParallel(model)`` one that names them
    ``module.<name>``: checkpointed as they are, a compiled or DDP run's checkpoint would not
    load into a plain model (one process, evaluation) nor an FSDP2 one, and the other way
    round. The state is saved and restored through the wrapped module instead, so compiling
    or wrapping never changes a checkpoint (as DCP's ``get_state_dict`` names them).
    """
    if not isinstance(obj, torch.nn.Module):
        return obj
    compiled = None
    if "torch._dynamo" in sys.modules:
        compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    while True:
        if isinstance(obj, _DATA_PARALLEL):
            obj = obj.module
        elif compiled is not None and isinstance(obj, compiled):
            obj = obj._orig_mod
        else:
            return obj


_DATA_PARALLEL = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)


def without_wrapper_prefix(value: object, module: object = None) -> Any:
    """A module's saved entries without the prefixes a wrapper's ``state_dict`` gave them
    (``_orig_mod.``: a compiled model; ``module.``: DDP or ``DataParallel``; checkpoints by
    other tools or older versions), a prefix at a time while every entry has it; else
    ``value``. ``module`` (the unwrapped live module): ``module.`` is kept where it has a
    child of that name."""
    own = getattr(module, "_modules", {})
    while isinstance(value, Mapping) and value:
        for prefix in (_COMPILED_PREFIX, _REPLICATED_PREFIX):
            if prefix == _REPLICATED_PREFIX and "module" in own:
                continue
            if all(isinstance(k, str) and k.startswith(prefix) for k in value):
                value = {k[len(prefix) :]: v for k, v in value.items()}
                break
        else:
            return value
    return value


def is_materialized(tensor: torch.Tensor) -> bool:
    """Return False for tensors without data: on the ``meta`` device or lazy (uninitialized)."""
    if isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin):
        return False
    return not tensor.is_meta


def join_path(prefix: str, key: object) -> str:
    """The state path of ``key`` below ``prefix`` (``model`` + ``fc1.weight``)."""
    return f"{prefix}/{key}" if prefix else str(key)


def _children(obj: object) -> Any:
    """Return what a stateful object stands for in the tree (its state_dict), or the object."""
    if isinstance(obj, (torch.Tensor, np.ndarray, Mapping, list, tuple, *_SCALARS)):
        return obj
    obj = uncompiled(obj)
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict):
        return state_dict()
    return obj


def iter_state_tensors(state: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in the state, without checking the tensors.

    Non-tensor leaves and unsupported types are skipped; this is for inspection (e.g. finding
    uninitialized parameters), not for saving.
    """

    def walk(obj: object, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        obj = _children(obj)
        if isinstance(obj, torch.Tensor):
            yield path, obj
        elif isinstance(obj, Mapping):
            for key, value in obj.items():
                yield from walk(value, join_path(path, key))
        elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
            for i, value in enumerate(obj):
                yield from walk(value, join_path(path, i))

    for key, value in state.items():
        yield from walk(value, str(key))


def not_saveable(path: str, obj: object) -> TypeError:
    """The error for a state entry the format cannot hold (no pickle)."""
    return TypeError(
        f"Cannot save {path!r}: objects of type "
        f"{type(obj).__module__}.{type(obj).__qualname__} have no state_dict() and are not "
        "tensors, arrays, containers or plain values (checkpoints never use pickle)"
    )


def state_entries(state: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """The ``(name, object)`` entries of ``state``.

    Raises:
        TypeError: A name is not a ``str``.
    """
    for key, value in state.items():
        if not isinstance(key, str):
            raise TypeError(f"State names must be str, got {type(key).__name__}: {key!r}")
        yield key, value


def flatten_state(
    state: Mapping[str, Any], *, frozen: set[str] | None = None
) -> tuple[dict[Any, Any], dict[str, torch.Tensor]]:
    """Split the state into a skeleton and a flat table of tensors.

    Args:
        state: Mapping of names (str) to stateful objects, tensors, arrays or values.
        frozen: If given, receives the names of the tensors that nothing in the state can
            modify without bumping their version counter, as far as the state tells: the
            tensors of a module's state dict (and bare tensors of the state without
            ``requires_grad``) that share no memory with a trainable parameter
            (``requires_grad=True``) of a module of the state, with a parameter that an
            optimizer of the state has a gradient or state for, or with a buffer of a
            module in training mode (``batch_norm`` updates running statistics without a
            bump). Never frozen: an optimizer's state (``exp_avg``, ``step``, ...), the
            tensors of other stateful objects' state dicts, numpy arrays. Writes that bypass
            PyTorch (``.data``, numpy views, DLPack) are not seen here either.

    Returns:
        ``(skeleton, tensors)``. The skeleton mirrors the state dicts with ``TensorRef`` leaves in
        place of tensors and arrays; ``tensors`` maps each ``TensorRef.name`` to a tensor
        outside autograd (any device): a tensor or parameter that requires grad, and any
        ``Parameter``, detached; a plain tensor that does not, itself; numpy arrays wrapped
        with ``torch.from_numpy``. Two paths that would give the same name (keys containing
        ``/``) get ``#1``, ``#2`` ... suffixes.

    Raises:
        TypeError: For a leaf that cannot be saved without pickle (naming its path and type),
            or a dict key that is not a str/int/float/bool/None.
        ValueError: For a tensor that cannot be saved: uninitialized (meta device or lazy),
            sparse, quantized, or otherwise not a plain strided tensor.
        ShardedStateError: (a ``ValueError``) For a ``DTensor``: the state is sharded.
    """
    from torchsupervisor.core.walk import walk_state  # The walk builds on this module.

    return walk_state(state, sharded=False, frozen=frozen)


def frozen_among(
    candidates: list[str], tensors: Mapping[str, torch.Tensor], stateful: list[Any]
) -> list[str]:
    """The frozen tensors among ``candidates`` (``flatten_state(frozen=...)``).

    Args:
        candidates: Names of the tensors of a module's state dict or bare in the state, that
            did not require gradients.
        tensors: The flat table of the state's tensors, by name.
        stateful: The modules, optimizers and other stateful objects of the state: the
            memory of a module's trainable parameters and training-mode buffers, and of the
            parameters an optimizer may update, is volatile.

    Returns:
        The candidates that share no memory with a volatile tensor, in order; none when a
        volatile tensor's memory is unknown (a trainable wrapper subclass may share it with
        any candidate).
    """
    if not candidates:
        return []  # Nothing to tell apart: the volatile memory is not read.
    volatile: set[tuple[int, int] | None] = set()
    for obj in stateful:
        if isinstance(obj, torch.nn.Module):
            volatile.update(_module_volatile_storages(obj))
        elif isinstance(obj, torch.optim.Optimizer):
            volatile.update(_optimizer_volatile_storages(obj))
    if None in volatile:
        return []
    keys = map(_storage_key, map(tensors.__getitem__, candidates))
    return [name for name, key in zip(candidates, keys) if key is not None and key not in volatile]


def _storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    """Identifies the memory a tensor lives in (views of one storage share the key).

    None for a tensor without storage of its own (a wrapper subclass such as ``DTensor``):
    never frozen itself, and, if it is volatile, nothing else is either.
    """
    try:
        return tensor.get_device(), tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _module_volatile_storages(module: torch.nn.Module) -> Iterator[tuple[int, int] | None]:
    """The memory of a module's trainable parameters and of its training-mode buffers."""
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and p.requires_grad:
                yield _storage_key(p)
        if m.training:
            for b in m._buffers.values():
                if b is not None:
                    yield _storage_key(b)


def _optimizer_volatile_storages(
    optimizer: torch.optim.Optimizer,
) -> Iterator[tuple[int, int] | None]:
    """The memory of the parameters an optimizer may update at its next step.

    A parameter the optimizer has a gradient or state for may be updated (a frozen parameter
    with a stale gradient, one trained before it was frozen); torch's optimizers skip the
    others.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad or p.grad is not None or p in optimizer.state:
                yield _storage_key(p)


# Where a tensor of the state comes from (``flatten_state(frozen=...)``).
_BARE, _MODULE, _OTHER = 0, 1, 2

MAX_STATE_DEPTH = 64
"""The deepest nesting of containers (mappings, lists, tuples, state dicts) below a state
entry that a checkpoint holds; deeper states are refused at save (a manifest nesting deeper is
treated as damage when read)."""

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def check_saveable(tensor: torch.Tensor, path: str) -> None:
    """Check that ``tensor`` (at state path ``path``) can be written to a checkpoint.

    Raises:
        ShardedStateError: For a ``DTensor`` (it needs ``save_sharded``).
        ValueError: For a tensor that is uninitialized (meta device or lazy), not strided,
            quantized, or of a tensor subclass.
    """
    if (  # The common case first (once per tensor per save): a plain strided tensor.
        type(tensor) in _PLAIN_TENSOR_TYPES
        and tensor.layout is torch.strided
        and not tensor.is_meta
        and not tensor.is_quantized
    ):
        return
    dtensor = dtensor_class()
    if dtensor is not None and isinstance(tensor, dtensor):
        raise ShardedStateError(path)
    if not is_materialized(tensor):
        raise ValueError(f"Cannot save {path!r}: it is not initialized (meta device or lazy)")
    if tensor.layout is not torch.strided:
        raise ValueError(f"Cannot save {path!r}: layout {tensor.layout} is not supported")
    if tensor.is_quantized:
        raise ValueError(f"Cannot save {path!r}: quantized tensors are not supported")
    if type(tensor) not in _PLAIN_TENSOR_TYPES:
        raise ValueError(
            f"Cannot save {path!r}: tensor subclass {type(tensor).__name__} is not supported"
        )
