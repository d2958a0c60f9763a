"""TF 1's record readers: TF's keys and values, and a position the pipeline state resumes.

The CIFAR-10 port read its files in a ``py_func``: the records buffered there were in no
checkpoint, and a resumed run skipped them. Here a reader's position is state.
"""

from __future__ import annotations

import pytest
import torch
from monitored_helpers import JOIN_SECS

import torchsupervisor as ts
from torchsupervisor.core.coordinator import Coordinator
from torchsupervisor.core.registry import Graph
from torchsupervisor.errors import DataLossError, OutOfRangeError
from torchsupervisor.summary.records import encode_records

RECORD = 1 + 4  # A label byte and a 2x2 uint8 "image", as CIFAR-10's layout.


def _write_files(tmp_path, files=3, per_file=7):
    names = []
    for f in range(files):
        path = tmp_path / f"data_batch_{f}.bin"
        rows = []
        for r in range(per_file):
            i = f * per_file + r
            rows.append(bytes([i % 10, i, i, i, i]))
        path.write_bytes(b"".join(rows))
        names.append(str(path))
    return names


def test_each_reader_gives_tfs_keys_and_values(tmp_path):
    fixed = tmp_path / "fixed.bin"
    fixed.write_bytes(b"HDR" + b"aaaa" + b"bbbb" + b"cc" + b"FT")  # header 3, footer 2
    text = tmp_path / "lines.csv"
    text.write_bytes(b"name,value\nx,1\r\ny,2\n")
    whole = tmp_path / "whole.txt"
    whole.write_bytes(b"all of it")
    tfrecord = tmp_path / "data.tfrecord"
    tfrecord.write_bytes(encode_records([b"first", b"", b"third"]))

    def all_records(reader, path):
        with Graph().as_default():
            queue = ts.FIFOQueue(4)
            queue.enqueue(str(path))
            queue.close()
            outputs = reader.read(queue)
            got = []
            for _ in range(10):
                try:
                    got.append(outputs())
                except OutOfRangeError:
                    return got
        raise AssertionError("no end of input")

    reader = ts.FixedLengthRecordReader(4, header_bytes=3, footer_bytes=2)
    assert all_records(reader, fixed) == [
        (f"{fixed}:0".encode(), b"aaaa"),
        (f"{fixed}:1".encode(), b"bbbb"),  # "cc" is an incomplete record: not read.
    ]
    assert reader.num_records_produced() == 2 and reader.num_work_units_completed() == 1
    hops = ts.FixedLengthRecordReader(2, hop_bytes=3)
    assert [v for _, v in all_records(hops, whole)] == [b"al", b" o", b" i"]
    assert all_records(ts.TextLineReader(skip_header_lines=1), text) == [
        (f"{text}:2".encode(), b"x,1"),
        (f"{text}:3".encode(), b"y,2"),
    ]
    assert all_records(ts.WholeFileReader(), whole) == [(str(whole).encode(), b"all of it")]
    records = all_records(ts.TFRecordReader(), tfrecord)
    assert [v for _, v in records] == [b"first", b"", b"third"]
    assert [k for k, _ in records] == [f"{tfrecord}:{o}".encode() for o in (0, 21, 37)]
    damaged = bytearray(tfrecord.read_bytes())
    damaged[14] ^= 0xFF
    tfrecord.write_bytes(bytes(damaged))
    with pytest.raises(DataLossError, match="checksum mismatch of the payload"):
        all_records(ts.TFRecordReader(), tfrecord)


def test_decode_raw_eager_lazy_and_big_endian():
    assert ts.decode_raw(b"\x01\x02\x03", torch.uint8).tolist() == [1, 2, 3]
    assert ts.decode_raw(b"\x00\x01", torch.int16, little_endian=False).tolist() == [1]
    assert ts.decode_raw(b"\x01\x00", torch.int16).tolist() == [1]
    assert ts.decode_raw([b"\x01\x02", b"\x03\x04"], torch.uint8).tolist() == [[1, 2], [3, 4]]
    with pytest.raises(ValueError, match="not a multiple of 4"):
        ts.decode_raw(b"\x00" * 6, torch.float32)
    lazy = ts.decode_raw(lambda: b"\x05\x06", torch.uint8)
    assert lazy().tolist() == [5, 6]


def _pipeline(names):
    """CIFAR-10's input, as a port writes it with the readers."""
    filename_queue = ts.string_input_producer(names, num_epochs=2, shuffle=True, seed=3)
    reader = ts.FixedLengthRecordReader(RECORD)
    _, value = reader.read(filename_queue)
    record = ts.decode_raw(value, torch.uint8)

    def split(record):
        return record[1:].reshape(2, 2).float(), record[0].long()

    image, label = ts.py_func(split, [record], [torch.float32, torch.int64])
    images, _ = ts.shuffle_batch(
        [image, label],
        batch_size=4,
        capacity=12,
        min_after_dequeue=4,
        seed=5,
        allow_smaller_final_batch=True,
    )
    return images


def _batches(graph, images, limit, state=None):
    """Run the pipeline's runners; return up to ``limit`` batches (ids), and the state."""
    pipeline = ts.InputPipelineState(graph=graph)
    if state is not None:
        pipeline.load_state_dict(state)
    coord = Coordinator()
    threads = ts.start_queue_runners(coord=coord)
    out = []
    try:
        while len(out) < limit:
            out.append(images()[:, 0, 0].long().tolist())
    except OutOfRangeError:
        pass
    taken = pipeline.state_dict()  # With the runners still filling the queues.
    coord.request_stop()
    coord.join(threads, stop_grace_period_secs=JOIN_SECS)
    return out, taken


def test_a_reader_pipeline_resumes_exactly_with_the_pipeline_state(tmp_path):
    names = _write_files(tmp_path)
    with Graph().as_default() as graph:
        images = _pipeline(names)
        uninterrupted, _ = _batches(graph, images, 1000)
    ids = [i for batch in uninterrupted for i in batch]
    assert sorted(ids) == sorted(list(range(21)) * 2)  # Every record, twice (2 epochs).

    with Graph().as_default() as graph:
        images = _pipeline(names)
        first, state = _batches(graph, images, 4)  # Stopped inside a file.
    with Graph().as_default() as graph:  # A new process: the same pipeline, restored.
        images = _pipeline(names)
        rest, _ = _batches(graph, images, 1000, state)
    assert first + rest == uninterrupted
