"""``Scaffold``: the ops a ``MonitoredSession`` needs to create, initialize and save a session.

A scaffold gathers the init op, ready ops, local init op, summary op and saver. Each one not
given is taken, at ``finalize()``, from its collection of the default graph or made by default
(and added to the collection, so two scaffolds of one graph share the same objects):

============================  ==========================  =======================================
field                         collection                  default
============================  ==========================  =======================================
``init_op``                   ``INIT_OP``                 ``global_variables_initializer()``
``ready_op``                  ``READY_OP``                ``report_uninitialized_variables()``
``ready_for_local_init_op``   ``READY_FOR_LOCAL_INIT_OP`` ``report_uninitialized_variables()``
``local_init_op``             ``LOCAL_INIT_OP``           ``local_variables_initializer()``
``summary_op``                ``SUMMARY_OP``              ``summary.merge_all()`` (may be None)
``saver``                     ``SAVERS``                  ``Saver(sharded=True, allow_empty=True)``
============================  ==========================  =======================================

The training state is given as the Supervisor takes it, ``state=`` (a mapping of names to
stateful objects). Its ``"global_step"`` entry is registered in the ``GLOBAL_STEP`` collection
when that is empty (hooks look there in ``begin()``), and a global step found only in the
collection is added to the state, so that it is checkpointed.

TF name: ``tf.compat.v1.train.Scaffold``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torchsupervisor.checkpoint.saver import Saver
from torchsupervisor.core.checks import check_clock, check_state
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.registry import Graph, GraphKeys, get_default_graph
from torchsupervisor.core.training_state import TrainingState
from torchsupervisor.core.variables import (
    global_variables_initializer,
    local_variables_initializer,
    report_uninitialized_variables,
)
from torchsupervisor.hooks._global_step import is_step
from torchsupervisor.summary.ops import merge_all

if TYPE_CHECKING:
    from torchsupervisor.core.session import Op
    from torchsupervisor.driver.checkpoint_driver import SaverLike

__all__ = ["Scaffold", "check_scaffold"]

logger = logging.getLogger("torchsupervisor")


def prepare_state(state: Mapping[str, Any] | None, graph: Graph | None = None) -> TrainingState:
    """Hold ``state`` and connect its global step with the ``GLOBAL_STEP`` collection.

    The state's ``"global_step"`` is added to the collection if the collection is empty; a
    state without one receives the collection's single step (beside the user's mapping,
    which is not changed).

    Returns:
        A ``TrainingState`` of the user's mapping itself (not a copy: a plain value the loop
        sets in it is what a checkpoint saves).

    Raises:
        TypeError: As ``TrainingState``.
    """
    graph = graph or get_default_graph()
    prepared = TrainingState.of(state)
    steps = graph.get_collection(GraphKeys.GLOBAL_STEP)
    step = prepared.get("global_step")
    if step is not None:
        if is_step(step) and not steps:
            graph.add_to_collection(GraphKeys.GLOBAL_STEP, step)
    elif len(steps) == 1 and is_step(steps[0]):
        prepared.add("global_step", steps[0])
    return prepared


def same_state(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """True if every entry of ``b`` is the very object of ``a`` under that name."""
    return all(a.get(name) is value for name, value in b.items())


class Scaffold:
    """The init, ready, local init and summary ops and the saver of monitored sessions.

    Args:
        init_op: Run when nothing was restored (a callable taking the session or nothing).
        init_feed_dict: Keyword arguments for ``init_op``.
        init_fn: Called as ``init_fn(scaffold, session)`` after ``init_op`` when nothing was
            restored (to load pre-trained weights, say).
        ready_op: Returns the names of what is not initialized (empty: ready).
        ready_for_local_init_op: Like ``ready_op``, checked before ``local_init_op``.
        local_init_op: Run on every new session.
        summary_op: Evaluated by ``SummarySaverHook`` (a callable returning a ``Summary``).
        saver: The ``Saver`` that restores and saves.
        copy_from_scaffold: A scaffold whose fields (and state) fill the fields not given.
        local_init_feed_dict: Keyword arguments for ``local_init_op``.
        state: The training state: a mapping of names to stateful objects (modules,
            optimizers, ``GlobalStep``, tensors, ...); None: given to the session creator.
        clock: Time source of the default saver.

    Raises:
        TypeError: ``"copy_from_scaffold is not a Scaffold instance."``.

    Thread safety: build and finalize on one thread, before the session is created.

    TF name: ``tf.compat.v1.train.Scaffold``.
    """

    def __init__(
        self,
        init_op: Op | None = None,
        init_feed_dict: Mapping[str, Any] | None = None,
        init_fn: Callable[[Scaffold, Any], None] | None = None,
        ready_op: Op | None = None,
        ready_for_local_init_op: Op | None = None,
        local_init_op: Op | None = None,
        summary_op: Op | None = None,
        saver: SaverLike | None = None,
        copy_from_scaffold: Scaffold | None = None,
        local_init_feed_dict: Mapping[str, Any] | None = None,
        *,
        state: Mapping[str, Any] | None = None,
        clock: Clock | None = None,
    ) -> None:
        if copy_from_scaffold is not None:
            if not isinstance(copy_from_scaffold, Scaffold):
                raise TypeError("copy_from_scaffold is not a Scaffold instance.")
            other = copy_from_scaffold

            def pick(mine: Any, theirs: object) -> Any:
                return mine if mine is not None else theirs

            init_op = pick(init_op, other._init_op)
            init_feed_dict = pick(init_feed_dict, other._init_feed_dict)
            init_fn = pick(init_fn, other._user_init_fn)
            ready_op = pick(ready_op, other._ready_op)
            ready_for_local_init_op = pick(ready_for_local_init_op, other._ready_for_local_init_op)
            local_init_op = pick(local_init_op, other._local_init_op)
            local_init_feed_dict = pick(local_init_feed_dict, other._local_init_feed_dict)
            summary_op = pick(summary_op, other._summary_op)
            saver = pick(saver, other._saver)
            state = pick(state, other._state)
            clock = pick(clock, other._clock)
        self._init_op = init_op
        self._init_feed_dict = init_feed_dict
        self._user_init_fn = init_fn
        self._init_fn: Callable[[Any], None] | None = (
            (lambda sess: init_fn(self, sess)) if init_fn is not None else None
        )
        self._ready_op = ready_op
        self._ready_for_local_init_op = ready_for_local_init_op
        self._local_init_op = local_init_op
        self._local_init_feed_dict = local_init_feed_dict
        self._summary_op = summary_op
        self._saver = saver
        self._clock = check_clock("clock", clock)
        self._state = prepare_state(check_state("state", state)) if state is not None else None

    def finalize(self) -> Scaffold:
        """Fill every field not given from its collection or its default (idempotent).

        Returns:
            This scaffold.

        Raises:
            RuntimeError: If a collection holds more than one item for a field
                (``'More than one item in the collection "<key>". ...'``).

        TF name: ``tf.compat.v1.train.Scaffold.finalize``.
        """
        if self._init_op is None:
            self._init_op = Scaffold.get_or_default(
                "init_op", GraphKeys.INIT_OP, global_variables_initializer
            )
        if self._ready_op is None:
            self._ready_op = Scaffold.get_or_default(
                "ready_op", GraphKeys.READY_OP, report_uninitialized_variables
            )
        if self._ready_for_local_init_op is None:
            self._ready_for_local_init_op = Scaffold.get_or_default(
                "ready_for_local_init_op",
                GraphKeys.READY_FOR_LOCAL_INIT_OP,
                report_uninitialized_variables,
            )
        if self._local_init_op is None:
            self._local_init_op = Scaffold.get_or_default(
                "local_init_op", GraphKeys.LOCAL_INIT_OP, Scaffold.default_local_init_op
            )
        if self._summary_op is None:
            self._summary_op = Scaffold.get_or_default(
                "summary_op", GraphKeys.SUMMARY_OP, merge_all
            )
        if self._saver is None:
            self._saver = Scaffold.get_or_default(
                "saver",
                GraphKeys.SAVERS,
                lambda: Saver(sharded=True, allow_empty=True, clock=self._clock),
            )
        logger.debug("Scaffold finalized.")
        return self

    @staticmethod
    def get_or_default(
        arg_name: str, collection_key: str, default_constructor: Callable[[], Any]
    ) -> Any:
        """Return the single item of a collection, or make one and add it there.

        Args:
            arg_name: The scaffold argument (for the error message).
            collection_key: The collection of the default graph.
            default_constructor: Makes the default (which may be None: then nothing is added).

        Returns:
            The item.

        Raises:
            RuntimeError: If the collection holds more than one item.

        TF name: ``tf.compat.v1.train.Scaffold.get_or_default``.
        """
        graph = get_default_graph()
        items = graph.get_collection(collection_key)
        if items:
            if len(items) > 1:
                raise RuntimeError(
                    f'More than one item in the collection "{collection_key}". Please indicate '
                    "which one to use by passing it to the Scaffold constructor as: "
                    f"Scaffold({arg_name}=item to use)"
                )
            return items[0]
        op = default_constructor()
        if op is not None:
            graph.add_to_collection(collection_key, op)
        return op

    @staticmethod
    def default_local_init_op() -> Any:
        """Return the default local init op (eager state has nothing local: a no-op).

        TF name: ``tf.compat.v1.train.Scaffold.default_local_init_op``.
        """
        return local_variables_initializer()

    @property
    def state(self) -> TrainingState | None:
        """The training state (the mapping given, with the global step), or None.

        None when no ``state`` was given (nor by ``copy_from_scaffold``): the session creator's
        state is used.

        TF name: none (TF's variables live in the graph; ours are named here).
        """
        return self._state

    @property
    def init_op(self) -> Any:
        """The init op (None until ``finalize()`` if not given).

        TF name: ``tf.compat.v1.train.Scaffold.init_op``.
        """
        return self._init_op

    @property
    def init_feed_dict(self) -> Mapping[str, Any] | None:
        """The keyword arguments of the init op (None: none).

        TF name: ``tf.compat.v1.train.Scaffold.init_feed_dict``.
        """
        return self._init_feed_dict

    @property
    def init_fn(self) -> Callable[[Any], None] | None:
        """``init_fn`` bound to this scaffold: called as ``init_fn(session)``; None if not given.

        TF name: ``tf.compat.v1.train.Scaffold.init_fn``.
        """
        return self._init_fn

    @property
    def ready_op(self) -> Any:
        """The ready op (None until ``finalize()`` if not given).

        TF name: ``tf.compat.v1.train.Scaffold.ready_op``.
        """
        return self._ready_op

    @property
    def ready_for_local_init_op(self) -> Any:
        """The ready-for-local-init op (None until ``finalize()`` if not given).

        TF name: ``tf.compat.v1.train.Scaffold.ready_for_local_init_op``.
        """
        return self._ready_for_local_init_op

    @property
    def local_init_op(self) -> Any:
        """The local init op (None until ``finalize()`` if not given).

        TF name: ``tf.compat.v1.train.Scaffold.local_init_op``.
        """
        return self._local_init_op

    @property
    def local_init_feed_dict(self) -> Mapping[str, Any] | None:
        """The keyword arguments of the local init op (None: none).

        TF name: ``tf.compat.v1.train.Scaffold.local_init_feed_dict``.
        """
        return self._local_init_feed_dict

    @property
    def summary_op(self) -> Any:
        """The summary op (None when there are no summaries, or before ``finalize()``).

        TF name: ``tf.compat.v1.train.Scaffold.summary_op``.
        """
        return self._summary_op

    @property
    def saver(self) -> Any:
        """The saver (None until ``finalize()`` if not given).

        TF name: ``tf.compat.v1.train.Scaffold.saver``.
        """
        return self._saver


def check_scaffold(value: object, hint: str = "") -> Scaffold | None:
    """Return ``value`` after checking it is a ``Scaffold`` or None.

    Raises:
        TypeError: Naming the argument and the value, followed by ``hint``.
    """
    if value is not None and not isinstance(value, Scaffold):
        raise TypeError(
            f"scaffold must be a Scaffold or None, got {value!r} ({type(value).__name__}){hint}"
        )
    return value
