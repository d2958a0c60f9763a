"""Incremental checkpoints: frozen tensors that did not change are not copied or written again.

After a save commits, the saver remembers, for each *frozen* tensor it copied, the live tensor,
that tensor's version counter at the copy, and where its bytes now live (``Committed``). At the
next step boundary a tensor that is still frozen and is the same tensor (same memory, dtype,
shape and strides) with the same version counter has not been modified by a PyTorch in-place
operation, so the new manifest points at the committed bytes instead of copying them: a frozen
backbone costs nothing after the first checkpoint of a chain.

Version counters do not see every write. Fused optimizer kernels (``Adam(fused=True)``,
``AdamW(fused=True)``, ``SGD(fused=True)``) update parameters and moments in place without a
bump; so does ``batch_norm`` for the running statistics of a module in training mode; and so
does any write through ``.data``, a numpy view, DLPack or a raw pointer. Hence only frozen
tensors are ever referenced (``state.flatten_state(frozen=...)``): those of a module's state
dict, or bare tensors, that share no memory with a trainable parameter (``requires_grad``), with
a parameter an optimizer of the state has a gradient or state for, or with a buffer of a module
in training mode; and only if they were already frozen when their bytes were copied. An
optimizer's state and other stateful objects' tensors are copied at every save.

What remains are writes behind PyTorch's back into frozen tensors (``p.data.add_()``, numpy).
Before committing, the writer thread recomputes the CRC-32C of every reused CPU tensor whose
version has not moved and compares it with the committed one; a mismatch fails that save
(nothing is committed: the bytes the tensor held at the snapshot's step are gone) with
``StaleReferenceError`` naming the tensors, and those tensors are copied at every later save
of that saver. GPU tensors are not re-checked (that would cost a device-to-host copy): such a
write into a frozen GPU tensor goes unnoticed, and the checkpoint holds its value from the
last copy. Write frozen tensors with in-place PyTorch ops (``with torch.no_grad():
p.add_(...)``, which bump the counter) or use ``Saver(incremental=False)``. Tensors without a
version counter (inference mode) and non-contiguous tensors are always copied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import crc32c
import torch

from torchsupervisor.checkpoint.format import ShardEntry, TensorEntry
from torchsupervisor.checkpoint.row_blocks import RowBlocks
from torchsupervisor.errors import (
    StaleReferenceError,
)

__all__ = ["Committed", "StaleReferenceError", "is_unchanged", "tensor_version", "verify"]


@dataclass(frozen=True, eq=False)
class Committed:
    """Where the bytes of one tensor were committed, and the live tensor they were copied from.

    Attributes:
        source: The tensor that was copied. Holding it keeps its memory allocated, so no other
            tensor can appear at the same address.
        version: ``source``'s version counter when it was copied.
        shard: The shard file holding the bytes (file name relative to the directory).
        entry: The byte range and CRC-32C of the tensor in that shard.
        blocks: The CRC-32C of its blocks of rows (``Manifest.row_blocks``), None if none.
    """

    source: torch.Tensor
    version: int
    shard: ShardEntry
    entry: TensorEntry
    blocks: RowBlocks | None = None


def tensor_version(tensor: torch.Tensor) -> int | None:
    """Return the tensor's version counter, or None if it has none (inference tensors)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def is_unchanged(tensor: torch.Tensor, committed: Committed) -> bool:
    """Return True if ``tensor`` is the committed tensor, unmodified by PyTorch ops since."""
    source = committed.source
    if tensor.data_ptr() != source.data_ptr() or tensor.numel() == 0:
        return False
    if tensor.dtype != source.dtype or tensor.device != source.device:
        return False
    if tensor.shape != source.shape or tensor.stride() != source.stride():
        return False
    if not tensor.is_contiguous():
        return False
    version = tensor_version(tensor)
    return version is not None and version == committed.version


def _bytes_crc(tensor: torch.Tensor) -> int:
    return crc32c.crc32c(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))


def verify(references: Mapping[str, Committed], prefix: str) -> None:
    """Check that reused CPU tensors still hold their committed bytes.

    Runs on the writer thread while training continues. A tensor whose version counter moved
    since the snapshot was legitimately modified after it and cannot be checked (the snapshot
    decision was made on the version at the step boundary); only tensors whose version is
    unchanged across the checksum are compared.

    Raises:
        StaleReferenceError: Naming the tensors whose bytes differ from the committed ones.
    """
    stale = []
    for name, committed in references.items():
        source = committed.source
        if source.device.type != "cpu":
            continue
        before = tensor_version(source)
        if before != committed.version:
            continue
        crc = _bytes_crc(source)
        if tensor_version(source) == before and crc != committed.entry.crc32c:
            stale.append(name)
    if stale:
        details = ", ".join(
            f"{name} (committed in {references[name].shard.file})" for name in sorted(stale)
        )
        raise StaleReferenceError(
            f"Saving checkpoint {prefix} failed: tensors {details} changed without their "
            "version counter changing, so the unchanged bytes this checkpoint would reference "
            "are not their value at this step, and that value can no longer be read (written "
            "outside PyTorch's in-place operations: through .data, a numpy view, DLPack); "
            "nothing was committed, and these tensors are copied at every save from now on",
            path=prefix,
            names=frozenset(stale),
        )
