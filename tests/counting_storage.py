"""A local storage that counts the bytes it reads: what a restore read, against what it holds
(``held_bytes``)."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor

from torchsupervisor.core.walk import walk_state
from torchsupervisor.storage import LocalStorage


def held_bytes(state: Any) -> int:
    """The bytes of the tensors this rank holds of ``state`` (a DTensor's local shard)."""
    _, tensors = walk_state(state)
    return sum(
        (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()
        for t in tensors.values()
    )


class CountingStorage(LocalStorage):
    """The local storage, counting the bytes read (``bytes_read``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_read = 0

    def open_read(self, path: str, *, inside: str | None = None):
        f = super().open_read(path, inside=inside)
        read = f.readinto

        def counted(view, offset):
            n = read(view, offset)
            self.bytes_read += n
            return n

        f.readinto = counted
        return f
