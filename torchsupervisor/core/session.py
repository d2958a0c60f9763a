"""``Session``: the handle on the training state that ``run`` evaluates fetches against.

In TF a session runs graph ops. Here the "ops" are Python callables, so ``run`` calls them;
what the session adds is structure (a fetch may be a nested list/tuple/dict and the result has
the same shape), feeds (``feed_dict`` entries become keyword arguments), and the *step
boundary*: the entry of ``run`` on the training thread is where deferred work such as a
checkpoint snapshot happens, so a snapshot never sees half a step.

TF name: ``tf.compat.v1.Session``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeAlias

import torch

from torchsupervisor.core.boundary import StepBoundary
from torchsupervisor.core.checks import check_state
from torchsupervisor.core.global_step import GlobalStep
from torchsupervisor.errors import InvalidArgumentError

__all__ = [
    "Op",
    "Session",
    "SessionLike",
    "call_op",
    "evaluate_fetches",
    "join_masters_with",
    "session_op",
]

Op: TypeAlias = "Callable[..., object] | None"
"""One of the Supervisor's "ops" (``init_op``, ``ready_op``, ...): a callable, given the
session when it takes a positional parameter (``call_op``), or None."""


class SessionLike(Protocol):
    """What ops, hooks and savers use of a session: ``run`` (a ``Session``, a
    ``MonitoredSession`` or one of its wrappers)."""

    def run(
        self,
        fetches: object,
        feed_dict: Mapping[Any, Any] | None = None,
        options: object = None,
        run_metadata: object = None,
    ) -> Any: ...


def _in_process_only(master: str) -> object:
    if master not in ("", "local"):
        raise InvalidArgumentError(
            f"master={master!r} needs torchsupervisor.distributed (import torchsupervisor)"
        )
    return False


# What joins the process group a master string names. The core floor never joins one itself:
# ``torchsupervisor.distributed.env`` installs its ``connect`` here when it is imported (as
# ``import torchsupervisor`` does), so the arrow of imports runs from distributed/ to core/.
_JOIN: list[Callable[[str], object]] = [_in_process_only]


def join_masters_with(connect: Callable[[str], object]) -> None:
    """Make ``Session(master=...)`` call ``connect(master)`` to join its process group.

    Args:
        connect: Called once per session with its master string; raises for a master it
            does not accept (``InvalidArgumentError``) or a group that did not form.

    TF name: none.
    """
    _JOIN[0] = connect


class Session:
    """Holds the state and evaluates fetches.

    Args:
        state: Mapping of names to stateful objects (modules, optimizers, ``GlobalStep``,
            tensors, ...), kept by reference: the session never copies it. None: empty.
        master: ``""`` (or ``"local"``) for an in-process session; ``"env://"`` or
            ``"tcp://..."`` (``Server.target``) to join the replicas' process group first (see
            ``torchsupervisor.distributed.env``).
        config: Opaque options kept for the caller (TF's ConfigProto has no counterpart).
        device: Where ``global_variables_initializer`` materializes uninitialized modules
            (default: CPU).

    Raises:
        InvalidArgumentError: For an unsupported ``master`` string.

    Thread safety: ``run`` may be called from any thread, but only calls from the thread that
    created the session are step boundaries.

    TF name: ``tf.compat.v1.Session``.
    """

    def __init__(
        self,
        state: Mapping[str, Any] | None = None,
        master: str = "",
        config: object = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(master, (str, bytes)):
            raise TypeError(f"master must be a string, got {master!r} ({type(master).__name__})")
        check_state("state", state)
        try:
            self._device = torch.device(device) if device is not None else torch.device("cpu")
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device: {device!r} is not a torch device: {e}") from None
        _JOIN[0](master)  # Joins the process group of a distributed master (once).
        self._state = {} if state is None else state
        self._master = master
        self._config = config
        self._closed = False
        self.boundary = StepBoundary()
        self.restored_checkpoint: str | None = None
        """The checkpoint prefix this session's state was restored from, or None."""
        self.restored_tier: str | None = None
        """The tier it was restored from: ``"disk"``, ``"bucket"`` or ``"memory"``; None."""
        self.replicas: Any = None
        """The ``ReplicaGroup`` of a session that every rank of a sharded state prepared
        together (``ShardedSessionCreator``): its checkpoints are collectives at steps the
        ranks agree on (``ShardedCheckpointSaverHook``). None otherwise."""

    @property
    def state(self) -> Mapping[str, Any]:
        """The state mapping (the same object that was passed in; an empty dict for None).

        TF name: none (a TF session runs the variables of its ``graph``).
        """
        return self._state

    @property
    def master(self) -> str:
        """The master string the session was created with.

        TF name: ``tf.compat.v1.Session.sess_str`` (its ``target`` argument).
        """
        return self._master

    @property
    def config(self) -> Any:
        """The config the session was created with (None if not given).

        TF name: none (TF keeps its ``ConfigProto`` private).
        """
        return self._config

    @property
    def device(self) -> torch.device:
        """The device used to materialize uninitialized state (CPU by default).

        TF name: none (TF places ops by device scopes, not per session).
        """
        return self._device

    @property
    def closed(self) -> bool:
        """True after ``close()``.

        TF name: none (TF keeps it private, ``BaseSession._closed``).
        """
        return self._closed

    def run(self, fetches: object, feed_dict: Mapping[str, Any] | None = None) -> Any:
        """Evaluate ``fetches`` and return their values in the same structure.

        On the thread that created the session, the work deferred to this step boundary (a
        checkpoint snapshot, say) runs first, unless ``Supervisor.should_stop()`` was called
        since the previous ``run``: that was this step's boundary (``core/boundary.py``).
        A fetch is a callable (called once per ``run`` even if it appears several times), a
        ``torch.Tensor`` (returned as is: no copy, no device sync), a number (returned as is:
        an eager value such as ``queue.size()``), a ``GlobalStep`` (its int value), None, or a
        list/tuple/namedtuple/dict of fetches.

        Args:
            fetches: What to evaluate.
            feed_dict: Keyword arguments for the fetched callables: each callable receives the
                entries it has parameters for (all of them if it takes ``**kwargs``).

        Returns:
            The values, shaped like ``fetches``.

        Raises:
            RuntimeError: ``"Attempted to use a closed Session."``.
            TypeError: For a fetch of another type, or a feed that no fetched callable takes.
            Exception: Whatever a fetched callable or a deferred boundary task raises.

        TF name: ``tf.compat.v1.Session.run`` (without ``options`` and ``run_metadata``).
        """
        boundary = self.boundary
        if boundary.asked:  # The loop's should_stop() was this step's boundary.
            boundary.asked = False
        elif boundary.pending:
            boundary.run_pending()
        if self._closed:
            raise RuntimeError("Attempted to use a closed Session.")
        return evaluate_fetches(fetches, feed_dict, session=self)

    def close(self) -> None:
        """Close the session; later ``run`` calls raise. Closing twice is harmless.

        Work still deferred to the step boundary is dropped; the state is left as it is.

        TF name: ``tf.compat.v1.Session.close``.
        """
        self._closed = True
        self.boundary.clear()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def session_op(fn: Callable[..., object]) -> Any:
    """Mark ``fn`` as an op that takes the session: ``sess.run(fn)`` calls ``fn(sess)``.

    TF's ops ran inside a session; the ops that need one here (``global_variables_initializer()``,
    ``report_uninitialized_variables()``) carry this mark, so that ``sess.run(op)`` works as
    in TF, as well as ``op(sess)`` and the Supervisor's ``init_op=op``.

    Returns:
        ``fn`` itself, with ``fn.takes_session = True``.
    """
    fn.takes_session = True
    return fn


_SESSION = "session"  # The memo's key of the running session (the other keys are ids).
_CONSTANTS = "constants"  # The memo's key of ``evaluate_fetches(constants=...)``.


def evaluate_fetches(
    fetches: object,
    feed_dict: Mapping[str, Any] | None = None,
    *,
    session: SessionLike | None = None,
    constants: bool = False,
) -> Any:
    """Evaluate a fetch structure (see ``Session.run``) without a step boundary.

    A fetch with an ``output_of`` attribute is one output of a shared op: the op is run once
    per evaluation and ``fetch.select(value)`` picks the output (the outputs of one dequeue).

    Args:
        fetches: What to evaluate.
        feed_dict: Keyword arguments for the fetched callables.
        session: Passed to the fetched ops marked with ``session_op``.
        constants: Return leaves of other types as they are (an input pipeline's element
            may hold strings and numbers) instead of raising ``TypeError``.

    Raises:
        TypeError: As ``Session.run``.
    """
    if not feed_dict and not constants:
        if (
            callable(fetches)
            and not isinstance(fetches, (torch.Tensor, GlobalStep))
            and not getattr(fetches, "takes_session", False)
        ):
            return fetches()
        return _evaluate(fetches, None, {_SESSION: session})
    if not feed_dict:
        return _evaluate(fetches, None, {_SESSION: session, _CONSTANTS: True})
    for key in feed_dict:
        if not isinstance(key, str):
            raise TypeError(f"feed_dict keys must be strings naming keyword arguments, got {key!r}")
    used: set[str] = set()
    memo = {_SESSION: session, _CONSTANTS: constants}
    result = _evaluate(fetches, (feed_dict, used), memo)
    unused = sorted(set(feed_dict) - used)
    if unused:
        raise TypeError(f"feed_dict keys {unused} are not arguments of any fetched callable")
    return result


def _kwargs_for(
    fn: Callable[..., object], feed: tuple[Mapping[str, Any], set[str]]
) -> dict[str, Any]:
    feed_dict, used = feed
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        used.update(feed_dict)
        return dict(feed_dict)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        used.update(feed_dict)
        return dict(feed_dict)
    names = {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    kwargs = {k: v for k, v in feed_dict.items() if k in names}
    used.update(kwargs)
    return kwargs


def _evaluate(fetch: object, feed: Any, memo: dict[Any, Any]) -> Any:
    if fetch is None:
        return None
    if isinstance(fetch, torch.Tensor):
        return fetch
    if isinstance(fetch, GlobalStep):
        return fetch.value
    if callable(fetch):
        op = getattr(fetch, "output_of", None)
        if op is not None:  # One output of an op that several fetches share: run it once.
            return fetch.select(_evaluate(op, feed, memo))
        key = id(fetch)
        if key not in memo:
            if getattr(fetch, "takes_session", False):
                memo[key] = fetch(memo[_SESSION])
            else:
                memo[key] = fetch(**_kwargs_for(fetch, feed)) if feed else fetch()
        return memo[key]
    if isinstance(fetch, Mapping):
        items = [(k, _evaluate(v, feed, memo)) for k, v in fetch.items()]
        try:
            return type(fetch)(items)
        except TypeError:
            return dict(items)
    # Lists, not generators: a StopIteration raised by a fetch (an exhausted iterator: the
    # end of the input) must reach the caller as itself, which a generator would turn into
    # "RuntimeError: generator raised StopIteration" (PEP 479).
    if isinstance(fetch, tuple) and hasattr(fetch, "_fields"):
        return type(fetch)(*[_evaluate(v, feed, memo) for v in fetch])
    if isinstance(fetch, (list, tuple)):
        return type(fetch)([_evaluate(v, feed, memo) for v in fetch])
    if memo.get(_CONSTANTS) or isinstance(fetch, (bool, int, float)):
        return fetch
    raise TypeError(
        f"Fetch argument {fetch!r} has invalid type {type(fetch).__name__}: a fetch must be a "
        "callable, a Tensor, a number, a GlobalStep, None, or a list/tuple/dict of them"
    )


def call_op(op: Op, sess: SessionLike, feed_dict: Mapping[str, Any] | None = None) -> Any:
    """Run one of the Supervisor's "ops": a callable taking the session, or nothing.

    ``init_op``, ``ready_op``, ``local_init_op`` and ``summary_op`` are callables; one that has
    a required positional parameter receives the session, others are called without it.
    ``feed_dict`` entries are passed as keyword arguments.

    Returns:
        What the op returns (None when ``op`` is None).
    """
    if op is None:
        return None
    kwargs = dict(feed_dict or {})
    if _takes_session(op):
        return op(sess, **kwargs)
    return op(**kwargs)


def _takes_session(op: Op) -> bool:
    try:
        params = inspect.signature(op).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        and p.default is inspect.Parameter.empty
        for p in params
    ) or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
