"""Storages that count the bytes they read (a local one; a bucket's, by the bytes its GETs
fetched): what a restore read, against what it holds (``held_bytes``)."""

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


def counting_object_storage(url: str) -> Any:
    """An ``ObjectStorage`` on ``url``'s bucket whose ``bytes_read`` counts the bytes its
    GETs fetched (read-ahead included)."""
    from torchsupervisor.storage import storage_for
    from torchsupervisor.storage.objects import ObjectStorage

    client = storage_for(url).client

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(client, name)

        def get_range(self, key: str, offset: int, length: int) -> bytes:
            data = client.get_range(key, offset, length)
            storage.bytes_read += len(data)
            return data

    storage = ObjectStorage(Counting())
    storage.bytes_read = 0
    return storage
