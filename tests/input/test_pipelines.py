"""TF 1 input pipelines: producers, limit_epochs, batching; as TF documents them."""

from __future__ import annotations

import time

import pytest
import torch
from monitored_helpers import JOIN_SECS

import torchsupervisor as ts
from torchsupervisor.core.registry import GraphKeys, get_collection
from torchsupervisor.errors import OutOfRangeError


@pytest.fixture
def runners():
    """Start the collected queue runners (as the Supervisor does); stop them after."""
    coord = ts.Coordinator()
    started = []

    def start():
        started.extend(ts.start_queue_runners(coord=coord))
        return coord

    yield start
    coord.request_stop()
    coord.join(started, stop_grace_period_secs=JOIN_SECS)


def drain(fetch, limit=1000):
    out = []
    for _ in range(limit):
        try:
            out.append(fetch())
        except OutOfRangeError:
            return out
    raise AssertionError("the input did not end")


# -- Producers ----------------------------------------------------------------------------


def test_string_input_producer_epochs_in_order_then_out_of_range(runners):
    queue = ts.string_input_producer(["a", "b", "c"], num_epochs=2, shuffle=False)
    runners()
    assert drain(lambda: queue.dequeue(timeout_secs=JOIN_SECS)) == ["a", "b", "c"] * 2
    assert queue.is_closed()


def test_string_input_producer_shuffles_each_epoch_anew_with_a_seed(runners):
    names = [f"file{i}" for i in range(20)]
    queue = ts.string_input_producer(names, num_epochs=3, seed=5, capacity=100)
    runners()
    out = drain(lambda: queue.dequeue(timeout_secs=JOIN_SECS))
    epochs = [out[i * 20 : (i + 1) * 20] for i in range(3)]
    assert all(sorted(e) == sorted(names) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != names


def test_string_input_producer_refuses_an_empty_input():
    with pytest.raises(ValueError, match="requires a non-null input tensor"):
        ts.string_input_producer([])


def test_producer_queue_fills_to_its_capacity_and_adds_its_summary(runners):
    queue = ts.range_input_producer(100, capacity=7)
    runners()
    deadline = time.monotonic() + JOIN_SECS
    while queue.size() < 7 and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)  # Were it to overfill, it would by now.
    assert queue.size() == 7
    value = queue.dequeue(timeout_secs=JOIN_SECS)
    assert value.dtype == torch.int32 and value.dim() == 0
    tags = [op.name for op in get_collection(GraphKeys.SUMMARIES)]
    assert tags == ["input_producer/fraction_of_7_full"]
    assert len(get_collection(GraphKeys.QUEUE_RUNNERS)) == 1


def test_producer_names_are_unique_in_the_graph():
    first = ts.range_input_producer(3)
    second = ts.range_input_producer(3)
    assert (first.name, second.name) == ("input_producer", "input_producer_1")


def test_input_producer_rows_and_element_shape():
    with pytest.raises(ValueError, match="element_shape"):
        ts.input_producer(torch.zeros(4, 2), element_shape=[3])
    with pytest.raises(ValueError, match="num_epochs must be > 0 not 0"):
        ts.input_producer(torch.zeros(4, 2), num_epochs=0)


def test_slice_input_producer_keeps_rows_together(runners):
    images = torch.arange(10).view(5, 2)
    labels = ["a", "b", "c", "d", "e"]
    image, label = ts.slice_input_producer([images, labels], num_epochs=1, seed=1)
    runners()
    pairs = drain(lambda: ts.Session().run([image, label]))
    assert sorted(lab for _, lab in pairs) == labels
    for img, lab in pairs:
        assert img.tolist() == images[labels.index(lab)].tolist()


def test_slice_input_producer_validates():
    with pytest.raises(ValueError, match="Expected at least one tensor"):
        ts.slice_input_producer([])
    with pytest.raises(ValueError, match="first dimension"):
        ts.slice_input_producer([torch.zeros(3), torch.zeros(4)])


def test_limit_epochs():
    value = torch.tensor([1, 2])
    assert ts.limit_epochs(value) is value
    limited = ts.limit_epochs(value, 2)
    assert [limited().tolist(), limited().tolist()] == [[1, 2], [1, 2]]
    with pytest.raises(OutOfRangeError, match="Reached limit of 2"):
        limited()
    with pytest.raises(ValueError, match="num_epochs must be > 0 not 0"):
        ts.limit_epochs(value, 0)


# -- batch --------------------------------------------------------------------------------


def test_batch_enqueue_many_with_a_smaller_final_batch(runners):
    batch = ts.batch(
        ts.limit_epochs(torch.arange(10), 1),
        batch_size=3,
        enqueue_many=True,
        allow_smaller_final_batch=True,
    )
    runners()
    assert [b.tolist() for b in drain(batch)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_batch_without_a_smaller_final_batch_drops_the_rest(runners):
    batch = ts.batch(ts.limit_epochs(torch.arange(10), 1), batch_size=4, enqueue_many=True)
    runners()
    assert [b.tolist() for b in drain(batch)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_batch_of_a_constant_repeats_it_and_a_batch_may_exceed_the_capacity(runners):
    batch = ts.batch([torch.tensor([1.0, 2.0])], batch_size=40, capacity=8)
    runners()
    value = ts.Session().run(batch)  # A list of one tensor gives a tensor, as TF.
    assert isinstance(value, torch.Tensor) and value.shape == (40, 2)


def test_batch_keeps_the_structure_of_dicts_and_tuples(runners):
    x, i = ts.slice_input_producer(
        [torch.arange(8, dtype=torch.float32).view(8, 1), torch.arange(8)], shuffle=False
    )
    as_dict = ts.batch({"x": x, "id": i, "tag": "t"}, batch_size=4)
    as_tuple = ts.batch((x, i), batch_size=2, name="pairs")
    runners()
    value = as_dict()
    assert set(value) == {"x", "id", "tag"} and value["tag"] == ["t"] * 4
    assert torch.equal(value["x"][:, 0], value["id"].float())
    first, second = as_tuple()
    assert isinstance(as_tuple(), tuple)
    assert first.shape == (2, 1) and torch.equal(first[:, 0], second.float())


def test_batch_dynamic_pad_pads_to_the_longest(runners):
    lengths = iter([1, 3, 2, 4])
    batch = ts.batch(
        [lambda: torch.ones(next(lengths), dtype=torch.int64)],
        batch_size=4,
        dynamic_pad=True,
        shapes=[[None]],
    )
    runners()
    value = batch()
    assert value.shape == (4, 4)
    assert sorted(value.sum(1).tolist()) == [1, 2, 3, 4]


def test_an_example_of_another_shape_stops_training_with_the_error():
    with pytest.raises(ValueError, match=r"Shape mismatch in tuple component 0 .* got \[3\]"):
        ts.batch([torch.zeros(3)], batch_size=2, shapes=[[2]])  # A constant: checked now.
    batch = ts.batch([lambda: torch.zeros(3)], batch_size=2, shapes=[[2]])
    coord = ts.Coordinator()
    threads = ts.start_queue_runners(coord=coord)
    with pytest.raises(OutOfRangeError):
        batch()  # The runner reported the error; the stop closed the queue.
    with pytest.raises(ValueError, match=r"Shape mismatch in tuple component 0 .* got \[3\]"):
        coord.join(threads, stop_grace_period_secs=JOIN_SECS)


def test_batch_argument_errors():
    with pytest.raises(ValueError, match=r"Expected at least one tensor in batch\(\)\."):
        ts.batch([], 2)
    with pytest.raises(ValueError, match="batch_size"):
        ts.batch([torch.zeros(1)], 0)
    with pytest.raises(ValueError, match=r"Expected at least one input in batch_join\(\)\."):
        ts.batch_join([], 2)


def test_batch_join_one_thread_per_input(runners):
    a = ts.limit_epochs(torch.zeros(6, dtype=torch.int64), 1)
    b = ts.limit_epochs(torch.ones(6, dtype=torch.int64), 1)
    batch = ts.batch_join([[a], [b]], batch_size=4, enqueue_many=True)
    runners()
    values = torch.cat(drain(batch))
    assert values.shape == (12,) and values.sum() == 6
    assert len(get_collection(GraphKeys.QUEUE_RUNNERS)[0].enqueue_ops) == 2


def test_maybe_batch_keeps_rows_where_keep_input_is_true(runners):
    rows = ts.limit_epochs(torch.arange(8), 1)
    keep = torch.tensor([True, False] * 4)
    batch = ts.maybe_batch(
        rows, keep, batch_size=10, enqueue_many=True, allow_smaller_final_batch=True
    )
    runners()
    assert batch().tolist() == [0, 2, 4, 6]


# -- shuffle_batch ------------------------------------------------------------------------


def test_shuffle_batch_returns_every_example_once_per_epoch(runners):
    image, label = ts.slice_input_producer(
        [torch.arange(50).view(50, 1), torch.arange(50)], num_epochs=2, seed=3
    )
    images, labels = ts.shuffle_batch(
        [image, label],
        batch_size=8,
        capacity=30,
        min_after_dequeue=10,
        seed=4,
        allow_smaller_final_batch=True,
    )
    runners()
    batches = drain(lambda: ts.Session().run([images, labels]))
    seen = torch.cat([b[1] for b in batches])
    assert sorted(seen.tolist()) == sorted(list(range(50)) * 2)
    assert all(torch.equal(x[:, 0], y) for x, y in batches)
    assert [len(b[1]) for b in batches][-1] == 100 % 8
    tags = [op.name for op in get_collection(GraphKeys.SUMMARIES)]
    assert "shuffle_batch/fraction_over_10_of_20_full" in tags


def test_shuffle_batch_is_the_same_on_every_run_with_one_thread():
    def run():
        ts.reset_default_graph()
        ids = ts.shuffle_batch(
            [ts.range_input_producer(40, num_epochs=1, seed=1).dequeue],
            batch_size=5,
            capacity=20,
            min_after_dequeue=6,
            seed=2,
        )
        coord = ts.Coordinator()
        threads = ts.start_queue_runners(coord=coord)
        out = [b.tolist() for b in drain(ids)]
        coord.request_stop()
        coord.join(threads, stop_grace_period_secs=JOIN_SECS)
        return out

    first = run()
    assert len(first) == 8 and first == run()


def test_shuffle_batch_join_and_maybe_forms_exist_with_tf_signatures(runners):
    a = ts.limit_epochs(torch.arange(5), 1)
    b = ts.limit_epochs(torch.arange(5, 10), 1)
    joined = ts.shuffle_batch_join(
        [[a], [b]], 10, 20, 0, seed=1, enqueue_many=True, allow_smaller_final_batch=True
    )
    kept = ts.maybe_shuffle_batch(
        ts.limit_epochs(torch.arange(4), 1),
        4,
        8,
        0,
        torch.tensor([1, 1, 0, 1]).bool(),
        enqueue_many=True,
        allow_smaller_final_batch=True,
    )
    runners()
    assert sorted(joined().tolist()) == list(range(10))
    assert sorted(kept().tolist()) == [0, 1, 3]


# -- In a Supervisor ----------------------------------------------------------------------


def test_the_supervisor_starts_the_pipeline_and_its_end_stops_training_cleanly(tmp_path):
    label = ts.slice_input_producer([torch.arange(12)], num_epochs=1, shuffle=False)[0]
    labels = ts.batch([label], batch_size=4)
    step = ts.GlobalStep()
    sv = ts.Supervisor(logdir=str(tmp_path), state={"global_step": step}, save_summaries_secs=0)
    seen = []
    with sv.managed_session() as sess:
        while not sv.should_stop():
            seen.append(sess.run(labels).tolist())
            step.increment()
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert ts.latest_checkpoint(str(tmp_path)).endswith("model.ckpt-3")


def test_saver_takes_tf_positional_arguments(tmp_path):
    state = {"w": torch.zeros(1)}
    # var_list, reshape, sharded, max_to_keep, keep_checkpoint_every_n_hours, name,
    # restore_sequentially, saver_def, builder, defer_build, allow_empty, write_version,
    # pad_step_number
    saver = ts.Saver(state, False, False, 2, 1.0, "s", False, None, None, False, False, 2, True)
    for step in range(4):
        saver.save(None, str(tmp_path / "model.ckpt"), global_step=step)
    kept = ts.get_checkpoint_state(str(tmp_path)).all_model_checkpoint_paths
    assert [p.rsplit("/", 1)[-1] for p in kept] == ["model.ckpt-00000002", "model.ckpt-00000003"]


def test_py_func_outputs_share_one_call_per_example(runners):
    calls = []

    def read(name):
        calls.append(name)
        return torch.tensor(len(name)), name.upper()

    names = ts.string_input_producer(["a", "bb", "ccc"], num_epochs=1, shuffle=False)
    length, upper = ts.py_func(read, [names.dequeue], [torch.int64, str])
    lengths, uppers = ts.batch([length, upper], batch_size=3)
    runners()
    value = ts.Session().run([lengths, uppers])
    assert value[0].tolist() == [1, 2, 3] and value[1] == ["A", "BB", "CCC"]
    assert calls == ["a", "bb", "ccc"]
    single = ts.py_func(lambda x: x * 2, [torch.tensor(4)], torch.int64)
    assert single().item() == 8
    wrong = ts.py_func(lambda: 1, [], [int, int], name="two")
    with pytest.raises(ValueError, match=r"py_func 'two'.* must return 2 values"):
        wrong()


def test_maybe_batch_join_keeps_rows_of_every_input(runners):
    a = ts.limit_epochs(torch.arange(4), 1)
    b = ts.limit_epochs(torch.arange(10, 14), 1)
    keep = torch.tensor([True, True, False, False])
    batch = ts.maybe_batch_join(
        [[a], [b]], keep, batch_size=8, enqueue_many=True, allow_smaller_final_batch=True
    )
    runners()
    assert sorted(batch().tolist()) == [0, 1, 10, 11]
