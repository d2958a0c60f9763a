"""TF's queues: arrival order of waiting operations, RandomShuffleQueue, PaddingFIFOQueue,
PriorityQueue, and the queues' resumable state."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from monitored_helpers import JOIN_SECS

import torchsupervisor as ts
from torchsupervisor.errors import CancelledError, DeadlineExceededError, OutOfRangeError
from torchsupervisor.input.gate import GATE
from torchsupervisor.testing import FakeClock, pending_enqueues


def wait_until(predicate, what="condition"):
    deadline = time.monotonic() + JOIN_SECS
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached"
        time.sleep(0.001)


def in_thread(fn):
    result = {}

    def run():
        try:
            result["value"] = fn()
        except Exception as e:
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def finish(thread):
    thread.join(JOIN_SECS)
    assert not thread.is_alive()


# -- FIFOQueue: waiting operations ---------------------------------------------------------


def test_dequeue_many_larger_than_the_capacity_completes():
    queue = ts.FIFOQueue(2)
    thread, result = in_thread(lambda: queue.dequeue_many(5))
    for i in range(5):
        queue.enqueue(torch.tensor(i))
    finish(thread)
    assert result["value"].tolist() == [0, 1, 2, 3, 4]
    assert queue.size() == 0


def test_enqueue_many_larger_than_the_capacity_enters_in_order():
    queue = ts.FIFOQueue(3)
    thread, result = in_thread(lambda: queue.enqueue_many(list(range(7))))
    taken = [queue.dequeue() for _ in range(7)]
    finish(thread)
    assert taken == list(range(7)) and "error" not in result


def test_enqueues_waiting_for_room_enter_in_arrival_order_and_whole():
    queue = ts.FIFOQueue(1)
    queue.enqueue("x")
    first, _ = in_thread(lambda: queue.enqueue_many(["a1", "a2", "a3"]))
    wait_until(lambda: pending_enqueues(queue) == 3, "first enqueue waiting")
    second, _ = in_thread(lambda: queue.enqueue_many(["b1", "b2"]))
    wait_until(lambda: pending_enqueues(queue) == 5, "second enqueue waiting")
    taken = [queue.dequeue() for _ in range(6)]
    finish(first)
    finish(second)
    assert taken == ["x", "a1", "a2", "a3", "b1", "b2"]


def test_a_failed_dequeue_many_gives_back_what_it_gathered():
    queue = ts.FIFOQueue(5)
    queue.enqueue_many([1, 2, 3])
    queue.close()
    with pytest.raises(OutOfRangeError, match=r"requested 4, current size 3"):
        queue.dequeue_many(4)
    assert queue.size() == 3
    assert queue.dequeue_up_to(4) == [1, 2, 3]


def test_a_timed_out_dequeue_gives_back_and_a_timed_out_enqueue_withdraws():
    clock = FakeClock()
    queue = ts.FIFOQueue(2, clock=clock)
    queue.enqueue(1)
    clock.advance(10)  # A deadline already passed: the first wait fails at once.
    with pytest.raises(DeadlineExceededError):
        queue.dequeue_many(2, timeout_secs=0)
    assert queue.size() == 1
    queue.enqueue(2)
    with pytest.raises(DeadlineExceededError):
        queue.enqueue_many([3, 4], timeout_secs=0)
    assert queue.size() == 2 and not pending_enqueues(queue)


def test_cancelled_enqueues_are_kept_for_a_reopen_not_dequeued():
    queue = ts.FIFOQueue(1)
    queue.enqueue("in")
    thread, result = in_thread(lambda: queue.enqueue_many(["p1", "p2"]))
    wait_until(lambda: pending_enqueues(queue) == 2, "enqueue waiting")
    queue.close(cancel_pending_enqueues=True)
    finish(thread)
    assert isinstance(result["error"], CancelledError)
    assert queue.dequeue() == "in"
    with pytest.raises(OutOfRangeError):
        queue.dequeue()
    assert queue.state_dict()["pending"] == ["p1", "p2"]
    twin = ts.FIFOQueue(1)  # A restarted program: its enqueues' elements come back first.
    twin.load_state_dict(queue.state_dict())
    assert [twin.dequeue() for _ in range(2)] == ["p1", "p2"]


def test_enqueue_on_a_closed_queue_names_its_kind():
    queue = ts.RandomShuffleQueue(4, 1, name="rsq")
    queue.close()
    with pytest.raises(CancelledError, match=r"RandomShuffleQueue 'rsq' is closed\."):
        queue.enqueue(1)


# -- RandomShuffleQueue -------------------------------------------------------------------


def test_random_shuffle_queue_waits_for_more_than_min_after_dequeue():
    queue = ts.RandomShuffleQueue(10, 3, seed=1)
    queue.enqueue_many([0, 1, 2])
    thread, result = in_thread(queue.dequeue)
    queue.enqueue(3)  # 4 elements: one may leave, 3 stay.
    finish(thread)
    assert result["value"] in {0, 1, 2, 3}
    assert queue.size() == 3


def test_random_shuffle_queue_closed_drains_below_min_after_dequeue():
    queue = ts.RandomShuffleQueue(10, 5, seed=3)
    queue.enqueue_many([10, 20, 30])
    queue.close()
    drained = queue.dequeue_up_to(10)
    assert sorted(drained) == [10, 20, 30]
    with pytest.raises(OutOfRangeError, match=r"RandomShuffleQueue .* insufficient elements"):
        queue.dequeue()


def test_random_shuffle_queue_picks_among_the_oldest_and_repeats_with_a_seed():
    def order(seed):
        queue = ts.RandomShuffleQueue(100, 4, seed=seed)
        queue.enqueue_many(list(range(60)))
        queue.close()
        return [queue.dequeue() for _ in range(60)]

    first = order(5)
    assert sorted(first) == list(range(60))
    assert first == order(5) and first != order(6)
    # The k-th element out was among the oldest min_after_dequeue + 1 left.
    left = list(range(60))
    for value in first:
        assert value in left[:5]
        left.remove(value)


def test_random_shuffle_queue_validates_min_after_dequeue():
    with pytest.raises(ValueError, match="less than capacity"):
        ts.RandomShuffleQueue(5, 5)
    with pytest.raises(ValueError, match="at least 0"):
        ts.RandomShuffleQueue(5, -1)


def test_random_shuffle_queue_keeps_the_components_of_an_element_together():
    queue = ts.RandomShuffleQueue(10, 2, [torch.float32, torch.int64], seed=0)
    queue.enqueue_many((torch.arange(6).view(6, 1) * 10.0, torch.arange(6)))
    assert queue.size() == 6
    x, ids = queue.dequeue_many(3)
    assert x.shape == (3, 1) and ids.shape == (3,)
    assert torch.equal(x[:, 0], ids * 10.0)
    assert queue.size() == 3


# -- PaddingFIFOQueue ---------------------------------------------------------------------


def test_padding_queue_pads_each_component_to_the_longest():
    queue = ts.PaddingFIFOQueue(5, [torch.int64, torch.int64], [[None], [None, 2]])
    queue.enqueue((torch.tensor([1, 2, 3]), torch.ones(1, 2, dtype=torch.int64)))
    queue.enqueue((torch.tensor([4]), torch.ones(3, 2, dtype=torch.int64)))
    a, b = queue.dequeue_many(2)
    assert a.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert b.shape == (2, 3, 2) and b[0, 1:].abs().sum() == 0 and b[1].sum() == 6


def test_padding_queue_checks_shapes_at_enqueue():
    queue = ts.PaddingFIFOQueue(5, [torch.float32], [[None, 3]], name="pad")
    with pytest.raises(ValueError, match=r"Shape mismatch in tuple component 0 .* Expected"):
        queue.enqueue((torch.zeros(2, 4),))
    with pytest.raises(ValueError, match="1 shapes for 2 dtypes"):
        ts.PaddingFIFOQueue(5, [torch.float32, torch.int64], [[None]])


# -- PriorityQueue ------------------------------------------------------------------------


def test_priority_queue_lowest_first_ties_in_arrival_order():
    queue = ts.PriorityQueue(10, [None])
    for priority, value in [(3, "c"), (1, "a1"), (2, "b"), (1, "a2"), (torch.tensor(0), "z")]:
        queue.enqueue((priority, value))
    assert queue.dequeue()[1] == "z"
    priorities, values = queue.dequeue_many(3)
    assert priorities.tolist() == [1, 1, 2] and values == ["a1", "a2", "b"]
    with pytest.raises(ValueError, match="priority"):
        queue.enqueue(("high", "x"))


def test_priority_queue_enqueue_many_zips_priorities_and_components():
    queue = ts.PriorityQueue(10, [torch.float32])
    queue.enqueue_many((torch.tensor([5, 1, 3]), torch.tensor([50.0, 10.0, 30.0])))
    priorities, values = queue.dequeue_many(3)
    assert priorities.tolist() == [1, 3, 5] and values.tolist() == [10.0, 30.0, 50.0]


# -- Resumable state ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: ts.FIFOQueue(8),
        lambda: ts.RandomShuffleQueue(8, 2, seed=4),
        lambda: ts.PriorityQueue(8, [None]),
    ],
    ids=["fifo", "random", "priority"],
)
def test_a_restored_queue_continues_as_the_original(make):
    original, copy = make(), make()
    elements = [(p, f"e{p}") for p in [5, 3, 7, 1, 2, 6, 4, 0]]
    for element in elements:
        original.enqueue(element)
    thread, _ = in_thread(lambda: original.enqueue((9, "e9")))
    wait_until(lambda: pending_enqueues(original) == 1, "enqueue waiting")
    state = original.state_dict()
    copy.load_state_dict(state)
    assert copy.size() == 8 and copy.state_dict()["pending"] == [(9, "e9")]
    original.close()  # Waiting enqueues still complete; min_after_dequeue no longer holds.
    copy.close()
    rest_original = [original.dequeue(timeout_secs=JOIN_SECS) for _ in range(9)]
    finish(thread)
    rest_copy = [copy.dequeue(timeout_secs=JOIN_SECS) for _ in range(9)]
    assert rest_copy == rest_original


def test_state_counts_what_a_waiting_dequeue_many_gathered():
    queue = ts.RandomShuffleQueue(10, 1, seed=2)
    twin = ts.RandomShuffleQueue(10, 1, seed=2)
    thread, result = in_thread(lambda: queue.dequeue_many(6))
    queue.enqueue_many(list(range(4)))  # 3 of them can leave; the dequeue waits for 3 more.
    wait_until(lambda: queue.size() == 1, "gathering")  # It took 3 of the 4.
    assert queue.size() == 1  # As TF: what the waiting dequeue took is not counted.
    with GATE.exclusive():
        state = queue.state_dict()
    assert sorted(state["elements"]) == [0, 1, 2, 3]
    twin.load_state_dict(state)
    queue.enqueue_many([4, 5, 6])
    finish(thread)
    twin.enqueue_many([4, 5, 6])
    assert twin.dequeue_many(6, timeout_secs=JOIN_SECS) == result["value"]


def test_loading_refuses_another_kind_or_a_queue_in_use():
    queue = ts.FIFOQueue(4, name="q")
    state = ts.RandomShuffleQueue(4, 1).state_dict()
    with pytest.raises(ValueError, match="RandomShuffleQueue"):
        queue.load_state_dict(state)
    queue.enqueue(1)
    with pytest.raises(ValueError, match="'q' is in use"):
        queue.load_state_dict(ts.FIFOQueue(4).state_dict())


def test_an_enqueue_op_cannot_snapshot_the_pipeline():
    with GATE.share(), pytest.raises(RuntimeError, match="cannot snapshot"):
        ts.FIFOQueue(2).state_dict()
