"""``torchsupervisor inspect PREFIX``: what a checkpoint holds.

Prints the manifest (global step, time, versions, shards with their sizes and checksums), every
tensor (name, dtype, shape, bytes, CRC-32C, shard) and the non-tensor values of the saved state
(hyperparameters, counters, ...). ``--tensor NAME`` prints the values of one tensor, as TF's
``inspect_checkpoint --tensor_name`` does (``tensor_name:  NAME`` then the array), after
checking its checksum; ``--all-tensors`` prints every tensor that way.

PREFIX is a checkpoint prefix (``runs/exp/model.ckpt-300``, the files being
``model.ckpt-300.index`` and ``model.ckpt-300.data-*``), or a log directory: its newest
checkpoint (the one a restart tries first) is shown.

TF name: ``python -m tensorflow.python.tools.inspect_checkpoint``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
import torch

from torchsupervisor.checkpoint.reader import CheckpointReader, NewCheckpointReader
from torchsupervisor.cli._format import human_bytes, local_time, print_table
from torchsupervisor.cli._survey import restart_order
from torchsupervisor.cli._target import add_path_argument, resolve
from torchsupervisor.core.tree import decode_tree
from torchsupervisor.errors import NotFoundError

__all__ = ["HELP", "add_arguments", "run"]

HELP = "show a checkpoint's tensors (dtype, shape, checksum) and values; --tensor NAME prints one"

EPILOG = """examples:
  torchsupervisor inspect runs/exp/model.ckpt-300
  torchsupervisor inspect runs/exp                      # the newest checkpoint
  torchsupervisor inspect runs/exp/model.ckpt-300 --tensor model/fc1.weight
  torchsupervisor inspect runs/exp/model.ckpt-300 --all-tensors --full
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``inspect`` to ``parser``."""
    add_path_argument(
        parser,
        "prefix",
        "a checkpoint (its prefix, .index or a .data-* file), or a log directory (its newest)",
    )
    parser.add_argument("--tensor", metavar="NAME", help="print the values of this tensor")
    parser.add_argument("--all-tensors", action="store_true", help="print every tensor's values")
    parser.add_argument(
        "--full", action="store_true", help="print every element (no '...' summarization)"
    )
    parser.add_argument("--json", action="store_true", help="print the listing as JSON")


class _Tensor:
    """Stands for a tensor leaf while the non-tensor values of the tree are listed."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _leaves(node: object, path: str, out: list[tuple[str, Any]]) -> None:
    if isinstance(node, _Tensor):
        return
    if isinstance(node, dict):
        for key, value in node.items():
            _leaves(value, f"{path}/{key}" if path else str(key), out)
    elif (
        isinstance(node, (list, tuple))
        and node
        and not all(isinstance(v, (bool, int, float, str)) or v is None for v in node)
    ):
        for i, value in enumerate(node):
            _leaves(value, f"{path}/{i}" if path else str(i), out)
    else:
        out.append((path, node))


def _resolve(path: str) -> tuple[str, str | None]:
    """The checkpoint ``path`` names (a prefix or one of its files), or a log directory's
    newest, with a note saying which was taken for a directory."""
    target = resolve(path)
    if target.prefix is not None:
        return target.prefix, None
    candidates = restart_order(target.logdir)
    if not candidates:
        raise NotFoundError(f"No checkpoint in {target.logdir}")
    return candidates[0], f"the newest checkpoint of {target.logdir}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_array(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    try:
        return tensor.numpy(), ""
    except (TypeError, RuntimeError):
        return tensor.float().numpy(), f" ({_dtype_name(tensor.dtype)} shown as float32)"


def print_tensor(reader: Any, name: str) -> None:
    """Print one tensor as TF's inspect_checkpoint does: its name, then its values."""
    value = reader.get_tensor(name)
    if not isinstance(value, torch.Tensor):  # A TF string tensor: bytes, nested lists.
        print("tensor_name: ", name)
        print(value)
        return
    array, note = _as_array(value)
    print("tensor_name: ", name + note)
    print(array)


def _select(args: argparse.Namespace, reader: Any, names: list[str]) -> bool:
    """Print the values ``--tensor``/``--all-tensors`` ask for; False if they ask none."""
    if args.tensor is not None:
        if not reader.has_tensor(args.tensor):
            close = [n for n in names if args.tensor.lower() in n.lower()][:10]
            hint = f" Similar names: {', '.join(close)}." if close else ""
            raise NotFoundError(f"Key {args.tensor} not found in checkpoint.{hint}")
        print_tensor(reader, args.tensor)
        return True
    if args.all_tensors:
        for name in names:
            print_tensor(reader, name)
        return True
    return False


def _run_bundle(args: argparse.Namespace, reader: Any, prefix: str, how: str) -> int:
    """``inspect`` of a TF 1 checkpoint: its index's entries (dtype, shape, bytes, CRC)."""
    if args.full:
        np.set_printoptions(threshold=sys.maxsize)
    tensors = reader.describe()
    if _select(args, reader, [t["name"] for t in tensors]):
        return 0
    if args.json:
        out = {
            "prefix": prefix,
            "format": "tf1-bundle",
            "global_step": reader.global_step,
            "data_files": reader.data_files(),
            "tensors": {t.pop("name"): t for t in tensors},
        }
        print(json.dumps(out, indent=1))
        return 0
    print(f"TF 1 checkpoint {prefix}" + (f" ({how})" if how else "") + " (a tensor bundle)")
    print(f"  global step  {reader.global_step}")
    for path in reader.data_files():
        print(f"  data file    {path}")
    total = sum(t["bytes"] for t in tensors)
    print(f"\nTensors ({len(tensors)}, {human_bytes(total)}):")
    rows = [
        [
            t["name"],
            t["dtype"],
            "[" + ", ".join(str(d) for d in t["shape"]) + "]",
            str(t["bytes"]),
            f"{t['slices']} slices" if t["slices"] else f"{t['crc32c']:08x} (masked)",
            "-" if t["shard"] is None else str(t["shard"]),
        ]
        for t in tensors
    ]
    print_table(["NAME", "DTYPE", "SHAPE", "BYTES", "CRC32C", "SHARD"], rows, (3,))
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``torchsupervisor inspect``; returns the exit status."""
    prefix, how = _resolve(args.prefix)
    reader = NewCheckpointReader(prefix)
    if not isinstance(reader, CheckpointReader):  # A TF 1 checkpoint (a tensor bundle).
        return _run_bundle(args, reader, prefix, how)
    manifest = reader.manifest
    if args.full:
        np.set_printoptions(threshold=sys.maxsize)
    if _select(args, reader, sorted(manifest.tensors)):
        return 0
    leaves: list[tuple[str, Any]] = []
    _leaves(decode_tree(manifest.tree, lambda name, _: _Tensor(name)), "", leaves)
    if args.json:
        out = {
            "prefix": prefix,
            "global_step": manifest.global_step,
            "wall_time": manifest.wall_time,
            "format_version": manifest.format_version,
            "library_version": manifest.library_version,
            "torch_version": manifest.torch_version,
            "world_size": manifest.world_size,
            "tensors": {
                name: {
                    "dtype": _dtype_name(e.dtype),
                    "shape": list(e.shape),
                    "bytes": e.nbytes,
                    "crc32c": e.crc32c,
                    "shard": manifest.shards[e.shard].file,
                }
                for name, e in sorted(manifest.tensors.items())
            },
            "values": {path: value for path, value in leaves},
        }
        out["shards"] = [
            {"file": s.file, "size_bytes": s.size_bytes, "crc32c": s.crc32c}
            for s in manifest.shards
        ]
        print(json.dumps(out, indent=1, default=repr))
        return 0
    print(f"Checkpoint {prefix}" + (f" ({how})" if how else ""))
    print(f"  global step  {manifest.global_step}")
    print(f"  saved        {local_time(manifest.wall_time)}")
    print(
        f"  written by   torchsupervisor {manifest.library_version}, torch "
        f"{manifest.torch_version} (format {manifest.format_version}, world size "
        f"{manifest.world_size})"
    )
    for shard in manifest.shards:
        print(
            f"  shard        {shard.file}  {human_bytes(shard.size_bytes)}  "
            f"crc32c {shard.crc32c:08x}"
        )
    total = sum(e.nbytes for e in manifest.tensors.values())
    print(f"\nTensors ({len(manifest.tensors)}, {human_bytes(total)}):")
    rows = [
        [
            name,
            _dtype_name(e.dtype),
            "[" + ", ".join(str(d) for d in e.shape) + "]",
            str(e.nbytes),
            "-" if e.crc32c is None else f"{e.crc32c:08x}",
            str(e.shard),
        ]
        for name, e in sorted(manifest.tensors.items())
    ]
    print_table(["NAME", "DTYPE", "SHAPE", "BYTES", "CRC32C", "SHARD"], rows, (3,))
    if leaves:
        print(f"\nOther values ({len(leaves)}):")
        for path, value in leaves:
            text = repr(value)
            if len(text) > 100:
                text = text[:97] + "..."
            print(f"  {path} = {text}")
    return 0
