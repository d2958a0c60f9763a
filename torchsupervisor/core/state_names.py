"""The name an object has in the state, found by identity: TF's "names from the variables".

TF's ``Saver([v1, v2])`` saved each variable under its own op name. A tensor here has no
name of its own: its name is its path in the session's state, the one a checkpoint of the
whole state gives it (``model/fc1.weight``, a sub-module's ``model/backbone``). So a list
of objects is named by looking each one up, by identity, among the state's entries, their
nested mappings and lists, and the modules' sub-modules, parameters and buffers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from torchsupervisor.core.state import join_path, uncompiled

__all__ = ["check_var_list", "describe", "name_in_state", "select_state"]


def check_var_list(var_list: Any) -> None:
    """Check a ``var_list`` as far as it can be without the session's state.

    Raises:
        TypeError: For a ``var_list`` that is not None, a mapping or a list/tuple, or a list
            item that is neither a state name (``str``) nor a tensor or stateful object
            (anything with ``state_dict()``), naming the item.
    """
    if var_list is None or isinstance(var_list, Mapping):
        return
    if not isinstance(var_list, (list, tuple)):
        raise TypeError(
            "var_list must be None, a mapping of names to stateful objects, or a list of state "
            f"names, tensors and stateful objects; got {type(var_list).__name__}"
        )
    for i, item in enumerate(var_list):
        if not isinstance(item, (str, torch.Tensor)) and not callable(
            getattr(item, "state_dict", None)
        ):
            raise TypeError(
                f"var_list item {i} must be a state name, a tensor or a stateful object (with "
                f"state_dict()); got {type(item).__name__}"
            )


def describe(obj: object) -> str:
    """A short description of ``obj`` for an error (never its values)."""
    if isinstance(obj, torch.Tensor):
        return f"a {type(obj).__name__} of shape {list(obj.shape)} and dtype {obj.dtype}"
    return f"a {type(obj).__name__}"


def _named(value: object, path: str) -> Iterator[tuple[str, Any]]:
    """Every object reachable from ``value`` at ``path``, with its path."""
    yield path, value
    value = uncompiled(value)
    if isinstance(value, torch.nn.Module):
        for name, module in value.named_modules(remove_duplicate=False):
            if name:
                yield join_path(path, name), module
        for name, tensor in value.named_parameters(remove_duplicate=False):
            yield join_path(path, name), tensor
        for name, tensor in value.named_buffers(remove_duplicate=False):
            yield join_path(path, name), tensor
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _named(item, join_path(path, key))
    elif isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        for i, item in enumerate(value):
            yield from _named(item, join_path(path, i))


def name_in_state(state: Mapping[str, Any], obj: object, index: int) -> str:
    """The path of ``obj`` in ``state`` (the first one when it is reachable twice).

    Args:
        state: The session's state.
        obj: A tensor, module, optimizer or other stateful object of the state.
        index: Its place in the saver's list, for the error.

    Returns:
        A ``/``-joined path: ``"model/fc1.weight"``, ``"model/backbone"``, ``"optimizer"``.

    Raises:
        ValueError: If ``obj`` is not in ``state``, naming its place in the list.
    """
    for key, value in state.items():
        for path, found in _named(value, str(key)):
            if found is obj:
                return path
    raise ValueError(
        f"var_list item {index} ({describe(obj)}) is not in the session's state "
        f"(entries {sorted(state)}): add it to the state, or give it a name with a mapping, "
        "Saver({'name': obj})"
    )


def select_state(state: Mapping[str, Any], var_list: Any) -> Mapping[str, Any]:
    """Return the part of ``state`` that a saver with ``var_list`` covers.

    Args:
        state: The session's state.
        var_list: None (the whole state); a mapping of names to stateful objects (used as
            is); or a list/tuple whose items are names of ``state`` entries or objects of the
            state (tensors, modules, optimizers...), each saved under its path in the state
            (``name_in_state``), as TF's ``Saver([var1, var2])`` named them by the variables.

    Returns:
        ``{name: object}``: ``{"model/fc1.weight": tensor, "optimizer": opt}``.

    Raises:
        ValueError: If a listed name or object is not in the state.
        TypeError: For another kind of ``var_list`` or list item (``check_var_list``).
    """
    check_var_list(var_list)
    if var_list is None:
        return state
    if isinstance(var_list, Mapping):
        return var_list
    missing = [item for item in var_list if isinstance(item, str) and item not in state]
    if missing:
        raise ValueError(f"var_list names {missing} are not in the state ({sorted(state)})")
    selected: dict[str, Any] = {}
    for i, item in enumerate(var_list):
        if isinstance(item, str):
            selected[item] = state[item]
        else:
            selected[name_in_state(state, item, i)] = item
    return selected
