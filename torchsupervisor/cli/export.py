"""``torchsupervisor export PREFIX OUT``: a checkpoint's tensors as plain weights.

``--format safetensors`` (the default) reads every tensor of the checkpoint (checking each
one's CRC-32C) and writes them with safetensors' own writer to one file, so that any tool that
reads safetensors (``safetensors.safe_open``, ``candle``, ...) can load them. Tensor names are
the state paths (``model/fc1.weight``, ``optimizer/state/0/exp_avg``); ``--only model`` keeps
the tensors under ``model/`` and strips that part, which gives the names of
``model.state_dict()``. The file's metadata records the source checkpoint and its global step.

``--format hf`` writes the directory OUT in Hugging Face's layout: sharded safetensors files
of at most ``--max-shard-size`` and ``model.safetensors.index.json`` last, the tensors under
``--only`` (default ``model``), streamed with a 16 MiB buffer whatever the model's size
(``interop/hf_export``); add the model's ``config.json`` and ``from_pretrained`` loads it.

PREFIX may also be a log directory: its newest checkpoint is exported. An existing OUT is
replaced only with ``--force``.
"""

from __future__ import annotations

import argparse
import os

from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.cli._format import human_bytes
from torchsupervisor.cli.inspect_checkpoint import _resolve
from torchsupervisor.errors import AlreadyExistsError, InvalidArgumentError
from torchsupervisor.storage import storage_for

__all__ = ["HELP", "add_arguments", "run"]

HELP = "write a checkpoint's tensors to a .safetensors file (plain weights for other tools)"

EPILOG = """examples:
  torchsupervisor export runs/exp/model.ckpt-300 weights.safetensors
  torchsupervisor export runs/exp model.safetensors --only model   # model.state_dict() names
  torchsupervisor export runs/exp hf_model/ --format hf --max-shard-size 2GB
"""

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}  # fmt: skip


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"512MiB"`` -> 536_870_912, ``"1000"`` -> 1000.

    Raises:
        InvalidArgumentError: Not a positive size.
    """
    number = text.strip().upper().rstrip("S")
    unit = number.lstrip("0123456789.")
    try:
        value = int(float(number[: len(number) - len(unit)]) * _UNITS[unit.strip()])
    except (ValueError, KeyError):
        value = 0
    if value < 1:
        raise InvalidArgumentError(
            f"--max-shard-size {text!r}: expected a size such as 5GB or 500MiB"
        )
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``export`` to ``parser``."""
    parser.add_argument(
        "prefix", metavar="PREFIX", help="a checkpoint prefix, or a log directory (its newest)"
    )
    parser.add_argument(
        "out", metavar="OUT", help="the .safetensors file to write (--format hf: a directory)"
    )
    parser.add_argument(
        "--format",
        choices=("safetensors", "hf"),
        default="safetensors",
        help="one .safetensors file (default), or Hugging Face's sharded layout",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="--format hf: the largest file (default 5GB)",
    )
    parser.add_argument(
        "--only",
        metavar="NAME",
        help="keep the tensors under this state entry (e.g. 'model') and strip 'NAME/' "
        "(--format hf: 'model' by default)",
    )
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")


def run(args: argparse.Namespace) -> int:
    """Run ``torchsupervisor export``; returns the exit status."""
    if args.format == "hf":
        return _run_hf(args)
    try:
        import safetensors.torch
    except ImportError as e:
        raise ImportError("export needs the safetensors package: pip install safetensors") from e

    prefix, _ = _resolve(args.prefix)
    storage = storage_for(args.out)
    if storage.exists(args.out) and not args.force:
        raise AlreadyExistsError(f"{args.out} exists; pass --force to replace it")
    reader = CheckpointReader(prefix)
    tensors = reader.read_tensors()
    if args.only:
        head = args.only.rstrip("/") + "/"
        tensors = {k[len(head) :]: v for k, v in tensors.items() if k.startswith(head)}
        if not tensors:
            roots = sorted({k.split("/", 1)[0] for k in reader.manifest.tensors})
            raise InvalidArgumentError(
                f"--only {args.only}: no tensor under '{head}' in {prefix}; the state "
                f"entries with tensors are: {', '.join(roots)}",
            )
    metadata = {"format": "pt", "source": os.path.abspath(prefix)}
    if reader.global_step is not None:
        metadata["global_step"] = str(reader.global_step)
    # Written whole and atomically (an existing OUT is the old or the new file, never a part),
    # with the permissions of any new file (0644 under the usual umask).
    storage.put(args.out, [safetensors.torch.save(tensors, metadata=metadata)])
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"Wrote {len(tensors)} tensors ({human_bytes(total)}) from {prefix} to {args.out}")
    return 0


def _run_hf(args: argparse.Namespace) -> int:
    from torchsupervisor.interop.hf_export import export_hf

    prefix, _ = _resolve(args.prefix)
    files = export_hf(
        prefix,
        args.out,
        subtree=args.only or "model",
        max_shard_bytes=parse_size(args.max_shard_size),
        overwrite=args.force,
    )
    total = sum(storage_for(f).size(f) for f in files)
    print(f"Wrote {len(files) - 1} safetensors file(s) and their index ({human_bytes(total)}) "
          f"from {prefix} to {args.out}")  # fmt: skip
    return 0
