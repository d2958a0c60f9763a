"""Restore one process's state from a checkpoint: verify first, then load.

Before anything is loaded, the files must hold what the manifest claims (a damaged manifest
is damage, not a mismatch with the state), and the manifest is compared with the live state
(the run fingerprint: every entry present, shapes equal, dtypes convertible, a module's keys
equal). Then every byte read is verified, and only then is the state loaded. Another world
size, torch or torchsupervisor version is logged as a warning naming both values.

TF name: the restore half of ``tf.compat.v1.train.Saver``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

import torch

from torchsupervisor._version import __version__
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.core.state_load import check_state, load_state
from torchsupervisor.distributed.env import world_size
from torchsupervisor.errors import NotFoundError
from torchsupervisor.storage import Storage

__all__ = ["restore_state"]

logger = logging.getLogger("torchsupervisor")


def restore_state(
    state: Mapping[str, Any],
    save_path: str,
    *,
    storage: Storage,
    optional: Collection[str] = (),
    whole_state: bool = True,
) -> None:
    """Load checkpoint ``save_path`` into ``state``, after verifying it (module docstring).

    Args:
        state: The state receiving the values (unchanged if anything fails before loading).
        save_path: The checkpoint prefix.
        storage: Where it lives.
        optional: Entries that may be missing from the checkpoint (a warning, not an error).
        whole_state: ``state`` is the whole state: entries of the checkpoint that nothing
            restores are reported.

    Raises:
        CorruptCheckpointError: A file is missing, truncated, not a regular file, a link out
            of the checkpoint's directory, fails its checksum, or the manifest is damaged.
        NotFoundError: An entry of the state is not in the checkpoint (and not optional).
        InvalidArgumentError: A value does not fit its object (shape, dtype kind, keys).
    """
    reader = CheckpointReader(save_path, storage=storage)
    # The files must hold what the manifest claims before its shapes are believed: a
    # damaged manifest (a 2**40-byte tensor) is damage, not a mismatch with the state.
    reader.check_files()
    specs = reader.read_specs()

    def required(name: str) -> None:
        if name not in optional:
            raise NotFoundError(f"Key {name} not found in checkpoint {save_path}")

    warnings = check_state(state, specs, source=save_path, on_missing=required)
    _report_differences(reader.manifest, specs, state, save_path, whole_state)
    for message in warnings:
        logger.warning("%s", message)
    tree = reader.read_tree()

    def missing(name: str) -> None:
        required(name)
        logger.warning("Checkpoint %s has no %r entry; it keeps its current value", save_path, name)

    load_state(state, tree, source=save_path, on_missing=missing)


def _report_differences(
    manifest: Any, tree: object, state: Mapping[str, Any], source: str, whole_state: bool
) -> None:
    """Warn about what differs between the run that saved a checkpoint and this one.

    What would make the restore fail or change values (missing entries, shapes, dtypes) is
    checked by ``state.check_state`` before anything is loaded; this reports the rest:
    entries of the checkpoint that nothing restores (when the whole state is restored),
    another world size, another torch or torchsupervisor version.
    """
    if whole_state and isinstance(tree, Mapping):
        unused = sorted(str(k) for k in tree if k not in state)
        if unused:
            logger.warning("Checkpoint %s has entries the state does not use: %s", source, unused)
    if manifest.world_size != world_size():
        logger.warning(
            "Checkpoint %s was written by %d replicas; this run has %d",
            source,
            manifest.world_size,
            world_size(),
        )
    if manifest.torch_version.split("+")[0] != torch.__version__.split("+")[0]:
        logger.warning(
            "Checkpoint %s was written with torch %s; this is torch %s",
            source,
            manifest.torch_version,
            torch.__version__,
        )
    if manifest.library_version != __version__:
        logger.warning(
            "Checkpoint %s was written with torchsupervisor %s; this is torchsupervisor %s",
            source,
            manifest.library_version,
            __version__,
        )
