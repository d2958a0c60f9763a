"""``P.index``: its bytes, read with a bound, and whose format it is.

A checkpoint of ours has a JSON manifest there; another tool's checkpoint may have something
else under the same name (TF 1's tensor bundles: a sorted table). ``register_format`` lets
such a format plug into ``NewCheckpointReader`` (and ``load_checkpoint``, ``list_variables``,
``load_variable``) from a higher floor: ``torchsupervisor.interop`` registers TF 1 bundles,
and ``CheckpointReader`` refuses a registered format's index with a pointer to the right door.

TF name: none.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

from torchsupervisor.checkpoint.format import MAX_INDEX_BYTES
from torchsupervisor.errors import CorruptCheckpointError, NotFoundError
from torchsupervisor.storage import BY_PATH, NotRegularFileError, Storage

__all__ = ["read_index", "reader_of", "register_format"]


def read_index(prefix: str, storage: Storage = BY_PATH) -> bytes:
    """The bytes of ``prefix.index`` (at most ``MAX_INDEX_BYTES``).

    Raises:
        NotFoundError: It does not exist (TF's text).
        CorruptCheckpointError: It is not a regular file, is too large or cannot be read.
    """
    index = prefix + ".index"
    try:
        return storage.read_bytes(index, max_bytes=MAX_INDEX_BYTES)
    except FileNotFoundError:
        raise NotFoundError(
            "Unsuccessful TensorSliceReader constructor: Failed to find any matching files "
            f"for {prefix}"
        ) from None
    except (NotRegularFileError, IsADirectoryError) as e:
        kind = getattr(e, "kind", "a directory")
        raise CorruptCheckpointError(
            f"Checkpoint index {index} is not a regular file ({kind})",
            path=index,
            reason="not a file",
        ) from None
    except OSError as e:
        if e.errno == errno.EFBIG:
            raise CorruptCheckpointError(
                f"Checkpoint index {index} is corrupt: larger than {MAX_INDEX_BYTES} bytes",
                path=index,
                reason="too large",
            ) from None
        raise CorruptCheckpointError(
            f"Checkpoint index {index} cannot be read: {e}", path=index, reason="unreadable"
        ) from e


# Other formats NewCheckpointReader reads: (detect(index bytes), open(prefix, storage, index)).
_FORMATS: list[tuple[Callable[[bytes], bool], Callable[..., Any]]] = []


def register_format(detect: Callable[[bytes], bool], open_reader: Callable[..., Any]) -> None:
    """Let ``NewCheckpointReader`` (and ``load_checkpoint``, ``list_variables``,
    ``load_variable``) read another format's checkpoints.

    Args:
        detect: Called with the bytes of ``P.index``: True if it is this format's.
        open_reader: Called as ``open_reader(prefix, storage=..., index=...)``; returns a
            reader with ``CheckpointReader``'s query and read methods.

    ``torchsupervisor.interop`` registers TF 1's tensor bundles.

    TF name: none.
    """
    _FORMATS.append((detect, open_reader))


def reader_of(data: bytes) -> Callable[..., Any] | None:
    """The registered reader of the index ``data`` (its format's), or None for ours."""
    for detect, open_reader in _FORMATS:
        if detect(data):
            return open_reader
    return None
