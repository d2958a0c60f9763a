"""Input queues fed by threads: ``FIFOQueue``, ``QueueRunner``, and a queue over any iterable.

TF 1 read its input through queues: threads run *enqueue ops* that fill a queue, the training
step dequeues from it, and the end of the input closes the queue, so that the step's dequeue
raises ``OutOfRangeError``: the normal end of training (``Supervisor.managed_session`` and
``MonitoredSession`` treat it as a clean stop). A ``QueueRunner`` owns the threads of one queue:
with a ``Coordinator`` it stops them with the training and reports their errors to it.

Here the "ops" are callables (taking the session, or nothing), and a queue holds any Python
objects (tensors are kept as they are: no copy). ``queue_from_iterable`` turns any iterable,
such as a ``torch.utils.data.DataLoader``, into a queue filled by runner threads::

    batches = queue_from_iterable(loader, capacity=8)   # its runner joins QUEUE_RUNNERS
    with sv.managed_session() as sess:                   # starts the collected runners
        while not sv.should_stop():
            sess.run(lambda: train_step(*batches.dequeue()))
    # the end of the loader ends the loop through OutOfRangeError: a clean stop

A queue is a Python object, not a resource of a session: when a runner that closed its queue
(end of input, or a stop) starts threads again for a new session (a ``MonitoredSession``
recovering from an ``AbortedError``, a new ``managed_session``), it reopens the queue; its
buffered elements are kept.

Graph-only parts have no counterpart: ``QueueRunner.to_proto``/``from_proto`` and
``queue_runner_def`` (no protos), ``dtypes``/``shapes`` checks (elements are Python objects).

TF names: ``tf.queue.FIFOQueue``, ``tf.compat.v1.train.QueueRunner``, ``add_queue_runner``,
``start_queue_runners``. TF's input producers and batching functions are in ``producers.py``
and ``batching.py``; ``queue_from_iterable`` feeds a queue from any iterable.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from torchsupervisor.core.coordinator import Coordinator
from torchsupervisor.core.registry import GraphKeys, get_default_graph
from torchsupervisor.errors import OutOfRangeError
from torchsupervisor.input.gate import GATE
from torchsupervisor.input.queue import FIFOQueue

if TYPE_CHECKING:
    from torchsupervisor.core.session import Op, SessionLike

__all__ = [
    "QueueRunner",
    "add_queue_runner",
    "queue_from_iterable",
    "start_queue_runners",
]

logger = logging.getLogger("torchsupervisor")


def _bind_session(op: Callable[..., Any], sess: SessionLike) -> Callable[[], Any]:
    """Return ``op`` as a zero-argument callable: ``op(sess)`` if it takes the session."""
    try:
        params = list(inspect.signature(op).parameters.values())
    except (TypeError, ValueError):
        return op
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    takes_session = any(
        p.kind in positional and p.default is inspect.Parameter.empty for p in params
    ) or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    return functools.partial(op, sess) if takes_session else op


def _op_name(op: Op) -> str:
    return getattr(op, "name", None) or getattr(op, "__name__", None) or type(op).__name__


class QueueRunner:
    """Runs the enqueue ops of a queue in threads, one thread per op.

    Each thread calls its enqueue op again and again (``op(sess)`` if it takes the session,
    else ``op()``) until the coordinator stops, or until the op raises one of
    ``queue_closed_exception_types`` (its input is exhausted or its queue closed): then the
    thread ends, and the last thread to end runs ``close_op`` (remaining elements can still be
    dequeued; after them ``dequeue`` raises ``OutOfRangeError``). Any other exception ends the
    thread and is reported to the coordinator (which stops training and re-raises it from
    ``join()``), or, without a coordinator, logged, kept in ``exceptions_raised``, closes the
    queue with ``close_op`` (the seed's "that op will be run if the enqueue ops raise
    exceptions": a consumer gets what was queued, then ``OutOfRangeError``, instead of
    waiting forever) and is re-raised in the thread. With a coordinator, one more thread waits
    for the stop request and then runs ``cancel_op`` (closes the queue, failing the enqueues
    waiting for room), so that no runner thread stays blocked.

    Args:
        queue: The queue the ops fill (its ``close`` gives the default close and cancel ops).
        enqueue_ops: Callables, one thread each (the same one several times gives parallel
            threads).
        close_op: Run by the last thread at the end of input; None: ``queue.close()``.
        cancel_op: Run at a stop request; None: ``queue.close(cancel_pending_enqueues=True)``.
        queue_closed_exception_types: Exception types that mean "this op is done"; None means
            ``(OutOfRangeError,)``. ``(OutOfRangeError, CancelledError)`` suits ops that dequeue
            from another queue.
        queue_runner_def: Not supported (no protos); must be None.
        import_scope: Not supported; must be None.

    Raises:
        ValueError: ``"Must provide queue and enqueue_ops."``.
        TypeError: If ``queue_closed_exception_types`` is not a tuple of exception classes.
        UnimplementedError: For ``queue_runner_def`` or ``import_scope``.

    Thread safety: ``create_threads`` and the properties may be called from any thread.

    TF name: ``tf.compat.v1.train.QueueRunner``.
    """

    def __init__(
        self,
        queue: Any = None,
        enqueue_ops: Sequence[Callable[..., Any]] | None = None,
        close_op: Callable[..., Any] | None = None,
        cancel_op: Callable[..., Any] | None = None,
        queue_closed_exception_types: tuple[type[BaseException], ...] | None = None,
        queue_runner_def: object = None,
        import_scope: str | None = None,
    ) -> None:
        if queue_runner_def is not None or import_scope is not None:
            from torchsupervisor.errors import UnimplementedError

            raise UnimplementedError(
                "queue_runner_def/import_scope: QueueRunner protos have no counterpart; build "
                "the runner from a queue and enqueue ops"
            )
        if queue is None or not enqueue_ops:
            raise ValueError("Must provide queue and enqueue_ops.")
        if queue_closed_exception_types is None:
            queue_closed_exception_types = (OutOfRangeError,)
        elif not isinstance(queue_closed_exception_types, tuple) or not all(
            isinstance(t, type) and issubclass(t, BaseException)
            for t in queue_closed_exception_types
        ):
            raise TypeError(
                "queue_closed_exception_types, when provided, must be a tuple of exception "
                f"types, but saw: {queue_closed_exception_types!r}"
            )
        self._queue = queue
        self._enqueue_ops = list(enqueue_ops)
        self._close_op = close_op if close_op is not None else queue.close
        self._cancel_op = (
            cancel_op
            if cancel_op is not None
            else functools.partial(queue.close, cancel_pending_enqueues=True)
        )
        self._queue_closed_exception_types = queue_closed_exception_types
        self._lock = threading.Lock()
        self._runs: dict[Any, int] = {}  # session -> threads still running for it
        self._exceptions_raised: list[BaseException] = []
        self._closed_queue = False
        self.started = False  # Whether threads were ever created (a queue's check reads it).

    @property
    def queue(self) -> Any:
        """The queue the enqueue ops fill.

        TF name: ``tf.compat.v1.train.QueueRunner.queue``.
        """
        return self._queue

    @property
    def enqueue_ops(self) -> list[Callable[..., Any]]:
        """The enqueue ops (one thread each), as a new list.

        TF name: ``tf.compat.v1.train.QueueRunner.enqueue_ops``.
        """
        return list(self._enqueue_ops)

    @property
    def close_op(self) -> Callable[..., Any]:
        """The op closing the queue at the end of input (``queue.close`` by default).

        TF name: ``tf.compat.v1.train.QueueRunner.close_op``.
        """
        return self._close_op

    @property
    def cancel_op(self) -> Callable[..., Any]:
        """The op closing the queue and cancelling pending enqueues at a stop.

        TF name: ``tf.compat.v1.train.QueueRunner.cancel_op``.
        """
        return self._cancel_op

    @property
    def queue_closed_exception_types(self) -> tuple[type[BaseException], ...]:
        """The exception types that end a thread quietly (a tuple of classes).

        TF name: ``tf.compat.v1.train.QueueRunner.queue_closed_exception_types``.
        """
        return self._queue_closed_exception_types

    @property
    def name(self) -> str:
        """The name of the queue (its class name if it has no ``name``).

        TF name: ``tf.compat.v1.train.QueueRunner.name``.
        """
        return getattr(self._queue, "name", type(self._queue).__name__)

    @property
    def exceptions_raised(self) -> list[BaseException]:
        """Exceptions raised by the threads created without a coordinator (a new list).

        With a coordinator, exceptions go to it and are not kept here. ``create_threads``
        clears the list when it creates threads.

        TF name: ``tf.compat.v1.train.QueueRunner.exceptions_raised``.
        """
        with self._lock:
            return list(self._exceptions_raised)

    def create_threads(
        self,
        sess: SessionLike,
        coord: Coordinator | None = None,
        daemon: bool = False,
        start: bool = False,
    ) -> list[threading.Thread]:
        """Create (and optionally start) the threads running the enqueue ops for ``sess``.

        If threads created for ``sess`` are still running, none are created. When this runner
        closed its queue earlier and none of its threads runs any more, the queue is reopened.

        Args:
            sess: Passed to enqueue, close and cancel ops that take an argument (may be None).
            coord: Stops the threads and receives their exceptions; the threads register with
                it (so ``coord.join()`` waits for them). None: exceptions are kept in
                ``exceptions_raised``.
            daemon: Make the threads daemons.
            start: Start the threads (else the caller starts them).

        Returns:
            The threads: one per enqueue op, plus, with ``coord``, one that runs ``cancel_op``
            when a stop is requested; empty if threads for ``sess`` are still running.

        TF name: ``tf.compat.v1.train.QueueRunner.create_threads``.
        """
        with self._lock:
            if self._runs.get(sess, 0) > 0:
                return []
            reopen = self._closed_queue and not any(self._runs.values())
            self._closed_queue = False
            self._runs[sess] = len(self._enqueue_ops)
            self.started = True
            self._exceptions_raised = []
        if reopen and hasattr(self._queue, "_reopen"):
            logger.info("Reopening queue '%s' for a new session", self.name)
            self._queue._reopen()
        threads = [
            threading.Thread(
                target=self._run,
                args=(sess, op, coord),
                name=f"QueueRunnerThread-{self.name}-{_op_name(op)}",
            )
            for op in self._enqueue_ops
        ]
        if coord is not None:
            threads.append(
                threading.Thread(
                    target=self._close_on_stop,
                    args=(sess, coord),
                    name=f"QueueRunnerThread-{self.name}-{_op_name(self._cancel_op)}",
                )
            )
        for thread in threads:
            if coord is not None:
                coord.register_thread(thread)
            thread.daemon = daemon
            if start:
                thread.start()
        return threads

    def _thread_done(self, sess: SessionLike) -> bool:
        """Count one thread of ``sess`` as ended; True if it was the last one."""
        with self._lock:
            left = self._runs.get(sess, 1) - 1
            if left > 0:
                self._runs[sess] = left
                return False
            self._runs.pop(sess, None)
            return True

    def _run_close(self, op: Callable[..., Any], sess: SessionLike) -> None:
        try:
            _bind_session(op, sess)()
        except Exception as e:
            logger.debug("Ignored exception while closing queue '%s': %s", self.name, e)
        with self._lock:
            self._closed_queue = True

    def _run(self, sess: SessionLike, op: Callable[..., Any], coord: Coordinator | None) -> None:
        counted = False
        try:
            enqueue = _bind_session(op, sess)
            closed_types = self._queue_closed_exception_types
            while coord is None or not coord.should_stop():
                try:
                    with GATE.share():
                        enqueue()
                except closed_types:
                    counted = True
                    if self._thread_done(sess):
                        self._run_close(self._close_op, sess)
                    return
        except Exception as e:
            if coord is not None:
                coord.request_stop(e)
            else:
                logger.error("Exception in QueueRunner: %s", e)
                with self._lock:
                    self._exceptions_raised.append(e)
                # Nothing else would ever close the queue: its consumer would wait forever.
                # Closed, it gets the elements already queued, then OutOfRangeError.
                self._run_close(self._close_op, sess)
                raise
        finally:
            if not counted:
                self._thread_done(sess)

    def _close_on_stop(self, sess: SessionLike, coord: Coordinator) -> None:
        coord.wait_for_stop()
        self._run_close(self._cancel_op, sess)


def add_queue_runner(qr: QueueRunner, collection: str = GraphKeys.QUEUE_RUNNERS) -> None:
    """Add a ``QueueRunner`` to a collection of the default graph.

    ``start_queue_runners``, ``Supervisor`` sessions and ``MonitoredSession`` start the
    runners of the ``QUEUE_RUNNERS`` collection.

    Args:
        qr: The runner.
        collection: The collection key.

    TF name: ``tf.compat.v1.train.add_queue_runner``.
    """
    get_default_graph().add_to_collection(collection, qr)


def start_queue_runners(
    sess: SessionLike | None = None,
    coord: Coordinator | None = None,
    daemon: bool = True,
    start: bool = True,
    collection: str = GraphKeys.QUEUE_RUNNERS,
) -> list[threading.Thread]:
    """Create and start the threads of every runner in a collection of the default graph.

    Args:
        sess: The session passed to the ops (may be None).
        coord: The ``Coordinator`` the threads report to and stop with; None: none.
        daemon: Make the threads daemons.
        start: Start the threads.
        collection: The collection key.

    Returns:
        All the threads created.

    TF name: ``tf.compat.v1.train.start_queue_runners``.
    """
    threads: list[threading.Thread] = []
    for runner in get_default_graph().get_collection(collection):
        threads.extend(runner.create_threads(sess, coord=coord, daemon=daemon, start=start))
    return threads


class _IterableFeeder:
    """The enqueue op of ``queue_from_iterable``: the next element of the iterable, enqueued.

    ``next()`` is serialized by a lock (iterators, ``DataLoader`` ones included, are not
    thread-safe); ``map_fn`` and the enqueue run outside it. An element whose enqueue was
    cancelled (a stop) stays pending in the queue, which enqueues it first when the runner
    restarts, so nothing is lost.
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        queue: FIFOQueue,
        num_epochs: int | None,
        map_fn: Callable[[Any], Any] | None,
    ) -> None:
        self._iterable = iterable
        self._queue = queue
        self._num_epochs = num_epochs
        self._map_fn = map_fn
        self._lock = threading.Lock()
        self._iterator: Any = None
        self._epoch = 0
        self._yielded = 0
        self.__name__ = f"feed_{queue.name}"
        self.resumable = False  # InputPipelineState refuses it: the position is not saved.

    def _next(self) -> Any:
        with self._lock:
            while True:
                if self._iterator is None:
                    if self._num_epochs is not None and self._epoch >= self._num_epochs:
                        raise OutOfRangeError(
                            f"The input of queue '{self._queue.name}' is exhausted "
                            f"({self._num_epochs} epoch(s))"
                        )
                    self._iterator = iter(self._iterable)
                    self._epoch += 1
                    self._yielded = 0
                try:
                    item = next(self._iterator)
                except StopIteration:
                    self._iterator = None
                    if self._yielded == 0:
                        self._num_epochs = self._epoch  # Exhausted for good.
                    continue
                self._yielded += 1
                return item

    def __call__(self) -> None:
        item = self._next()
        if self._map_fn is not None:
            item = self._map_fn(item)
        self._queue.enqueue(item)


def queue_from_iterable(
    iterable: Iterable[Any],
    *,
    capacity: int = 32,
    num_threads: int = 1,
    num_epochs: int | None = 1,
    map_fn: Callable[[Any], Any] | None = None,
    name: str = "input_queue",
    collection: str = GraphKeys.QUEUE_RUNNERS,
) -> FIFOQueue:
    """Return a queue filled from ``iterable`` by runner threads; its end ends training.

    A ``QueueRunner`` with ``num_threads`` threads is added to ``collection`` (started by
    ``start_queue_runners``, ``Supervisor`` sessions and ``MonitoredSession``). After
    ``num_epochs`` passes over the iterable, the queue is closed: the training step's
    ``dequeue()`` returns the elements left, then raises ``OutOfRangeError``, which ends
    ``managed_session``/``MonitoredSession`` cleanly (hooks' ``end()`` and the final checkpoint
    run).

    Args:
        iterable: Any iterable, e.g. a ``DataLoader`` (iterated again each epoch; a one-shot
            iterator gives one epoch).
        capacity: The most elements buffered in the queue.
        num_threads: Threads feeding the queue. ``next()`` on the iterable is serialized, so
            more than one thread helps only with ``map_fn`` work that releases the GIL; with
            several threads elements may be enqueued out of order.
        num_epochs: Passes over the iterable; None: forever (an epoch that yields nothing
            ends the input).
        map_fn: Applied to each element in the feeding thread before it is enqueued.
        name: The queue's name.
        collection: The collection key the runner is added to.

    Returns:
        The ``FIFOQueue``.

    Raises:
        ValueError: If ``num_threads`` < 1 or ``num_epochs`` < 1.

    TF name: none (TF's producers are ``input/producers.py``); its position is not resumable
    (``InputPipelineState`` refuses it): for that, use an input producer or a
    ``ResumableDataLoader``.
    """
    if num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be None or at least 1, got {num_epochs}")
    queue = FIFOQueue(capacity, name=name)
    feeder = _IterableFeeder(iterable, queue, num_epochs, map_fn)
    add_queue_runner(QueueRunner(queue, [feeder] * num_threads), collection)
    return queue
