"""Loading a restored tree back into the live state, after checking that it fits.

``check_state`` compares what a checkpoint holds (a tree of ``TensorSpec``: dtypes and shapes,
no data) with the live state before anything is loaded, so a restore that cannot succeed fails
with the state untouched; ``load_state`` then puts the restored values into the live objects
(``load_state_dict``, in-place copies for bare tensors). ``find_subtree`` finds the value of an
entry by its ``/`` path, for a ``Saver`` whose ``var_list`` names part of a bigger checkpoint.

TF name: the restore half of ``tf.compat.v1.train.Saver``'s restore ops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from torchsupervisor.core.state import (
    MISSING,
    TensorSpec,
    join_path,
    uncompiled,
    without_wrapper_prefix,
)
from torchsupervisor.errors import InvalidArgumentError, NotFoundError

__all__ = ["check_state", "copy_tensor", "find_subtree", "load_state"]


def find_subtree(tree: Mapping[Any, Any], name: str) -> Any:
    """Find the restored value for a state entry called ``name``.

    ``name`` is looked up as a key first, then as a ``/`` path; at each level the rest of the
    path is tried as one key too (``"ema/local3/weight_loss"``: an EMA's scoped name). A path
    that enters a module's flat state dict continues with ``.``-joined parts, so
    ``"model/backbone"`` finds the ``backbone.*`` entries of ``tree["model"]`` (restoring a
    sub-module from a full checkpoint).

    Returns:
        The value, or raises.

    Raises:
        KeyError: If nothing matches.
    """
    if name in tree:
        return tree[name]
    parts = name.split("/")
    node: object = tree
    for i, part in enumerate(parts):
        if not isinstance(node, Mapping):
            raise KeyError(name)
        rest = "/".join(parts[i:])
        if i and rest in node:  # A key holding "/" itself (an EMA's "local3/weight_loss").
            return node[rest]
        key = _match_key(node, part)
        if key is not MISSING:
            node = node[key]
            continue
        prefix = ".".join(parts[i:]) + "."
        sub = {
            k[len(prefix) :]: v
            for k, v in node.items()
            if isinstance(k, str) and k.startswith(prefix)
        }
        if not sub:
            raise KeyError(name)
        return sub
    return node


def _match_key(node: Mapping[Any, Any], part: str) -> Any:
    if part in node:
        return part
    if part.lstrip("-").isdigit() and int(part) in node:
        return int(part)
    return MISSING


OnMissing = Callable[[str], None] | None
"""Called with the path of an entry the tree lacks (None: a missing entry is an error)."""


def _present(
    state: Mapping, tree: Mapping, source: str, on_missing: OnMissing
) -> Iterator[tuple[str, Any, Any]]:
    """``(name, object, restored value)`` of each entry of ``state`` that ``tree`` has.

    Raises:
        NotFoundError: An entry ``tree`` lacks, without ``on_missing`` (else it is told).
    """
    for name, obj in state.items():
        try:
            value = find_subtree(tree, name)
        except KeyError:
            if on_missing is None:
                raise NotFoundError(f"Key {name} not found in checkpoint {source}") from None
            on_missing(name)
            continue
        yield name, obj, value


def load_state(state: Mapping, tree: Mapping, *, source: str, on_missing: OnMissing = None) -> None:
    """Load a restored tree into the live objects of ``state``.

    Objects with ``load_state_dict`` receive their sub-tree; tensors and numpy arrays are
    copied into in place (same shape required); a nested mapping is loaded key by key, and
    a mutable one also receives the checkpoint's keys it lacks; other values are replaced in
    their (mutable) container.

    Args:
        state: Mapping of names to stateful objects (the session state or a saver's var_list).
        tree: The restored tree (tensors in place of ``TensorRef``), as read from a checkpoint.
        source: The checkpoint prefix, for error messages.
        on_missing: Called with the name of a state entry absent from the checkpoint; when
            None, an absent entry raises ``NotFoundError``.

    Raises:
        NotFoundError: ``"Key <name> not found in checkpoint <source>"``.
        InvalidArgumentError: If a value does not fit its object (shape mismatch, a module's
            missing or unexpected keys, ...), naming the entry and the checkpoint.
    """
    for name, obj, value in _present(state, tree, source, on_missing):
        _load_one(state, name, obj, value, name, source)


def copy_tensor(dest: torch.Tensor, value: torch.Tensor, mismatch: str) -> None:
    """Copy ``value`` into ``dest`` in place (any dtype/device conversion ``copy_`` does).

    Raises:
        InvalidArgumentError: With the message ``mismatch``, if the shapes differ.
    """
    if tuple(dest.shape) != tuple(value.shape):
        raise InvalidArgumentError(mismatch)
    with torch.no_grad():
        dest.copy_(value)


def _load_one(
    container: Any, key: object, obj: object, value: object, path: str, source: str
) -> None:
    if isinstance(obj, torch.nn.Module):
        obj = uncompiled(obj)
        value = without_wrapper_prefix(value, obj)
    if isinstance(obj, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentError(
                f"{path!r} is a tensor in the state but {type(value).__name__} in {source}"
            )
        copy_tensor(
            obj,
            value,
            (
                f"Shape of {path!r} in the state {tuple(obj.shape)} does not match the "
                f"checkpoint {source}: {tuple(value.shape)}"
            ),
        )
        return
    if isinstance(obj, np.ndarray):
        array = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        if obj.shape != array.shape:
            raise InvalidArgumentError(
                f"Shape of {path!r} in the state {obj.shape} does not match the checkpoint "
                f"{source}: {array.shape}"
            )
        np.copyto(obj, array)
        return
    load = getattr(obj, "load_state_dict", None)
    if callable(load) and not isinstance(obj, Mapping):
        try:
            load(value)
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
            raise InvalidArgumentError(f"Restoring {path!r} from {source} failed: {e}") from e
        return
    if isinstance(obj, Mapping) and isinstance(value, Mapping):
        for sub_key in obj:
            if sub_key not in value:
                raise NotFoundError(f"Key {path}/{sub_key} not found in checkpoint {source}")
        for sub_key, sub_value in value.items():
            if sub_key in obj:
                _load_one(obj, sub_key, obj[sub_key], sub_value, f"{path}/{sub_key}", source)
            elif isinstance(obj, MutableMapping):
                obj[sub_key] = sub_value
        return
    if isinstance(container, MutableMapping):
        container[key] = value
        return
    raise InvalidArgumentError(
        f"Cannot restore {path!r}: {type(obj).__name__} has no load_state_dict() and its "
        "container is not a mutable mapping"
    )


# ------------------------------------------------------------------------------- checking

# Conversions towards a lower kind would change values beyond rounding (2.7 -> 2, 3 -> True).
_BOOL, _INTEGER, _FLOATING, _COMPLEX = range(4)


def _dtype_kind(dtype: torch.dtype) -> int:
    if dtype.is_complex:
        return _COMPLEX
    if dtype.is_floating_point:
        return _FLOATING
    if dtype == torch.bool:
        return _BOOL
    return _INTEGER


def _numpy_dtype(array: np.ndarray) -> torch.dtype | None:
    try:
        return torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype
    except TypeError:
        return None


def check_state(
    state: Mapping, tree: Mapping, *, source: str, on_missing: OnMissing = None
) -> list[str]:
    """Check that a checkpoint fits the live state, before loading anything.

    Walks ``state`` as ``load_state`` would, against a tree whose tensor leaves are
    ``TensorSpec`` (read from the manifest alone), and compares every tensor present on both
    sides, including those inside state dicts (a module's parameters, an optimizer's state).
    Nothing is modified.

    Dtypes: a tensor saved with another dtype of the same or a lower kind (bool < integer <
    floating < complex; e.g. float32 saved, float64 live) is converted when loaded, with a
    warning returned here; towards a lower kind (floating saved, integer live) it is an error.

    Args:
        state: Mapping of names to stateful objects (the session state or a saver's var_list).
        tree: The checkpoint's tree with ``TensorSpec`` leaves.
        source: The checkpoint prefix, for messages.
        on_missing: Called with the name of a state entry absent from the checkpoint (it may
            raise); None: an absent entry raises ``NotFoundError``.

    Returns:
        Warnings to report (dtype conversions), one message each.

    Raises:
        NotFoundError: ``"Key <name> not found in checkpoint <source>"`` for an absent entry.
        InvalidArgumentError: For a shape mismatch (naming the entry, the checkpoint and both
            shapes), a dtype that cannot be converted, a tensor in the state that is not a
            tensor in the checkpoint, or a module whose keys differ from the checkpoint's.
    """
    warnings: list[str] = []
    checks = []
    for name, obj, value in _present(state, tree, source, on_missing):
        checks.append((obj, value, name))
    for obj, value, name in checks:
        _check_one(obj, value, name, source, warnings)
    return warnings


def _check_spec(
    path: str,
    shape: tuple[int, ...],
    dtype: torch.dtype | None,
    spec: TensorSpec,
    source: str,
    warnings: list[str],
) -> None:
    if tuple(shape) != tuple(spec.shape):
        raise InvalidArgumentError(
            f"Shape of {path!r} in the state {tuple(shape)} does not match the checkpoint "
            f"{source}: {tuple(spec.shape)} (nothing was restored)"
        )
    if dtype is None or dtype == spec.dtype:
        return
    saved, live = str(spec.dtype).removeprefix("torch."), str(dtype).removeprefix("torch.")
    if _dtype_kind(dtype) < _dtype_kind(spec.dtype):
        raise InvalidArgumentError(
            f"Dtype of {path!r} in the state ({live}) cannot hold the checkpoint's values: "
            f"{saved} in {source} (nothing was restored)"
        )
    warnings.append(
        f"Dtype of {path!r} changed: {saved} in checkpoint {source}, {live} in the state; "
        "its values are converted"
    )


def _check_one(obj: object, value: object, path: str, source: str, warnings: list[str]) -> None:
    if isinstance(obj, torch.nn.Module):
        obj = uncompiled(obj)
        value = without_wrapper_prefix(value, obj)
    if isinstance(obj, torch.Tensor):
        if not isinstance(value, TensorSpec):
            raise InvalidArgumentError(
                f"{path!r} is a tensor in the state but {type(value).__name__} in {source}"
            )
        _check_spec(path, tuple(obj.shape), obj.dtype, value, source, warnings)
        return
    if isinstance(obj, np.ndarray):
        if isinstance(value, TensorSpec):
            _check_spec(path, obj.shape, _numpy_dtype(obj), value, source, warnings)
        return
    load = getattr(obj, "load_state_dict", None)
    if callable(load) and not isinstance(obj, Mapping):
        module = isinstance(obj, torch.nn.Module)
        if module and _custom_loading(obj):
            return  # It may rename, reshape or fill in entries: only loading can tell.
        try:
            live = obj.state_dict()
        except Exception:
            return  # Loading reports it.
        if module and isinstance(live, Mapping) and isinstance(value, Mapping):
            missing = [k for k in live if k not in value]
            unexpected = [k for k in value if k not in live]
            if missing or unexpected:
                raise InvalidArgumentError(
                    f"Restoring {path!r} from {source} failed: missing keys {missing}, "
                    f"unexpected keys {unexpected} (nothing was restored)"
                )
        _check_contents(live, value, path, source, warnings)
        return
    if isinstance(obj, Mapping) and isinstance(value, Mapping):
        for sub_key in obj:
            if sub_key not in value:
                raise NotFoundError(f"Key {path}/{sub_key} not found in checkpoint {source}")
        for sub_key in obj:
            _check_one(obj[sub_key], value[sub_key], f"{path}/{sub_key}", source, warnings)


def _custom_loading(module: torch.nn.Module) -> bool:
    """True if a sub-module loads its state dict its own way (load hooks, or its own
    ``_load_from_state_dict`` outside PyTorch)."""
    for m in module.modules():
        if m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks:
            return True
        loader = type(m)._load_from_state_dict
        if loader is not torch.nn.Module._load_from_state_dict and not (
            loader.__module__ or ""
        ).startswith("torch."):
            return True
    return False


def _check_contents(
    live: object, value: object, path: str, source: str, warnings: list[str]
) -> None:
    """Compare the tensors of a live state dict with the checkpoint's, where both have one."""
    if isinstance(live, torch.Tensor):
        if isinstance(value, TensorSpec):
            _check_spec(path, tuple(live.shape), live.dtype, value, source, warnings)
    elif isinstance(live, Mapping) and isinstance(value, Mapping):
        for key, sub in live.items():
            if key in value:
                _check_contents(sub, value[key], join_path(path, key), source, warnings)
    elif (
        isinstance(live, (list, tuple))
        and isinstance(value, (list, tuple))
        and len(live) == len(value)
    ):
        for i, (sub, saved) in enumerate(zip(live, value)):
            _check_contents(sub, saved, join_path(path, i), source, warnings)
