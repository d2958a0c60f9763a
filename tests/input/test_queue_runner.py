"""FIFOQueue, QueueRunner, queue_from_iterable; end of input as a clean stop."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from monitored_helpers import JOIN_SECS, Counter

from torchsupervisor import GlobalStep, Supervisor
from torchsupervisor.core.coordinator import Coordinator
from torchsupervisor.core.registry import Graph, GraphKeys, get_collection
from torchsupervisor.errors import (
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    OutOfRangeError,
    UnimplementedError,
)
from torchsupervisor.input.queue import FIFOQueue
from torchsupervisor.input.queue_runner import (
    QueueRunner,
    add_queue_runner,
    queue_from_iterable,
    start_queue_runners,
)
from torchsupervisor.input.queues import PaddingFIFOQueue


def join_all(threads):
    for thread in threads:
        thread.join(JOIN_SECS)
        assert not thread.is_alive(), thread.name


def wait_until(predicate, what="condition"):
    deadline = time.monotonic() + JOIN_SECS
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached"
        time.sleep(0.001)


class ObservedQueue(FIFOQueue):
    """A FIFOQueue that tells when a caller starts waiting (for enqueue room or an element)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.waiting = threading.Event()

    def _wait(self, deadline):
        self.waiting.set()
        super()._wait(deadline)


def drain(queue):
    items = []
    while True:
        try:
            items.append(queue.dequeue(timeout_secs=JOIN_SECS))
        except OutOfRangeError:
            return items


# ----------------------------------------------------------------------------------- FIFOQueue


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be a positive integer, got 0"):
        FIFOQueue(0)


def test_first_in_first_out_and_size():
    queue = FIFOQueue(3, name="q")
    for item in ("a", "b", "c"):
        queue.enqueue(item)
    assert queue.size() == 3 and queue.name == "q" and queue.capacity == 3
    assert [queue.dequeue(), queue.dequeue()] == ["a", "b"]
    assert queue.size() == 1 and not queue.is_closed()


def test_enqueue_blocks_while_full():
    queue = FIFOQueue(1)
    queue.enqueue(1)
    done = threading.Event()

    def producer():
        queue.enqueue(2)
        done.set()

    thread = threading.Thread(target=producer)
    thread.start()
    assert not done.wait(0.05)
    assert queue.dequeue() == 1
    join_all([thread])
    assert queue.dequeue() == 2


def test_timeouts():
    queue = FIFOQueue(1)
    with pytest.raises(DeadlineExceededError, match="Timed out waiting for notification"):
        queue.dequeue(timeout_secs=0.01)
    queue.enqueue(1)
    with pytest.raises(DeadlineExceededError):
        queue.enqueue(2, timeout_secs=0.01)


def test_a_closed_queue_drains_then_raises_out_of_range():
    queue = FIFOQueue(5, name="fifo")
    queue.enqueue(1)
    queue.close()
    assert queue.is_closed()
    with pytest.raises(CancelledError, match=r"^FIFOQueue 'fifo' is closed\.$"):
        queue.enqueue(2)
    assert queue.dequeue() == 1
    with pytest.raises(
        OutOfRangeError,
        match=r"^FIFOQueue 'fifo' is closed and has insufficient elements \(requested 1, "
        r"current size 0\)$",
    ):
        queue.dequeue()
    queue.close()  # Idempotent.


def test_close_wakes_a_blocked_dequeue():
    queue = ObservedQueue(2)
    errors = []

    def consumer():
        try:
            queue.dequeue()
        except OutOfRangeError as e:
            errors.append(e)

    thread = threading.Thread(target=consumer)
    thread.start()
    assert queue.waiting.wait(JOIN_SECS)
    queue.close()
    join_all([thread])
    assert len(errors) == 1


def test_close_keeps_pending_enqueues_unless_cancelled():
    for cancel in (False, True):
        queue = ObservedQueue(1)
        queue.enqueue("first")
        outcome = []

        def producer(queue=queue, outcome=outcome):
            try:
                queue.enqueue("pending")
                outcome.append("enqueued")
            except CancelledError as e:
                outcome.append(str(e))

        thread = threading.Thread(target=producer)
        thread.start()
        assert queue.waiting.wait(JOIN_SECS)
        queue.close(cancel_pending_enqueues=cancel)
        if cancel:
            join_all([thread])
            assert outcome == ["Enqueue operation was cancelled"]
            assert drain(queue) == ["first"]
        else:
            assert queue.dequeue() == "first"
            join_all([thread])
            assert outcome == ["enqueued"]
            assert drain(queue) == ["pending"]


def test_enqueue_many_and_dequeue_many():
    queue = FIFOQueue(10)
    queue.enqueue_many(torch.arange(6).reshape(3, 2))
    batch = queue.dequeue_many(2)
    assert torch.equal(batch, torch.tensor([[0, 1], [2, 3]]))
    queue.enqueue_many(["x", "y"])
    mixed = queue.dequeue_many(3)  # Not all tensors: a list.
    assert isinstance(mixed, list) and torch.equal(mixed[0], torch.tensor([4, 5]))
    assert mixed[1:] == ["x", "y"]
    assert queue.size() == 0


def test_several_components_and_names():
    pairs = FIFOQueue(10, dtypes=[torch.float32, torch.int64])
    pairs.enqueue_many((torch.zeros(3, 2), torch.arange(3)))
    assert pairs.dequeue()[1] == 0
    x, y = pairs.dequeue_many(2)
    assert x.shape == (2, 2) and torch.equal(y, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="expects 2 components, got 3"):
        pairs.enqueue_many((torch.zeros(1), torch.zeros(1), torch.zeros(1)))
    named = FIFOQueue(10, dtypes=[torch.float32], names=["x"])
    named.enqueue_many({"x": torch.arange(4.0)})
    assert named.dequeue() == {"x": torch.tensor(0.0)}
    assert torch.equal(named.dequeue_many(2)["x"], torch.tensor([1.0, 2.0]))


def test_dequeue_many_and_up_to_on_a_closed_queue():
    queue = FIFOQueue(10)
    queue.enqueue_many([1, 2, 3])
    queue.close()
    with pytest.raises(OutOfRangeError, match=r"requested 5, current size 3"):
        queue.dequeue_many(5)
    assert queue.dequeue_up_to(5) == [1, 2, 3]
    with pytest.raises(OutOfRangeError):
        queue.dequeue_up_to(5)


# --------------------------------------------------------------------------------- QueueRunner


def test_runner_argument_errors():
    with pytest.raises(ValueError, match=r"^Must provide queue and enqueue_ops\.$"):
        QueueRunner(FIFOQueue(1), [])
    with pytest.raises(TypeError, match="must be a tuple of exception types"):
        QueueRunner(FIFOQueue(1), [lambda: None], queue_closed_exception_types=[OutOfRangeError])
    with pytest.raises(UnimplementedError):
        QueueRunner(queue_runner_def=object())


def counting_op(queue, limit, taken=None):
    """An enqueue op that enqueues 0..limit-1 (shared by its threads), then ends the input."""
    lock = threading.Lock()
    state = {"next": 0}

    def enqueue():
        with lock:
            value = state["next"]
            if value >= limit:
                raise OutOfRangeError("no more values")
            state["next"] += 1
        queue.enqueue(value)

    return enqueue


def test_end_of_input_closes_the_queue_after_the_last_thread():
    queue = FIFOQueue(4, name="numbers")
    op = counting_op(queue, 50)
    runner = QueueRunner(queue, [op, op, op])
    threads = runner.create_threads(None, start=True)
    assert len(threads) == 3  # No coordinator: no closing thread.
    assert all(t.name.startswith("QueueRunnerThread-numbers-") for t in threads)
    assert sorted(drain(queue)) == list(range(50))
    join_all(threads)
    assert runner.exceptions_raised == []
    assert runner.name == "numbers"


def test_threads_are_created_once_per_session_while_running():
    queue = FIFOQueue(1)
    runner = QueueRunner(queue, [counting_op(queue, 10**9)])
    coord = Coordinator()
    threads = runner.create_threads("sess", coord=coord)
    assert len(threads) == 2 and not any(t.is_alive() for t in threads)
    for thread in threads:
        thread.start()
    assert runner.create_threads("sess", coord=coord) == []
    coord.request_stop()
    coord.join(stop_grace_period_secs=JOIN_SECS)
    assert queue.is_closed()
    join_all(threads)


def test_a_stop_request_closes_the_queue_and_ends_blocked_threads():
    queue = FIFOQueue(2)
    runner = QueueRunner(queue, [counting_op(queue, 10**9)])
    coord = Coordinator()
    threads = runner.create_threads(None, coord=coord, daemon=True, start=True)
    wait_until(lambda: queue.size() == 2, "a full queue")
    coord.request_stop()
    coord.join(stop_grace_period_secs=JOIN_SECS)  # Raises nothing: the cancel is not an error.
    join_all(threads)
    assert queue.is_closed()
    assert all(t.daemon for t in threads)


def test_errors_go_to_the_coordinator():
    queue = FIFOQueue(2)

    def broken():
        raise KeyError("bad record")

    runner = QueueRunner(queue, [broken])
    coord = Coordinator()
    threads = runner.create_threads(None, coord=coord, start=True)
    assert coord.wait_for_stop(JOIN_SECS)
    with pytest.raises(KeyError, match="bad record"):
        coord.join(stop_grace_period_secs=JOIN_SECS)
    join_all(threads)
    assert runner.exceptions_raised == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_errors_without_a_coordinator_are_kept(caplog):
    queue = FIFOQueue(2)
    error = KeyError("bad record")

    def broken():
        raise error

    runner = QueueRunner(queue, [broken])
    threads = runner.create_threads(None, start=True)
    join_all(threads)
    assert runner.exceptions_raised == [error]
    assert "Exception in QueueRunner" in caplog.text


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_enqueue_error_without_a_coordinator_closes_the_queue():
    # The seed: the close op "will be run if the enqueue ops raise exceptions". The consumer
    # gets what was queued, then OutOfRangeError, instead of waiting forever.
    queue = FIFOQueue(4)
    records = iter([1, 2])

    def read():
        queue.enqueue(next(records))  # The third call raises StopIteration: not end of input.

    runner = QueueRunner(queue, [read])
    join_all(runner.create_threads(None, start=True))
    assert [type(e) for e in runner.exceptions_raised] == [StopIteration]
    assert drain(queue) == [1, 2]


def test_ops_taking_the_session_receive_it():
    queue = FIFOQueue(10)
    seen = []

    def op(sess):
        seen.append(sess)
        raise OutOfRangeError("done")

    join_all(QueueRunner(queue, [op]).create_threads("the session", start=True))
    assert seen == ["the session"]
    assert queue.is_closed()


def test_custom_close_and_cancel_ops():
    queue = FIFOQueue(10)
    events = []
    runner = QueueRunner(
        queue,
        [counting_op(queue, 3)],
        close_op=lambda: events.append("close"),
        cancel_op=lambda sess: events.append(("cancel", sess)),
    )
    coord = Coordinator()
    threads = runner.create_threads("s", coord=coord, start=True)
    wait_until(lambda: events == ["close"], "close op")
    coord.request_stop()
    coord.join(stop_grace_period_secs=JOIN_SECS)
    join_all(threads)
    assert events == ["close", ("cancel", "s")]
    assert runner.close_op is not None and runner.cancel_op is not None
    assert runner.queue_closed_exception_types == (OutOfRangeError,)


def test_collection_helpers():
    queue = FIFOQueue(10)
    runner = QueueRunner(queue, [counting_op(queue, 3)])
    add_queue_runner(runner)
    add_queue_runner(QueueRunner(FIFOQueue(1), [lambda: None]), collection="elsewhere")
    assert get_collection(GraphKeys.QUEUE_RUNNERS) == [runner]
    threads = start_queue_runners()
    assert len(threads) == 1 and threads[0].daemon
    join_all(threads)
    assert drain(queue) == [0, 1, 2]


# ------------------------------------------------------------------------- queue_from_iterable


def test_queue_from_iterable_yields_everything_then_out_of_range():
    queue = queue_from_iterable(range(20), capacity=3, name="ints")
    threads = start_queue_runners()
    assert drain(queue) == list(range(20))  # One thread: in order.
    join_all(threads)


def test_epochs_threads_and_map_fn():
    queue = queue_from_iterable([1, 2, 3], num_epochs=2, num_threads=3, map_fn=lambda x: x * 10)
    threads = start_queue_runners()
    assert sorted(drain(queue)) == [10, 10, 20, 20, 30, 30]
    join_all(threads)
    assert len(threads) == 3


def test_a_one_shot_iterator_or_an_empty_epoch_ends_the_input():
    queue = queue_from_iterable(iter([1, 2]), num_epochs=None)
    threads = start_queue_runners()
    assert drain(queue) == [1, 2]
    join_all(threads)


def test_a_dataloader():
    dataset = torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    queue = queue_from_iterable(loader)
    threads = start_queue_runners()
    batches = drain(queue)
    join_all(threads)
    assert [len(y) for _, y in batches] == [4, 4, 2]
    assert torch.equal(torch.cat([y for _, y in batches]), torch.arange(10))


def test_queue_from_iterable_argument_errors():
    with pytest.raises(ValueError, match="num_threads must be at least 1, got 0"):
        queue_from_iterable([], num_threads=0)
    with pytest.raises(ValueError, match="num_epochs must be None or at least 1, got 0"):
        queue_from_iterable([], num_epochs=0)


def test_a_restart_for_a_new_session_reopens_the_queue_and_loses_nothing():
    taken = []

    def records():
        for i in range(10):
            taken.append(i)
            yield i

    queue = queue_from_iterable(records(), capacity=2)
    (runner,) = get_collection(GraphKeys.QUEUE_RUNNERS)
    coord = Coordinator()
    threads = runner.create_threads("first", coord=coord, start=True)
    assert queue.dequeue() == 0
    # 1 and 2 fill the queue; the thread waits to enqueue 3, which it holds.
    wait_until(lambda: queue.size() == 2 and len(taken) == 4, "a thread holding 3")
    coord.request_stop()
    coord.join(stop_grace_period_secs=JOIN_SECS)
    join_all(threads)
    assert queue.is_closed()
    coord.clear_stop()
    threads = runner.create_threads("second", coord=coord, start=True)
    assert not queue.is_closed()
    assert drain(queue) == list(range(1, 10))
    coord.request_stop()
    coord.join(stop_grace_period_secs=JOIN_SECS)
    join_all(threads)


# ---------------------------------------------------------------------- with the Supervisor


def test_end_of_input_is_a_clean_stop_of_managed_session(tmp_path):
    counter = Counter()
    batches = queue_from_iterable([torch.tensor(float(i)) for i in range(7)], capacity=2)
    seen = []

    def step():
        seen.append(float(batches.dequeue()))
        counter.step()

    sv = Supervisor(logdir=str(tmp_path), state=counter.state, save_summaries_secs=0)
    with sv.managed_session() as sess:
        while not sv.should_stop():
            sess.run(step)
    assert seen == [float(i) for i in range(7)]
    assert sv.should_stop()
    assert counter.global_step.value == 7
    assert (tmp_path / "model.ckpt-7.index").exists()  # The final checkpoint of a clean stop.


def test_an_input_error_ends_managed_session_with_that_error(tmp_path):
    def records():
        yield 1
        raise KeyError("corrupt record")

    batches = queue_from_iterable(records())
    step = GlobalStep()
    sv = Supervisor(logdir=str(tmp_path), state={"global_step": step}, save_summaries_secs=0)
    with pytest.raises(KeyError, match="corrupt record"), sv.managed_session() as sess:
        while not sv.should_stop():
            sess.run(batches.dequeue)


def test_dequeue_many_of_zero_and_bad_counts():
    q = FIFOQueue(4)
    q.enqueue(torch.tensor(1.0))
    assert q.dequeue_many(0) == [] and q.dequeue_up_to(0) == []
    assert q.size() == 1
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="non-negative int"):
            q.dequeue_many(bad)


def test_a_list_of_components_is_an_element_of_that_many_components():
    # TF's queue.enqueue([image, label]): a list is the element's components, as a tuple.
    pairs = FIFOQueue(10, dtypes=[torch.float32, torch.int64])
    for i in range(3):
        pairs.enqueue([torch.full((2,), float(i)), torch.tensor(i)])
    images, labels = pairs.dequeue_many(2)
    assert images.shape == (2, 2) and labels.tolist() == [0, 1]
    assert isinstance(pairs.dequeue(), tuple)
    with pytest.raises(ValueError, match=r"Queue 'fifo_queue' has 2 components.*got 3 components"):
        pairs.enqueue([torch.zeros(1), torch.zeros(1), torch.zeros(1)])
    with pytest.raises(ValueError, match=r"Queue 'fifo_queue' has 2 components.*got a Tensor"):
        pairs.enqueue(torch.zeros(2))
    # A PaddingFIFOQueue pads and checks the list's components like a tuple's.
    padded = PaddingFIFOQueue(10, dtypes=[torch.float32, torch.int64], shapes=[[None], []])
    padded.enqueue([torch.ones(1), torch.tensor(0)])
    padded.enqueue([torch.ones(3), torch.tensor(1)])
    values, lengths = padded.dequeue_many(2)
    assert values.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]] and lengths.tolist() == [0, 1]
    with pytest.raises(ValueError, match="padding_fifo_queue"):
        padded.enqueue([torch.ones(2, 2), torch.tensor(0)])
    # One declared component: a list of one is that component; undeclared lists stay whole.
    single = FIFOQueue(4, dtypes=[torch.float32])
    single.enqueue([torch.tensor(5.0)])
    assert single.dequeue() == torch.tensor(5.0)
    plain = FIFOQueue(4)
    plain.enqueue([1, 2])
    assert plain.dequeue() == [1, 2]


def test_a_dequeue_before_the_runners_start_fails_at_once_instead_of_hanging():
    # TF's graph-building `images, labels = queue.dequeue_many(n)` before the session: here it
    # would run at once and wait forever for a runner that starts with the session.
    with Graph().as_default():
        queue = FIFOQueue(10, dtypes=[torch.float32, torch.int64])
        runner = QueueRunner(queue, [lambda: queue.enqueue([torch.zeros(1), torch.tensor(0)])])
        add_queue_runner(runner)
        with pytest.raises(
            FailedPreconditionError,
            match=r"dequeue_many\(4\) on FIFOQueue 'fifo_queue' would wait forever",
        ):
            queue.dequeue_many(4)
        with pytest.raises(FailedPreconditionError, match=r"^dequeue\(\) on"):
            queue.dequeue()
        # Once started, the same call waits for the runner as usual.
        coord = Coordinator()
        threads = runner.create_threads(None, coord=coord, start=True)
        images, _ = queue.dequeue_many(4)
        assert images.shape == (4, 1)
        coord.request_stop()
        coord.join(threads, stop_grace_period_secs=JOIN_SECS)
