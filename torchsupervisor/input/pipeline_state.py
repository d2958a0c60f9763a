"""``InputPipelineState``: the position of the input pipelines, for the checkpointed state.

Put it in the state next to the model, and a stopped run resumes its input exactly where it
was::

    state = {"model": model, "optimizer": optimizer, "input": ts.InputPipelineState()}

It covers every ``QueueRunner`` of a collection of the graph (by default ``QUEUE_RUNNERS``,
read when the state is taken, so pipelines built later count): each queue's elements, the
elements of enqueues waiting for room, and its shuffling generator; each producer's epochs and
generator; each ``limit_epochs`` count, and the state of any enqueue op or input value with
``state_dict``/``load_state_dict``. It is taken with the pipeline gate held (``gate.py``): every
runner thread is between two enqueue ops or waiting in a queue, so no element is in a thread's
hands, and no element is lost or repeated by a resume.

What is exact: with one thread per enqueue op (``num_threads=1``, the default) and enqueue ops
that are deterministic in what they dequeue (readers of files, the producers and batching
functions here), the resumed run sees exactly the batches an uninterrupted run would have seen,
with ``shuffle_batch`` too (see ``RandomShuffleQueue``: its order does not depend on timing).
With several threads per enqueue op, no element is lost or repeated, but the order of the
elements, which was already timing-dependent, differs. An enqueue op that dequeues from two
queues and waits on the second after taking from the first is not supported: the state could
not hold the first element.

TF name: none (TF 1's input queues were not checkpointed: a restart replayed its epochs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchsupervisor.core.checks import check_duck, check_str
from torchsupervisor.core.registry import Graph, GraphKeys, get_default_graph
from torchsupervisor.input.gate import GATE
from torchsupervisor.input.ops import OpOutput

__all__ = ["InputPipelineState"]


def _stateful(node: object, found: dict[int, Any], depth: int = 0) -> None:
    """Collect the objects with a state below an enqueue op or an input value, in order."""
    if depth > 32 or id(node) in found:
        return
    if isinstance(node, OpOutput):
        _stateful(node.output_of, found, depth + 1)
    elif isinstance(node, Mapping):
        for value in node.values():
            _stateful(value, found, depth + 1)
    elif isinstance(node, (list, tuple)):
        for value in node:
            _stateful(value, found, depth + 1)
    elif callable(node):
        if hasattr(node, "state_dict") and hasattr(node, "load_state_dict"):
            found[id(node)] = node
        for part in getattr(node, "pipeline_inputs", lambda: ())():
            _stateful(part, found, depth + 1)


class InputPipelineState:
    """The resumable position of the input pipelines of a graph collection.

    Args:
        collection: The collection of ``QueueRunner`` s covered.
        graph: The graph; None: the default graph when this object is made.

    Thread safety: ``state_dict`` may be called from any thread that is not a runner thread
    (it holds the pipeline gate); ``load_state_dict`` before the runners start.

    Distributed: per rank (``per_rank``): each replica's pipelines hold its own batches, so
    a replica never receives the chief's (the broadcast at a session's start leaves this
    entry out), and the checkpoint, which holds the chief's, is restored into the chief's
    alone: the other ranks start their pipelines where their construction put them. Build
    each rank's pipeline from its rank (its files, or its seed), as TF's replicas did.

    TF name: none (see the module docstring).
    """

    per_rank = True
    """Each replica keeps its own (``core.training_state.is_per_rank``)."""

    def __init__(self, collection: str = GraphKeys.QUEUE_RUNNERS, graph: Graph | None = None):
        self._collection = check_str("collection", collection, allow_empty=False)
        graph = check_duck("graph", graph, ("get_collection",), "a Graph")
        self._graph = graph or get_default_graph()

    def _runners(self) -> list[tuple[Any, list[Any]]]:
        runners = []
        for runner in self._graph.get_collection(self._collection):
            found: dict[int, Any] = {}
            for op in runner.enqueue_ops:
                if getattr(op, "resumable", True) is False:
                    raise TypeError(
                        f"queue '{runner.name}' is fed by queue_from_iterable, whose position "
                        "in its iterable is not saved: use a ResumableDataLoader in the state, "
                        "or an input producer"
                    )
                _stateful(op, found)
            runners.append((runner, list(found.values())))
        return runners

    def state_dict(self) -> dict[str, Any]:
        """Return every queue's contents and every op's state, taken with the pipeline quiet.

        Returns:
            ``{"runners": [{"queue": <queue state>, "ops": [<op state>, ...]}, ...]}`` in the
            collection's order.

        Raises:
            TypeError: If a queue is fed by ``queue_from_iterable`` (its position is not
                saved), or has no ``state_dict``.
            RuntimeError: If called from a runner thread.
        """
        runners = self._runners()
        with GATE.exclusive():
            return {
                "runners": [
                    {
                        "queue": _queue_state(runner),
                        "ops": [op.state_dict() for op in ops],
                    }
                    for runner, ops in runners
                ]
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict`` into the same pipeline, before its runners start.

        Raises:
            ValueError: If the pipeline differs from the saved one (another number of queue
                runners, another queue name or kind, another number of stateful ops), naming
                the first difference; or a queue is already in use.
        """
        runners = self._runners()
        saved = list(state["runners"])
        if len(saved) != len(runners):
            raise ValueError(
                f"the input pipeline has {len(runners)} queue runners, the saved state "
                f"{len(saved)}: build the same pipeline before restoring"
            )
        for (runner, ops), entry in zip(runners, saved):
            queue_state = entry["queue"]
            if queue_state.get("name") != runner.name:
                raise ValueError(
                    f"the saved input pipeline has queue {queue_state.get('name')!r} where "
                    f"this one has {runner.name!r}"
                )
            if len(entry["ops"]) != len(ops):
                raise ValueError(
                    f"queue '{runner.name}': {len(ops)} stateful ops, "
                    f"{len(entry['ops'])} in the saved state"
                )
        for (runner, ops), entry in zip(runners, saved):
            runner.queue.load_state_dict(entry["queue"])
            for op, op_state in zip(ops, entry["ops"]):
                op.load_state_dict(op_state)


def _queue_state(runner: Any) -> dict[str, Any]:
    queue = runner.queue
    if not hasattr(queue, "state_dict"):
        raise TypeError(f"queue '{runner.name}' ({type(queue).__name__}) has no state_dict")
    return queue.state_dict()
