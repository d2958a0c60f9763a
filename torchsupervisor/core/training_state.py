"""``TrainingState``: the user's own state mapping, plus the entries the library adds.

A Supervisor or a session creator must save what the training loop changes, and a restore must
give it back where the loop reads it. A copy of the mapping given (``dict(state)``) does
neither for a plain value: ``state = {..., "best": 1e9}`` then ``state["best"] = loss`` saved
1e9 forever. So the library keeps the mapping itself, and puts what it adds (the RNG state
under ``"rng"``, a global step found in the graph's collection) beside it rather than into it.

TF name: none (TF's variables lived in the graph).
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

__all__ = ["SharedEntries", "TrainingState", "is_per_rank", "shared_entries"]

_MAX_CHECK_DEPTH = 64


class TrainingState(ChainMap):
    """The user's state mapping as the library holds it (see the module docstring).

    A ``ChainMap`` of the user's mapping, then the library's own entries. Reads see the user's
    mapping as it is *now*: a plain value the loop updates (``state["best"] = x``) is what the
    next checkpoint saves, and an entry added later is saved too. A restore writes a plain
    value back into the user's mapping (``state["best"]`` is the restored value), and loads the
    other entries in place. The user's mapping never receives the library's entries.

    Args:
        user: The mapping of names to stateful objects, tensors, arrays or plain values that
            the user passed (kept, never copied); None: an empty one of the library's own.
            A ``TrainingState`` is taken as it is (``TrainingState.of``).

    Raises:
        TypeError: The user's mapping (or a nested mapping in it) holds a plain value (a
            number, a string, a list, ...) but cannot be changed (a ``MappingProxyType``,
            say): a restore could not put the value back. The message names the entry.

    Thread safety: as the user's mapping.

    TF name: none.
    """

    def __init__(self, user: Mapping[str, Any] | None = None) -> None:
        user = {} if user is None else user
        _check_restorable(user, "state", 0)
        super().__init__(user, {})  # type: ignore[arg-type]

    @classmethod
    def of(cls, state: Mapping[str, Any] | None) -> TrainingState:
        """``state`` itself if it is a ``TrainingState``, else one holding it."""
        return state if isinstance(state, TrainingState) else cls(state)

    @property
    def user(self) -> Mapping[str, Any]:
        """The user's own mapping."""
        return self.maps[0]

    def add(self, name: str, obj: object) -> None:
        """Add an entry of the library's own (the user's mapping does not receive it)."""
        self.maps[1][name] = obj

    def __repr__(self) -> str:
        return f"TrainingState({dict(self)!r})"


def _check_restorable(mapping: Mapping[str, Any], path: str, depth: int) -> None:
    """Raise ``TypeError`` for a plain value in a mapping a restore cannot change."""
    if depth > _MAX_CHECK_DEPTH:
        return  # ``walk_state`` reports a state nested this deep (or holding itself).
    mutable = isinstance(mapping, MutableMapping)
    for key, value in mapping.items():
        where = f"{path}[{key!r}]"
        if isinstance(value, Mapping):
            _check_restorable(value, where, depth + 1)
        elif not mutable and _plain(value):
            raise TypeError(
                f"{where} is a plain value ({type(value).__name__}) in a "
                f"{type(mapping).__name__}, which a restore cannot change: pass a dict (it "
                "is kept, not copied: what the loop sets in it is saved, and a restore sets "
                "it back), or hold the value in an object with state_dict() and "
                "load_state_dict()"
            )


def _plain(value: object) -> bool:
    """True for a value restored by replacing it in its container (not loaded in place)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return False
    return not callable(getattr(value, "load_state_dict", None))


def is_per_rank(obj: object) -> bool:
    """True for a state entry that each replica keeps for itself: its class says
    ``per_rank = True`` (``InputPipelineState``: each rank's queues hold its own batches).

    A replica never receives another rank's per-rank entries (the chief's broadcast leaves
    them out), and a checkpoint, which holds the chief's (rank 0's), is not loaded into them
    on another rank: each of the other ranks starts its own from where its construction put
    it (its first batch). Entries that hold a position every rank shares (a
    ``ResumableDataLoader``: the batches consumed, equal on every rank of a data-parallel run)
    are not per rank.
    """
    return getattr(type(obj), "per_rank", False) is True


def shared_entries(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state`` without its per-rank entries (``is_per_rank``): what every replica shares.

    Returns ``state`` itself when it has none, else a ``SharedEntries`` view of it.
    """
    if not any(is_per_rank(value) for value in state.values()):
        return state
    return SharedEntries(state)


class SharedEntries(MutableMapping):
    """A view of a state without its per-rank entries; a restored plain value is written
    through to the state (``shared_entries``).

    Args:
        state: The state.

    TF name: none.
    """

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state
        self.per_rank = [name for name, value in state.items() if is_per_rank(value)]

    def __getitem__(self, name: str) -> Any:
        if name in self.per_rank:
            raise KeyError(name)
        return self.state[name]

    def __setitem__(self, name: str, value: object) -> None:
        self.state[name] = value  # type: ignore[index]

    def __delitem__(self, name: str) -> None:
        raise TypeError("SharedEntries is a view: entries cannot be removed")

    def __iter__(self) -> Iterator[str]:
        return (name for name in self.state if name not in self.per_rank)

    def __len__(self) -> int:
        return len(self.state) - len(self.per_rank)
