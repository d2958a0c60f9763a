"""Session.run: fetch structures, feeds, closing, and the step boundary."""

from __future__ import annotations

import collections
import threading

import pytest
import torch

from torchsupervisor import (
    CheckpointReader,
    GlobalStep,
    Session,
    Supervisor,
    global_variables_initializer,
    latest_checkpoint,
    local_variables_initializer,
    report_uninitialized_variables,
)
from torchsupervisor.errors import InvalidArgumentError


def test_fetch_structures_keep_their_shape():
    calls = []

    def op():
        calls.append(1)
        return 3

    t = torch.ones(2)
    Pair = collections.namedtuple("Pair", "a b")
    sess = Session({})
    out = sess.run(
        {"x": [op, (op, t)], "p": Pair(GlobalStep(4), None), "o": collections.OrderedDict(k=op)}
    )
    assert out["x"][0] == 3 and out["x"][1][0] == 3 and out["x"][1][1] is t
    assert out["p"] == Pair(4, None) and isinstance(out["p"], Pair)
    assert isinstance(out["o"], collections.OrderedDict)
    assert len(calls) == 1  # One evaluation per run, however often it is fetched.
    assert sess.run(op) == 3 and len(calls) == 2


def test_invalid_fetch():
    with pytest.raises(TypeError, match="Fetch argument 'x' has invalid type str"):
        Session().run("x")


def test_feed_dict_goes_to_the_callables_that_take_it():
    def step(x, scale=1):
        return x * scale

    def other():
        return "o"

    def takes_all(**kw):
        return sorted(kw)

    sess = Session()
    assert sess.run([step, other], feed_dict={"x": 2, "scale": 5}) == [10, "o"]
    assert sess.run(takes_all, feed_dict={"a": 1}) == ["a"]
    with pytest.raises(TypeError, match=r"feed_dict keys \['y'\] are not arguments"):
        sess.run(step, feed_dict={"x": 1, "y": 2})
    with pytest.raises(TypeError, match="feed_dict keys must be strings"):
        sess.run(step, feed_dict={1: 2})


def test_closed_session():
    sess = Session({"a": 1})
    with sess:
        assert sess.state == {"a": 1} and sess.master == "" and sess.device.type == "cpu"
    assert sess.closed
    with pytest.raises(RuntimeError, match=r"Attempted to use a closed Session\."):
        sess.run(lambda: 1)
    sess.close()


def test_unsupported_masters_are_named():
    with pytest.raises(InvalidArgumentError, match=r"master='grpc://x:1' is not supported"):
        Session(master="grpc://x:1")


def test_boundary_work_runs_on_the_owner_thread_only():
    sess = Session()
    ran = []
    sess.boundary.call_soon(lambda: ran.append(threading.get_ident()))
    other = threading.Thread(target=sess.run, args=(lambda: None,))
    other.start()
    other.join(10)
    assert ran == [] and sess.boundary.pending
    sess.run(lambda: None)
    assert ran == [threading.get_ident()] and not sess.boundary.pending


def test_boundary_task_errors_propagate_and_keep_the_rest():
    sess = Session()
    ran = []

    def bad():
        raise ValueError("boom")

    sess.boundary.call_soon(bad)
    sess.boundary.call_soon(lambda: ran.append(1))
    with pytest.raises(ValueError, match="boom"):
        sess.run(lambda: None)
    assert ran == [] and sess.boundary.pending
    sess.run(lambda: None)
    assert ran == [1]


@pytest.mark.parametrize(
    "shape", ["list", "tuple", "dict", "nested"], ids=lambda s: f"StopIteration in a {s}"
)
def test_stop_iteration_inside_any_fetch_ends_training_cleanly(tmp_path, shape):
    """PEP 479 turned a StopIteration in a list fetch into RuntimeError: the run died without
    its final checkpoint."""
    batches = iter(range(3))

    def next_batch():
        return next(batches)

    fetch = {
        "list": [next_batch],
        "tuple": (next_batch, None),
        "dict": {"batch": next_batch},
        "nested": [{"a": (next_batch,)}],
    }[shape]
    step = GlobalStep()
    sv = Supervisor(logdir=str(tmp_path), state={"global_step": step}, save_summaries_secs=0)
    with sv.managed_session() as sess:
        while not sv.should_stop():
            sess.run(fetch)
            step.increment()
    assert step.value == 3
    assert CheckpointReader(latest_checkpoint(str(tmp_path))).global_step == 3  # Final save.
    with pytest.raises(StopIteration):
        Session().run([next_batch])  # Plainly: the StopIteration itself.


def test_sess_run_of_the_initializers_works_as_in_tf():
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    sess = Session({"model": model})
    assert sess.run(report_uninitialized_variables()) == ["model/weight", "model/bias"]
    assert sess.run([global_variables_initializer(), local_variables_initializer()]) == [
        None,
        None,
    ]
    assert sess.run(report_uninitialized_variables()) == []
    assert model.weight.device.type == "cpu" and torch.isfinite(model.weight).all()


def test_numbers_are_fetched_as_they_are():
    # Eager values such as a queue's size() may be fetched, as TF's size tensors were.
    assert Session().run([3, 2.5, True]) == [3, 2.5, True]


def test_call_each_runs_at_every_boundary_after_the_queued_tasks_until_removed():
    sess = Session({})
    order = []

    def each() -> None:
        order.append("each")

    sess.boundary.call_each(each)
    sess.boundary.call_soon(lambda: order.append("once"))
    sess.run(lambda: None)
    sess.run(lambda: None)
    assert order == ["once", "each", "each"]
    sess.boundary.remove_each(each)
    assert not sess.boundary.pending
    sess.run(lambda: None)
    assert order == ["once", "each", "each"]
    sess.boundary.call_each(each)
    sess.close()  # Closing drops them too.
    assert not sess.boundary.pending


def test_call_each_first_runs_before_the_queued_tasks_and_keeps_them_when_it_raises():
    sess = Session({})
    order = []
    failing = [True]

    def first() -> None:
        order.append("first")
        if failing[0]:
            raise RuntimeError("a rank died")

    sess.boundary.call_each(lambda: order.append("each"))
    sess.boundary.call_each(first, first=True)
    sess.boundary.call_soon(lambda: order.append("once"))
    with pytest.raises(RuntimeError, match="a rank died"):
        sess.run(lambda: None)
    assert order == ["first"]  # Nothing after it ran: not the snapshot of that boundary.
    failing[0] = False
    sess.run(lambda: None)
    assert order == ["first", "first", "once", "each"]  # The queued task was kept.
    sess.boundary.remove_each(first)
    sess.run(lambda: None)
    assert order == ["first", "first", "once", "each", "each"]
