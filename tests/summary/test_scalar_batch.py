"""The vectorized scalar encoder writes exactly the bytes protobuf and TFRecord framing would."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tensorboard.compat.proto import event_pb2

from torchsupervisor.summary import records
from torchsupervisor.summary.scalar_batch import MAX_CACHED_TAGS, ScalarBatchEncoder

TAGS = ["loss", "", "x" * 300, "é/ü/名前", "a/b/c", "t" * 127, "t" * 128]
WALLS = [0.0, -0.0, 1.6e9 + 0.123, -5.5, 1e-310, float("inf")]
STEPS = [0, 1, 127, 128, 16383, 16384, -1, -(2**63), 2**63 - 1, 2**35 + 7]
VALUES = [
    0.0,
    -0.0,
    float("nan"),
    float("inf"),
    -float("inf"),
    1e40,
    -1e40,
    3.4028235677973366e38 * (1 + 1e-9),  # rounds to float32 max or overflows: as a C cast
    1e-45,
    1e-40,
    0.1,
    -123.456,
]


def reference(items):
    out = []
    for wall, step, tag, value in items:
        event = event_pb2.Event(wall_time=wall)
        event.summary.value.add(tag=tag, simple_value=value)
        if step:
            event.step = step
        out.append(records.encode_record(event.SerializeToString()))
    return b"".join(out)


def encode(encoder, items):
    walls, steps, tags, values = (list(column) for column in zip(*items))
    return encoder.encode(walls, steps, tags, values).tobytes()


@pytest.mark.parametrize("seed", range(20))
def test_byte_identical_to_protobuf_on_random_runs(seed):
    rng = random.Random(seed)
    encoder = ScalarBatchEncoder()
    for _ in range(5):  # the same encoder: tag heads and length headers come from its caches
        items = [
            (rng.choice(WALLS), rng.choice(STEPS), rng.choice(TAGS), rng.choice(VALUES))
            for _ in range(rng.randint(1, 200))
        ]
        assert encode(encoder, items) == reference(items)


def test_every_field_combination():
    encoder = ScalarBatchEncoder()
    items = [(w, s, t, v) for w in WALLS for s in STEPS for t in TAGS[:3] for v in VALUES[:4]]
    assert encode(encoder, items) == reference(items)


def test_records_read_back_in_order(tmp_path):
    items = [(1.6e9 + i, i, f"tag{i % 7}", float(i) / 3) for i in range(1000)]
    path = tmp_path / "events"
    path.write_bytes(encode(ScalarBatchEncoder(), items))
    events = [event_pb2.Event.FromString(p) for p in records.read_records(path)]
    assert [(e.step, e.summary.value[0].tag) for e in events] == [(s, t) for _, s, t, _ in items]
    got = [e.summary.value[0].simple_value for e in events]
    assert got == [float(np.float32(v)) for _, _, _, v in items]


def test_step_outside_int64_raises():
    with pytest.raises(OverflowError):
        ScalarBatchEncoder().encode([1.0], [2**63], ["x"], [1.0])


def test_tag_cache_restarts_when_full(monkeypatch):
    import torchsupervisor.summary.scalar_batch as module

    monkeypatch.setattr(module, "MAX_CACHED_TAGS", 4)
    encoder = ScalarBatchEncoder()
    for round_ in range(3):
        items = [(1.0, i, f"r{round_}t{i}", 1.0) for i in range(3)]
        assert encode(encoder, items) == reference(items)
        assert encoder.cached_tags <= 4
    assert MAX_CACHED_TAGS == 65536
