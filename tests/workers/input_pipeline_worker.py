"""A run that reads its input through TF 1 style queues, for the resume tests.

Usage: python input_pipeline_worker.py LOGDIR MAX_STEPS [--step-delay SECS] [--threads N]
                                        [--hold-after STEP] [--records DIR]

The input: ``slice_input_producer`` over 100 examples (shuffled, seeded, 3 epochs), batched by
``shuffle_batch`` (seeded; ``--threads`` enqueue threads), with the pipeline's position in the
checkpointed state (``InputPipelineState``). It prints ``READY <step>`` once the session is
up, ``BATCH <step> <ids>`` for every step (the step the batch was trained at and the example
ids of the batch), and ``DONE <step>`` at the end (the input's end, or MAX_STEPS). With
``--hold-after STEP`` it waits after that step's line (up to 300 s, or until a stop signal)
so that a test can kill it once a checkpoint is committed, however busy the machine.

With ``--records DIR`` the 100 examples come from files instead, as CIFAR-10's input did:
four files of 25 fixed-length records (an id and a feature byte) written to DIR if absent,
read by ``FixedLengthRecordReader`` from ``string_input_producer`` (seeded, 3 epochs) and
decoded with ``decode_raw``; the reader's position is part of the pipeline's state.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

import torchsupervisor as ts


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _records(directory: str) -> tuple[object, object]:
    """The examples read from record files (see the module docstring)."""
    os.makedirs(directory, exist_ok=True)
    names = []
    for f in range(4):
        path = os.path.join(directory, f"data_batch_{f}.bin")
        if not os.path.exists(path):
            with open(path, "wb") as out:
                out.write(bytes(b for i in range(f * 25, f * 25 + 25) for b in (i, i)))
        names.append(path)
    filename_queue = ts.string_input_producer(names, num_epochs=3, shuffle=True, seed=7)
    _, value = ts.FixedLengthRecordReader(record_bytes=2).read(filename_queue)
    record = ts.decode_raw(value, torch.uint8)

    def split(record: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return record[1:].float() / 100, record[0].long()

    return ts.py_func(split, [record], [torch.float32, torch.int64])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("logdir")
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hold-after", type=int, default=None)
    parser.add_argument("--records", default=None)
    args = parser.parse_args()

    if args.records:
        x, i = _records(args.records)
    else:
        features = torch.arange(100, dtype=torch.float32).view(100, 1) / 100
        ids = torch.arange(100)
        x, i = ts.slice_input_producer([features, ids], num_epochs=3, shuffle=True, seed=7)
    x_batch, id_batch = ts.shuffle_batch(
        [x, i],
        batch_size=8,
        capacity=40,
        min_after_dequeue=10,
        num_threads=args.threads,
        seed=11,
        allow_smaller_final_batch=True,
    )
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = ts.GlobalStep()
    step.bind(optimizer)
    state = {
        "model": model,
        "optimizer": optimizer,
        "global_step": step,
        "input": ts.InputPipelineState(),
    }
    sv = ts.Supervisor(logdir=args.logdir, state=state, save_model_secs=0.05, save_summaries_secs=0)

    def train_step() -> list[int]:
        xb, idb = sess.run([x_batch, id_batch])
        optimizer.zero_grad()
        loss = (model(xb) - 1).pow(2).mean()
        loss.backward()
        optimizer.step()
        if args.step_delay:
            time.sleep(args.step_delay)
        return idb.tolist()

    with sv.managed_session() as sess:
        say(f"READY {step.value}")
        while not sv.should_stop() and step.value < args.max_steps:
            current = step.value
            try:
                batch = train_step()
            except ts.errors.OutOfRangeError:
                break
            say(f"BATCH {current} {' '.join(map(str, batch))}")
            if current == args.hold_after:
                deadline = time.monotonic() + 300
                while not sv.should_stop() and time.monotonic() < deadline:
                    time.sleep(0.01)
    say(f"DONE {step.value}")


if __name__ == "__main__":
    main()
