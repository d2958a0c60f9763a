"""What the sharded storage writer and reader share: chunk keys, errors remembered per rank."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.distributed.checkpoint.metadata import MetadataIndex

__all__ = ["ChunkKey", "RememberErrors", "chunk_key"]

ChunkKey = tuple[str, tuple[int, ...]]
"""A chunk of a tensor by its name and offsets."""


def chunk_key(index: MetadataIndex) -> ChunkKey:
    """The ``ChunkKey`` of a DCP ``MetadataIndex``."""
    return index.fqn, tuple(index.offset or ())


class RememberErrors:
    """Keeps the exception a call raised on this rank (DCP hands other ranks only a copy)."""

    error: BaseException | None = None

    @contextlib.contextmanager
    def _remembering(self) -> Iterator[None]:
        try:
            yield
        except BaseException as e:
            if self.error is None:
                self.error = e
            raise
