"""Collections of a "graph": the registry that ``USE_DEFAULT`` arguments are resolved from.

Eager PyTorch has no graph, but TF 1 programs find their summary op, saver, init op and global
step through named collections of the default graph, and the Supervisor's ``USE_DEFAULT``
arguments are resolved from them. ``Graph`` keeps those collections (and nothing else); a
process-wide default graph exists, replaceable with ``Graph.as_default()`` per thread.

TF names: ``tf.Graph`` (collections only), ``tf.GraphKeys``, ``tf.get_default_graph``,
``tf.reset_default_graph``, ``tf.add_to_collection``, ``tf.get_collection``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeAlias

__all__ = [
    "Graph",
    "GraphKeys",
    "UseDefault",
    "add_to_collection",
    "add_to_collections",
    "clear_collection",
    "get_collection",
    "get_collection_ref",
    "get_default_graph",
    "reset_default_graph",
]

logger = logging.getLogger("torchsupervisor")


class GraphKeys:
    """Standard collection names, with TF's exact string values.

    TF name: ``tf.GraphKeys``.
    """

    GLOBAL_VARIABLES = "variables"
    LOCAL_VARIABLES = "local_variables"
    METRIC_VARIABLES = "metric_variables"
    MODEL_VARIABLES = "model_variables"
    TRAINABLE_VARIABLES = "trainable_variables"
    SUMMARIES = "summaries"
    QUEUE_RUNNERS = "queue_runners"
    TABLE_INITIALIZERS = "table_initializer"
    ASSET_FILEPATHS = "asset_filepaths"
    MOVING_AVERAGE_VARIABLES = "moving_average_variables"
    REGULARIZATION_LOSSES = "regularization_losses"
    SAVERS = "savers"
    WEIGHTS = "weights"
    BIASES = "biases"
    ACTIVATIONS = "activations"
    UPDATE_OPS = "update_ops"
    LOSSES = "losses"
    RESOURCES = "resources"
    LOCAL_RESOURCES = "local_resources"
    INIT_OP = "init_op"
    LOCAL_INIT_OP = "local_init_op"
    READY_OP = "ready_op"
    READY_FOR_LOCAL_INIT_OP = "ready_for_local_init_op"
    SUMMARY_OP = "summary_op"
    GLOBAL_STEP = "global_step"
    EVAL_STEP = "eval_step"
    TRAIN_OP = "train_op"


class Graph:
    """A set of named collections (lists of arbitrary Python objects).

    Thread safety: collection updates are serialized by a lock; the lists returned by
    ``get_collection`` are copies.

    TF name: ``tf.Graph`` (only its collection API; eager PyTorch has no ops to hold).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._collections: dict[str, list[Any]] = {}
        self._names: set[str] = set()

    def unique_name(self, name: str, mark_as_used: bool = True) -> str:
        """Return ``name``, or ``name_1``, ``name_2``, ... if it was already used in this graph.

        Args:
            name: The wanted name.
            mark_as_used: Reserve the returned name (later calls get another).

        TF name: ``tf.Graph.unique_name``.
        """
        with self._lock:
            candidate, i = name, 0
            while candidate in self._names:
                i += 1
                candidate = f"{name}_{i}"
            if mark_as_used:
                self._names.add(candidate)
            return candidate

    def add_to_collection(self, name: str, value: object) -> None:
        """Append ``value`` to the collection ``name`` (created when missing).

        TF name: ``tf.Graph.add_to_collection``.
        """
        with self._lock:
            self._collections.setdefault(name, []).append(value)

    def add_to_collections(self, names: str | Iterable[str], value: object) -> None:
        """Append ``value`` to each collection in ``names`` (a string is one name).

        Duplicate names count once; the collections are not updated atomically together.

        TF name: ``tf.Graph.add_to_collections``.
        """
        for name in [names] if isinstance(names, str) else set(names):
            self.add_to_collection(name, value)

    def get_collection_ref(self, name: str) -> list[Any]:
        """Return the live list behind collection ``name`` (created empty when missing).

        Changes to the list are not serialized by the graph's lock; after
        ``clear_collection(name)`` it is no longer the collection's list.

        TF name: ``tf.Graph.get_collection_ref``.
        """
        with self._lock:
            return self._collections.setdefault(name, [])

    def get_collection(self, name: str, scope: str | None = None) -> list[Any]:
        """Return a copy of collection ``name``; ``[]`` when it does not exist.

        Args:
            name: The collection key, usually a ``GraphKeys`` member.
            scope: If given, keep only items whose ``name`` attribute matches this regular
                expression at its start (``re.match``); items without a name are dropped.

        Returns:
            A new list, in insertion order.

        Raises:
            re.error: If ``scope`` is not a valid regular expression.

        TF name: ``tf.Graph.get_collection``.
        """
        with self._lock:
            items = list(self._collections.get(name, ()))
        if scope is None:
            return items
        pattern = re.compile(scope)
        return [
            item
            for item in items
            if isinstance(getattr(item, "name", None), str) and pattern.match(item.name)
        ]

    def clear_collection(self, name: str) -> None:
        """Remove collection ``name`` and its items (a missing collection is not an error).

        TF name: ``tf.Graph.clear_collection``.
        """
        with self._lock:
            self._collections.pop(name, None)

    def get_all_collection_keys(self) -> list[str]:
        """Return the names of the non-empty collections, in creation order.

        TF name: ``tf.Graph.get_all_collection_keys`` (which also lists empty collections).
        """
        with self._lock:
            return [key for key, items in self._collections.items() if items]

    @contextlib.contextmanager
    def as_default(self) -> Iterator[Graph]:
        """Make this graph the default graph of the current thread inside a ``with`` block.

        Blocks nest; other threads keep their own default graph.

        Returns:
            A context manager that yields this graph.

        TF name: ``tf.Graph.as_default``.
        """
        stack = _thread_stack()
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()


_global_default = Graph()
_local = threading.local()


def _thread_stack() -> list[Graph]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def get_default_graph() -> Graph:
    """Return the current thread's default graph (the process-wide one outside ``as_default``).

    TF name: ``tf.get_default_graph``.
    """
    stack = _thread_stack()
    return stack[-1] if stack else _global_default


def reset_default_graph() -> None:
    """Replace the process-wide default graph by an empty one.

    Raises:
        AssertionError: If called inside a ``Graph.as_default()`` block, as in TF.

    TF name: ``tf.reset_default_graph``.
    """
    global _global_default
    if _thread_stack():
        raise AssertionError("Do not use tf.reset_default_graph() to clear nested graphs.")
    _global_default = Graph()


def add_to_collection(name: str, value: object) -> None:
    """Add ``value`` to collection ``name`` of the default graph (``tf.add_to_collection``)."""
    get_default_graph().add_to_collection(name, value)


def add_to_collections(names: str | Iterable[str], value: object) -> None:
    """Add ``value`` to each named collection of the default graph.

    Args:
        names: One collection name (a string) or an iterable of names; duplicates count once.
        value: object object.

    TF name: ``tf.add_to_collections``.
    """
    get_default_graph().add_to_collections(names, value)


def get_collection(name: str, scope: str | None = None) -> list[Any]:
    """Return a copy of collection ``name`` of the default graph (``tf.get_collection``)."""
    return get_default_graph().get_collection(name, scope)


def get_collection_ref(name: str) -> list[Any]:
    """Return the live list of collection ``name`` of the default graph.

    Changing the returned list changes the collection; it is created empty when missing.

    TF name: ``tf.get_collection_ref``.
    """
    return get_default_graph().get_collection_ref(name)


def clear_collection(name: str) -> None:
    """Clear collection ``name`` of the default graph (a missing collection is not an error).

    TF name: ``tf.compat.v1.get_default_graph().clear_collection``.
    """
    get_default_graph().clear_collection(name)


class _UseDefault(int):
    """The type of ``USE_DEFAULT``: the int 0 as TF's ``Supervisor.USE_DEFAULT`` (so that
    ``Supervisor.USE_DEFAULT == 0``), but one object of its own, compared with ``is``."""

    _instance: _UseDefault | None = None

    def __new__(cls) -> _UseDefault:
        if cls._instance is None:
            cls._instance = super().__new__(cls, 0)
        return cls._instance

    def __repr__(self) -> str:
        return "USE_DEFAULT"

    def __reduce__(self) -> str:
        return "USE_DEFAULT"  # Unpickles as this module's singleton.


UseDefault: TypeAlias = _UseDefault
"""The type of ``USE_DEFAULT``, for annotations (``Op | UseDefault = USE_DEFAULT``)."""


USE_DEFAULT = _UseDefault()
"""The one sentinel for "use the default" (compared with ``is``): for the Supervisor, look the
value up in the graph's collections, else make TF's default; for ``MonitoredTrainingSession``,
an argument left to its default. TF used ``0`` for the first (``Supervisor.USE_DEFAULT == 0``
holds here too) and an ``object()`` for the second; one sentinel that no real argument is
(``save_checkpoint_secs=0`` means "none", not "default") serves both."""


def resolve_default(
    graph: Graph, value: object, key: str, make_default: Callable[[], Any] | None = None
) -> Any:
    """Resolve a ``USE_DEFAULT`` argument as TF's Supervisor does.

    Args:
        graph: The collections registry.
        value: The argument; anything but ``USE_DEFAULT`` is returned as is.
        key: The collection to look in (its first item wins).
        make_default: Builds the default when the collection is empty; a non-None result is
            added to the collection. None: no default (the result is None).
    """
    if value is not USE_DEFAULT:
        return value
    found = first_from_collection(graph, key)
    if found is None and make_default is not None:
        found = make_default()
        if found is not None:
            graph.add_to_collection(key, found)
    return found


def first_from_collection(graph: Graph, key: str) -> Any:
    """Return the first item of a collection, or ``None``; logs when there are several.

    This is how every ``USE_DEFAULT`` argument of the Supervisor is looked up.
    """
    items = graph.get_collection(key)
    if len(items) > 1:
        logger.info("Found %d %s operations. Returning the first one.", len(items), key)
    return items[0] if items else None
