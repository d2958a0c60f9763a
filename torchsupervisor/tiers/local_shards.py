"""A rank's own part of a sharded state (FSDP2 / DTensor), as its memory tier keeps it.

Each rank of a sharded run keeps its own memory-tier snapshot, written at its step boundaries
alone (no collective, no plan): the local shards of its DTensors as plain tensors, in the
checkpoint of one process. ``local_view`` wraps each entry of the state that holds DTensors
in ``LocalShards``, whose ``state_dict`` has each DTensor's local shard in its place and whose
``load_state_dict`` turns restored shards back into DTensors of the live entry's mesh,
placements, global shape and stride before calling the entry's own ``load_state_dict``.

Such a snapshot fits only the same rank of the same layout. A local shard of another shape
is refused before anything is loaded (``InvalidArgumentError``, as for any changed shape);
the memory tier also records the world size in every snapshot's origin, so a restart at
another world size never takes one.

TF name: none.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from torchsupervisor.checkpoint.sharded.plan import is_sharded
from torchsupervisor.core.state import dtensor_class, state_entries
from torchsupervisor.errors import InvalidArgumentError

__all__ = ["LocalShards", "local_session", "local_view"]


class LocalShards:
    """A stateful entry of a sharded state whose state dict holds its local shards.

    Args:
        wrapped: The entry (an FSDP2 module, a ``ShardedOptimizerState``, any object with
            ``state_dict``/``load_state_dict`` whose state holds DTensors).
    """

    def __init__(self, wrapped: Any) -> None:
        self.wrapped = wrapped

    def _live(self) -> Any:
        wrapped = self.wrapped
        if isinstance(wrapped, torch.nn.Module):
            # The parameters themselves: ``detach`` of a DTensor is a dispatched operation.
            return wrapped.state_dict(keep_vars=True)
        return wrapped.state_dict()

    def state_dict(self) -> Any:
        """The entry's state dict with each DTensor replaced by its local shard (a view of
        the same memory; dtype and shape of the shard)."""
        with torch.no_grad():
            return _to_local(self._live(), dtensor_class())

    def load_state_dict(self, state_dict: Any) -> None:
        """Load local shards: each becomes a DTensor like the live one, then the entry loads.

        Raises:
            InvalidArgumentError: A shard's shape is not the live local shard's (another
                layout); nothing is loaded then.
        """
        restored = _as_dtensors(state_dict, self._live(), dtensor_class(), "")
        self.wrapped.load_state_dict(restored)


def local_view(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every entry that holds DTensors wrapped in ``LocalShards``.

    Args:
        state: A session's state (names to stateful objects).
    """
    return {
        name: LocalShards(obj) if is_sharded({name: obj}) else obj
        for name, obj in state_entries(state)
    }


def local_session(sess: Any) -> SimpleNamespace:
    """What a ``Saver`` takes as a session whose state is ``local_view(sess.state)``."""
    return SimpleNamespace(state=local_view(sess.state))


def _to_local(node: Any, dtensor: type | None) -> Any:
    if dtensor is not None and isinstance(node, dtensor):
        local = getattr(node, "_local_tensor", None)
        return node.to_local() if local is None else local
    if isinstance(node, Mapping):
        return {key: _to_local(value, dtensor) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_to_local(value, dtensor) for value in node)
    return node


def _as_dtensors(node: Any, live: Any, dtensor: type | None, path: str) -> Any:
    if dtensor is not None and isinstance(live, dtensor):
        shard = live.to_local()
        if not isinstance(node, torch.Tensor) or tuple(node.shape) != tuple(shard.shape):
            found = tuple(node.shape) if isinstance(node, torch.Tensor) else type(node).__name__
            raise InvalidArgumentError(
                None,
                None,
                f"The local shard of {path!r} is {found}, the live one {tuple(shard.shape)}: "
                "a snapshot of another layout",
            )
        return dtensor.from_local(
            node.to(device=shard.device, dtype=shard.dtype),
            live.device_mesh,
            live.placements,
            run_check=False,
            shape=live.shape,
            stride=live.stride(),
        )
    if isinstance(node, Mapping) and isinstance(live, Mapping):
        return {
            key: _as_dtensors(value, live.get(key), dtensor, f"{path}/{key}")
            for key, value in node.items()
        }
    if isinstance(node, (list, tuple)) and isinstance(live, (list, tuple)):
        return type(node)(
            _as_dtensors(value, live[i] if i < len(live) else None, dtensor, f"{path}/{i}")
            for i, value in enumerate(node)
        )
    return node
