"""What the sharded storage writer and reader share: chunk keys, checkpoint-id hooks, errors
remembered per rank."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # DCP costs a second to import; a process without sharded saves skips it.
    from torch.distributed.checkpoint.metadata import MetadataIndex

__all__ = ["BoundToPrefix", "ChunkKey", "RememberErrors", "chunk_key"]

ChunkKey = tuple[str, tuple[int, ...]]
"""A chunk of a tensor by its name and offsets."""


def chunk_key(index: MetadataIndex) -> ChunkKey:
    """The ``ChunkKey`` of a DCP ``MetadataIndex``."""
    return index.fqn, tuple(index.offset or ())


class BoundToPrefix:
    """DCP's checkpoint-id hooks for a reader or writer given its prefix at construction."""

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Do nothing: the prefix is given to the constructor."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Return False: never picked automatically from a checkpoint id."""
        return False


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
