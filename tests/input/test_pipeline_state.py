"""InputPipelineState in one process: a pipeline rebuilt and restored continues exactly."""

from __future__ import annotations

import pytest
import torch
from monitored_helpers import JOIN_SECS

import torchsupervisor as ts
from torchsupervisor.core.registry import Graph
from torchsupervisor.errors import OutOfRangeError


def build(graph):
    """producer -> reader (py_func) -> shuffle_batch, and a limit_epochs batch, in ``graph``."""
    with graph.as_default():
        names = ts.string_input_producer(
            [f"f{i}" for i in range(30)], num_epochs=2, seed=3, capacity=4
        )
        number = ts.py_func(lambda n: torch.tensor(int(n[1:])), [names.dequeue], torch.int64)
        shuffled = ts.shuffle_batch(
            [number], 4, capacity=12, min_after_dequeue=5, seed=9, allow_smaller_final_batch=True
        )
        counted = ts.batch(ts.limit_epochs(torch.tensor(7), 5), 2, allow_smaller_final_batch=True)
        return shuffled, counted, ts.InputPipelineState(graph=graph)


def start(graph):
    coord = ts.Coordinator()
    with graph.as_default():
        threads = ts.start_queue_runners(coord=coord)
    return coord, threads


def stop(coord, threads):
    coord.request_stop()
    coord.join(threads, stop_grace_period_secs=JOIN_SECS)


def drain(fetch):
    out = []
    for _ in range(100):
        try:
            out.append(fetch().tolist())
        except OutOfRangeError:
            return out
    raise AssertionError("no end")


def test_a_rebuilt_pipeline_restored_from_a_state_continues_exactly():
    reference_graph = Graph()
    shuffled, counted, _ = build(reference_graph)
    coord, threads = start(reference_graph)
    reference = drain(shuffled)
    reference_counted = drain(counted)
    stop(coord, threads)
    assert sorted(i for batch in reference for i in batch) == sorted(list(range(30)) * 2)
    assert reference_counted == [[7, 7], [7, 7], [7]]

    first_graph = Graph()
    shuffled, counted, state = build(first_graph)
    coord, threads = start(first_graph)
    head = [shuffled().tolist() for _ in range(5)]
    head_counted = [counted().tolist()]
    saved = state.state_dict()
    stop(coord, threads)  # Cancels the waiting enqueues: their elements stay in the state.

    second_graph = Graph()
    shuffled, counted, state = build(second_graph)
    state.load_state_dict(saved)
    coord, threads = start(second_graph)
    assert head + drain(shuffled) == reference
    assert head_counted + drain(counted) == reference_counted
    stop(coord, threads)


def test_a_producer_state_is_small_whatever_the_input():
    graph = Graph()
    with graph.as_default():
        queue = ts.input_producer(torch.zeros(10_000, 3), capacity=5, shuffle=True, seed=1)
        state = ts.InputPipelineState()
        coord, threads = start(graph)
    queue.dequeue(timeout_secs=JOIN_SECS)
    saved = state.state_dict()
    stop(coord, threads)
    (runner,) = saved["runners"]
    assert len(runner["queue"]["elements"]) + len(runner["queue"]["pending"]) <= 6
    (producer,) = runner["ops"]
    assert producer["epochs"] == 1 and 5 <= producer["position"] <= 7


def test_restoring_into_another_pipeline_names_the_difference():
    graph = Graph()
    with graph.as_default():
        ts.range_input_producer(5, name="ids")
        saved = ts.InputPipelineState().state_dict()
    other = Graph()
    with other.as_default():
        ts.range_input_producer(5, name="other")
        with pytest.raises(ValueError, match="queue 'ids' where this one has 'other'"):
            ts.InputPipelineState().load_state_dict(saved)
        ts.range_input_producer(5)
        with pytest.raises(ValueError, match="2 queue runners, the saved state 1"):
            ts.InputPipelineState().load_state_dict(saved)


def test_a_queue_fed_from_an_iterable_is_refused_with_the_reason():
    ts.queue_from_iterable([1, 2, 3], name="loader")
    with pytest.raises(TypeError, match="'loader' is fed by queue_from_iterable"):
        ts.InputPipelineState().state_dict()


def test_a_monitored_training_session_resumes_the_pipeline(tmp_path):
    def run(steps):
        ts.reset_default_graph()
        labels = ts.shuffle_batch(
            [ts.range_input_producer(40, num_epochs=1, seed=1).dequeue],
            batch_size=4,
            capacity=16,
            min_after_dequeue=4,
            seed=2,
        )
        step = ts.GlobalStep()
        state = {"global_step": step, "input": ts.InputPipelineState()}
        seen = []
        with ts.MonitoredTrainingSession(
            checkpoint_dir=str(tmp_path / "run") if steps else None,
            state=state,
            hooks=[ts.StopAtStepHook(last_step=steps or 10)],
            save_summaries_steps=0,
            log_step_count_steps=0,
        ) as sess:
            while not sess.should_stop():
                seen.append(sess.run(labels).tolist())
                step.increment()
        return seen

    reference = run(None)  # Ten batches, no checkpoints.
    assert run(4) + run(10) == reference
