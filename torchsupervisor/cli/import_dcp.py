"""``torchsupervisor import-dcp DCP_DIR SAVE_PATH``: a DCP checkpoint as a checkpoint of ours.

Reads a ``torch.distributed.checkpoint`` directory (local or a bucket) without running its
pickles (``interop/dcp_import``: the metadata through an unpickler that admits DCP's classes
only), assembles every tensor from its chunks, and writes the state as one checkpoint of ours
(``SAVE_PATH-<step>``, every byte checksummed), which a Supervisor or ``Saver.restore`` then
loads at any world size.
"""

from __future__ import annotations

import argparse

from torchsupervisor.cli._format import human_bytes
from torchsupervisor.storage import storage_for

__all__ = ["HELP", "add_arguments", "run"]

HELP = "write a torch.distributed.checkpoint directory as a checkpoint of ours (no pickle runs)"

EPILOG = """examples:
  torchsupervisor import-dcp old_run/step_3000 runs/exp/model.ckpt --step 3000
  torchsupervisor import-dcp s3://bucket/dcp/step_3000 runs/exp/model.ckpt
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``import-dcp`` to ``parser``."""
    parser.add_argument("dcp_dir", metavar="DCP_DIR", help="the DCP checkpoint directory")
    parser.add_argument(
        "save_path", metavar="SAVE_PATH", help="our checkpoint's prefix (logdir/model.ckpt)"
    )
    parser.add_argument("--step", type=int, default=None, help="the global step to record")


def run(args: argparse.Namespace) -> int:
    """Run ``torchsupervisor import-dcp``; returns the exit status."""
    from torchsupervisor.checkpoint.reader import NewCheckpointReader
    from torchsupervisor.interop.dcp_import import dcp_import

    prefix = dcp_import(args.dcp_dir, args.save_path, global_step=args.step)
    reader = NewCheckpointReader(prefix)
    tensors = reader.manifest.tensors
    total = sum(e.nbytes for e in tensors.values())
    size = storage_for(prefix).size(f"{prefix}.index")
    print(
        f"Wrote {len(tensors)} tensors ({human_bytes(total)}) from {args.dcp_dir} to {prefix} "
        f"(index {human_bytes(size)})"
    )
    return 0
