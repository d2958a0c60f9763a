"""Which data files the committed checkpoints of a directory still need.

An incremental checkpoint does not rewrite tensors that did not change: its manifest points at
the shard of an earlier checkpoint that holds them. Deleting a checkpoint therefore removes its
index, but only those of its data files that no other committed checkpoint references; the
others are deleted later, when their last referrer goes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from torchsupervisor.checkpoint.format import MAX_INDEX_BYTES, ManifestError, shard_files
from torchsupervisor.storage import BY_PATH, Storage
from torchsupervisor.storage import paths as url_paths

__all__ = ["referenced_data_files"]

logger = logging.getLogger("torchsupervisor")


def referenced_data_files(
    directory: str, *, exclude: Iterable[str] = (), storage: Storage = BY_PATH
) -> set[str]:
    """Return the base names of the data files referenced by committed checkpoints.

    Args:
        directory: The checkpoint directory.
        exclude: Prefixes whose references do not count (the checkpoints being deleted).
        storage: Where the checkpoints live.

    Returns:
        Base names (``model.ckpt-100.data-00000-of-00001``) referenced by the manifest of any
        ``*.index`` in ``directory`` other than the excluded ones. A manifest that cannot be
        read (damaged: its checksum does not match; or another format such as TF's) is
        skipped: it cannot be restored from anyway. Only the list of shards is read
        (``format.shard_files``), not every tensor's entry.
    """
    excluded = {url_paths.normpath(p) for p in exclude}
    try:
        names = storage.list(directory or ".")
    except OSError:
        return set()
    referenced: set[str] = set()
    for name in names:
        if not name.endswith(".index"):
            continue
        prefix = os.path.join(directory, name[: -len(".index")])
        if url_paths.normpath(prefix) in excluded:
            continue
        try:
            data = storage.read_bytes(prefix + ".index", max_bytes=MAX_INDEX_BYTES)
            files = shard_files(data)
        except (OSError, ManifestError) as e:
            logger.debug("Ignoring the references of %s.index: %s", prefix, e)
            continue
        referenced.update(files)
    return referenced
