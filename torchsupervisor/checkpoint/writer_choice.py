"""Which writer saves a state: every rank's part of a state of DTensors, or this process's.

A ``Saver`` holds a ``WriterChoice``: it makes the ``ShardedWriter`` (FSDP2: every rank writes
its shards, ``sharded/``) or the ``SnapshotWriter`` (one process's state, the chief of a
replicated run) when first needed, and remembers which one a state took with the state it was
decided for (the ``var_list`` mapping, or the session's state), so a run decides at its first
save or restore, not at every one.

TF name: none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchsupervisor.checkpoint.sharded.plan import is_sharded
from torchsupervisor.checkpoint.writer import Writer
from torchsupervisor.checkpoint.writers import ShardedWriter, SnapshotWriter

__all__ = ["WriterChoice"]


class WriterChoice:
    """The writers of one ``Saver`` and which one its state takes.

    Args:
        parts: What both writers share, in their order: storage, clock, ``Keeper``,
            ``CheckpointEngine``, ``Stager``, ``Directories``.
        cancel: The Saver's cancellation event (the snapshot writer stops writing at it).
        options: The snapshot writer's keyword options (``incremental``,
            ``max_shard_bytes``, ``allow_empty``, ``origin``, ``row_blocks``).

    Thread safety: the thread that saves and restores.
    """

    def __init__(self, parts: tuple[Any, ...], cancel: Any, options: dict[str, Any]) -> None:
        self._parts = parts
        self._cancel = cancel
        self._options = options
        self._writers: dict[bool, Writer[Any]] = {}
        self.chosen: tuple[object, Writer[Any]] | None = None
        """The state a writer was chosen for and that writer (None before the first)."""

    def of(self, sharded: bool) -> Writer[Any]:
        """The writer of a state of DTensors (``sharded``) or of this process's state."""
        writer = self._writers.get(sharded)
        if writer is None:
            storage, clock, keeper, engine, stager, directories = self._parts
            if sharded:
                writer = ShardedWriter(storage, clock, keeper, engine, stager, directories)
            else:
                writer = SnapshotWriter(
                    storage, clock, keeper, engine, self._cancel, stager, directories,
                    **self._options,
                )  # fmt: skip
            self._writers[sharded] = writer
        return writer

    def for_state(self, state: Mapping[str, Any], source: object) -> Writer[Any]:
        """The writer of ``state``, decided once for ``source`` (the object the state comes
        from: a new one decides again)."""
        known = self.chosen
        if known is None or known[0] is not source:
            known = self.chosen = (source, self.of(is_sharded(state)))
        return known[1]
