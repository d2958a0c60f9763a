"""A TF 1 input pipeline ported line by line: file names -> reader -> shuffle_batch.

    python examples/tf1_input_pipeline.py --logdir /tmp/tf1-pipeline --num-epochs 3

The files are the Python standard library's own modules (always on the machine). A
``string_input_producer`` hands out their names, a reader turns each file into one example
(its first 65 bytes: 64 inputs, and the 64 bytes that follow each of them as targets), and
``shuffle_batch`` mixes the examples into batches for a tiny next-byte model. The pipeline's
position is in the checkpointed state (``ts.InputPipelineState()``): stop it with Ctrl-C or
SIGTERM, or kill it, and run it again: it continues with exactly the batches it would have
trained on. ``docs/migration.md`` ("Input pipelines") shows the TF 1 program next to this one.
"""

from __future__ import annotations

import argparse
import glob
import os
import sysconfig

import torch
from torch import nn

import torchsupervisor as ts

WINDOW = 64


def stdlib_files(limit: int) -> list[str]:
    """The first ``limit`` modules of the standard library, by name."""
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:limit]


def read_example(filename: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The reader: one file, one example (TF: ``WholeFileReader`` and a decoder)."""
    with open(filename, "rb") as f:
        head = f.read(WINDOW + 1).ljust(WINDOW + 1, b"\0")
    data = torch.frombuffer(bytearray(head), dtype=torch.uint8).long()
    return data[:-1], data[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--logdir", default="/tmp/torchsupervisor-tf1-pipeline")
    parser.add_argument("--num-epochs", type=int, default=3)
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    filename_queue = ts.string_input_producer(
        stdlib_files(args.files), num_epochs=args.num_epochs, shuffle=True, seed=1
    )
    # One read per example: both outputs come from one call of read_example.
    x, y = ts.py_func(read_example, [filename_queue.dequeue], [torch.int64, torch.int64])
    inputs, targets = ts.shuffle_batch(
        [x, y],
        batch_size=args.batch_size,
        capacity=200,
        min_after_dequeue=50,
        seed=2,
        allow_smaller_final_batch=True,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 32), nn.Linear(32, 256))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    global_step = ts.GlobalStep()
    global_step.bind(optimizer)
    state = {
        "model": model,
        "optimizer": optimizer,
        "global_step": global_step,
        "input": ts.InputPipelineState(),  # the queues, producers and shuffling generators
    }

    def train_step() -> float:
        x, y = sess.run([inputs, targets])  # one batch: one dequeue for both
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        return loss.item()

    sv = ts.Supervisor(logdir=args.logdir, state=state, save_model_secs=2, save_summaries_secs=2)
    with sv.managed_session() as sess:
        print(f"starting at step {global_step.value}")
        while not sv.should_stop():
            loss = train_step()  # the end of the input raises OutOfRangeError: a clean stop
            if global_step.value % 20 == 0:
                print(f"step {global_step.value}: loss {loss:.3f}")
    print(f"done at step {global_step.value}")


if __name__ == "__main__":
    main()
