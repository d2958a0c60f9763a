"""Import a ``torch.distributed.checkpoint`` (DCP) directory without running its pickles.

A DCP directory (``dcp.save`` with a ``FileSystemWriter``) holds ``.metadata``, a pickle of
DCP's ``Metadata`` (every entry's size, dtype and chunks; where each chunk's bytes are), and
``__<rank>_<n>.distcp`` files of the items' bytes. ``pickle.load`` of ``.metadata`` (what
``FileSystemReader.read_metadata`` does) runs whatever callable the file names: a crafted
``.metadata`` runs code. Here it is read by ``_MetadataUnpickler``, which admits only DCP's
metadata classes, ``torch.Size``, the torch dtypes, layouts and memory formats by name and
paths as strings; any other global (``os.system``, ``builtins.eval``, ...) refuses the file
before anything of it runs. What it gives is then checked field by field: types, a storage
file name that is a plain name in the directory (no ``..``, no ``/``, no link out of it),
offsets and lengths inside the file, chunks inside their tensor and tiling it exactly.

Each item's bytes are what ``torch.save`` wrote for it (DCP's default serialization), loaded
with ``torch.load(weights_only=True)``: PyTorch's restricted unpickler, which builds tensors
and plain values only; raw tensor bytes (DCP's safetensors serialization) are read as such.
DCP records no checksums: what the bytes say cannot be checked beyond their structure (the
import then writes a checkpoint of ours, whose every byte is checksummed from then on).

The state comes back nested as it was saved (DCP's planner records each entry's path):
``{"model": {"fc1.weight": tensor}, "optim": {"state": {...}, "param_groups": [...]}}``.

TF name: none.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from torchsupervisor.checkpoint.shard_io import open_checked
from torchsupervisor.errors import CorruptCheckpointError, NotFoundError, UnimplementedError
from torchsupervisor.storage import Storage, read_exactly, storage_for

__all__ = ["dcp_import", "read_dcp", "read_dcp_metadata"]

METADATA_FILE = ".metadata"
_MAX_METADATA_BYTES = 1 << 30
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")
_DCP = "torch.distributed.checkpoint.metadata"
_ADMITTED = {
    (_DCP, "Metadata"),
    (_DCP, "TensorStorageMetadata"),
    (_DCP, "BytesStorageMetadata"),
    (_DCP, "ChunkStorageMetadata"),
    (_DCP, "TensorProperties"),
    (_DCP, "MetadataIndex"),
    (_DCP, "StorageMeta"),
    (_DCP, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
}
_LAYOUTS = {"torch.strided": torch.strided, "torch.sparse_coo": torch.sparse_coo}
_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}


def _layout(name: str) -> torch.layout:
    """``torch.serialization._get_layout``, for the names of plain layouts only."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"an unknown layout {name!r}")
    return _LAYOUTS[name]


def _path(*parts: Any) -> str:
    """A ``pathlib`` path in the metadata (the checkpoint id): kept as a string."""
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a path of something other than strings")
    return os.path.join(*parts) if parts else ""


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes and plain torch values; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ADMITTED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.memory_format):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        if module == "pathlib" and name in _PATHS:
            return _path
        raise pickle.UnpicklingError(
            f"it names {module}.{name}, which a DCP metadata file never does"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it refers to a persistent object")


def read_dcp_metadata(directory: str, *, storage: Storage | None = None) -> Any:
    """Read and check the ``.metadata`` of the DCP directory ``directory``, running nothing.

    Returns:
        DCP's ``Metadata`` (``state_dict_metadata``, ``planner_data``, ``storage_data``).

    Raises:
        NotFoundError: There is no ``.metadata``.
        CorruptCheckpointError: It names a callable that is not DCP metadata's (nothing of it
            ran), is not a pickle, or holds something DCP never writes (naming the file).

    TF name: none (``FileSystemReader.read_metadata``, which unpickles anything).
    """
    import torch.distributed.checkpoint.filesystem  # noqa: F401  (the admitted classes)

    storage = storage or storage_for(directory)
    path = os.path.join(directory, METADATA_FILE)
    try:
        data = storage.read_bytes(path, max_bytes=_MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise NotFoundError(f"{directory} is not a DCP checkpoint: no {METADATA_FILE}") from None
    except OSError as e:
        raise _damaged(path, f"it cannot be read ({e})") from e
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise _damaged(path, f"refused: {e}") from None
    except Exception as e:  # A constructor of an admitted class refusing its arguments.
        raise _damaged(path, f"refused: {type(e).__name__}: {e}") from None
    _check_metadata(path, metadata)
    return metadata


def _damaged(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"DCP checkpoint file {path} is {what}", path=path, reason=what)


def _check_metadata(path: str, metadata: Any) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    def bad(what: str) -> CorruptCheckpointError:
        return _damaged(path, f"not DCP metadata: {what}")

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise bad(f"a {type(metadata).__name__}")
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise bad(f"an entry named {fqn!r}")
        if isinstance(entry, TensorStorageMetadata):
            size = entry.size
            if not isinstance(size, torch.Size) or not isinstance(
                entry.properties.dtype, torch.dtype
            ):
                raise bad(f"{fqn!r} has no valid size or dtype")
            for chunk in entry.chunks:
                offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
                if (
                    len(offsets) != len(size)
                    or len(sizes) != len(size)
                    or any(not isinstance(v, int) or v < 0 for v in offsets + sizes)
                    or any(o + s > d for o, s, d in zip(offsets, sizes, size))
                ):
                    raise bad(f"a chunk of {fqn!r} lies outside its size {list(size)}")
        elif not isinstance(entry, BytesStorageMetadata):
            raise bad(f"{fqn!r} is a {type(entry).__name__}")
    if not isinstance(metadata.storage_data, dict):
        raise bad("no storage data")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad(f"storage data of {type(index).__name__}: {type(info).__name__}")
        name = info.relative_path
        if not isinstance(name, str) or not _FILE_NAME.match(name) or name in (".", ".."):
            raise bad(f"{index.fqn!r} is stored in {name!r}, not a file of the directory")
        if not all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length)):
            raise bad(f"{index.fqn!r} has a negative offset or length")
    planner = metadata.planner_data
    if planner is not None and not isinstance(planner, dict):
        raise bad("its planner data is not a mapping")


class _Items:
    """The items' bytes, read from their storage files (opened once each, checked inside)."""

    def __init__(self, directory: str, storage: Storage) -> None:
        self.directory = directory
        self.storage = storage
        self._open: dict[str, Any] = {}

    def read(self, fqn: str, info: Any) -> bytes:
        path = os.path.join(self.directory, info.relative_path)
        f = self._open.get(path)
        if f is None:
            f = open_checked(path, self.storage, self.directory, "DCP checkpoint file")
            self._open[path] = f
        if info.offset + info.length > f.size:
            raise _damaged(path, f"truncated: {fqn!r} ends at byte {info.offset + info.length}")
        if info.transform_descriptors:
            raise UnimplementedError(
                None, None, f"{fqn!r} in {path} is stored with transforms "
                f"{list(info.transform_descriptors)}: not supported",
            )  # fmt: skip
        buffer = bytearray(info.length)
        try:
            read_exactly(f, memoryview(buffer), info.offset)
        except EOFError:
            raise _damaged(path, f"truncated: {fqn!r}") from None
        return bytes(buffer)

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def _load_payload(path: str, fqn: str, data: bytes) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # Refused by the weights-only unpickler, or not a torch.save.
        raise _damaged(path, f"unreadable at {fqn!r}: {type(e).__name__}: {e}") from None


def _tensor_chunk(
    path: str, fqn: str, data: bytes, dtype: torch.dtype, sizes: tuple
) -> torch.Tensor:
    numel = 1
    for s in sizes:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not data.startswith(b"PK\x03\x04") and len(data) == numel * itemsize:
        return (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(sizes)
            if (numel)
            else torch.empty(sizes, dtype=dtype)
        )  # Raw bytes (DCP's safetensors serialization).
    value = _load_payload(path, fqn, data)
    if not isinstance(value, torch.Tensor) or value.dtype != dtype or tuple(value.shape) != sizes:
        raise _damaged(path, f"holds for {fqn!r} something else than its metadata says")
    return value


def _set(tree: dict, keys: tuple, value: Any) -> None:
    node: Any = tree
    for key in keys[:-1]:
        child = node.get(key) if isinstance(node, dict) else None
        if child is None:
            child = {}
            node[key] = child
        node = child
    node[keys[-1]] = value


def _lists(node: Any) -> Any:
    """Turn the dicts whose keys are 0..n-1 (ints) back into the lists they were."""
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


def read_dcp(directory: str, *, storage: Storage | None = None) -> dict[str, Any]:
    """Read a DCP checkpoint's whole state (every tensor assembled from its chunks).

    Args:
        directory: The DCP directory (local, or a bucket URL).
        storage: Where it lives; None: from ``directory``.

    Returns:
        The state, nested as it was saved: tensors on the CPU, the other values as saved.

    Raises:
        NotFoundError: No ``.metadata``.
        CorruptCheckpointError: The metadata is refused (``read_dcp_metadata``), a storage
            file is missing, outside the directory or too short, an item is not what its
            metadata says, or the chunks of a tensor do not tile it exactly.
        UnimplementedError: Items stored with transforms (compression).

    TF name: none.
    """
    storage = storage or storage_for(directory)
    metadata = read_dcp_metadata(directory, storage=storage)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    by_fqn: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in metadata.storage_data.items():
        by_fqn.setdefault(index.fqn, []).append((index, info))
    planner = metadata.planner_data or {}
    tree: dict[str, Any] = {}
    items = _Items(directory, storage)
    path = os.path.join(directory, METADATA_FILE)
    try:
        for fqn, entry in metadata.state_dict_metadata.items():
            stored = by_fqn.get(fqn, [])
            if isinstance(entry, TensorStorageMetadata):
                value = _assemble(path, fqn, entry, stored, items)
            else:
                if len(stored) != 1:
                    raise _damaged(path, f"not DCP metadata: {fqn!r} is stored {len(stored)} times")
                info = stored[0][1]
                value = _load_payload(os.path.join(directory, info.relative_path), fqn,
                                      items.read(fqn, info))  # fmt: skip
            keys = planner.get(fqn, (fqn,))
            if (
                not isinstance(keys, tuple)
                or not keys
                or not all(isinstance(k, (str, int)) for k in keys)
            ):
                raise _damaged(path, f"not DCP metadata: the path of {fqn!r} is {keys!r}")
            _set(tree, keys, value)
    finally:
        items.close()
    return _lists(tree)


def _assemble(
    path: str, fqn: str, entry: Any, stored: list[tuple[Any, Any]], items: _Items
) -> torch.Tensor:
    size = tuple(entry.size)
    dtype = entry.properties.dtype
    by_offset = {tuple(index.offset or ()): info for index, info in stored}
    # The chunks must hold as many elements as the tensor before it is allocated (crafted
    # metadata would otherwise claim terabytes); that they tile it is checked below.
    if sum(math.prod(c.sizes) for c in entry.chunks) != math.prod(size):
        raise _damaged(path, f"not DCP metadata: the chunks of {fqn!r} do not tile it exactly")
    itemsize = torch.empty((), dtype=dtype).element_size()
    for chunk in entry.chunks:  # And their bytes must be in their files (a size is cheap).
        info = by_offset.get(tuple(chunk.offsets))
        if info is None:
            continue  # Refused below, naming the chunk.
        file = os.path.join(items.directory, info.relative_path)
        try:
            file_size = items.storage.size(file)
        except OSError:
            raise _damaged(file, "missing") from None
        if info.length < math.prod(chunk.sizes) * itemsize or info.offset + info.length > file_size:
            raise _damaged(file, f"truncated: a chunk of {fqn!r} does not fit in it")
    out = torch.empty(size, dtype=dtype)
    covered = torch.zeros(size, dtype=torch.int8)
    for chunk in entry.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        info = by_offset.get(offsets)
        if info is None:
            raise _damaged(
                path, f"not DCP metadata: a chunk of {fqn!r} at {list(offsets)} is stored nowhere"
            )
        data = items.read(fqn, info)
        file = os.path.join(items.directory, info.relative_path)
        region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        out[region] = _tensor_chunk(file, fqn, data, dtype, sizes)
        covered[region] += 1
    if covered.numel() and not bool((covered == 1).all()):
        raise _damaged(path, f"not DCP metadata: the chunks of {fqn!r} do not tile it exactly")
    return out


def dcp_import(
    directory: str,
    save_path: str,
    *,
    global_step: int | None = None,
    storage: Storage | None = None,
) -> str:
    """Write the state of a DCP checkpoint as a checkpoint of ours (every byte checksummed).

    Args:
        directory: The DCP directory (local, or a bucket URL).
        save_path: Our checkpoint's prefix family (``logdir/model.ckpt``).
        global_step: The step to record (the prefix gets ``-<step>``); None: none.
        storage: Where the DCP directory lives; None: from ``directory``.

    Returns:
        The prefix written.

    Raises:
        As ``read_dcp``; and ``Saver.save``'s errors for the writing.

    TF name: none.
    """
    from torchsupervisor.checkpoint.saver import Saver

    state = read_dcp(directory, storage=storage)
    if not isinstance(state, Mapping):
        raise CorruptCheckpointError(f"DCP checkpoint {directory} holds no state mapping")
    storage_for(save_path).makedirs(os.path.dirname(save_path) or ".")
    saver = Saver(max_to_keep=None, incremental=False)
    try:
        return saver.save(SimpleNamespace(state=state), save_path, global_step=global_step)
    finally:
        saver.close()
