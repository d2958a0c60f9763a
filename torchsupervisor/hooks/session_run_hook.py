"""``SessionRunHook``: code that runs around every ``MonitoredSession.run`` call.

The life of a hook inside a ``MonitoredSession``::

    hook.begin()                                   # once, before any session exists
    for each session created (the first, and each one after a recovery):
        hook.after_create_session(session, coord)  # state restored or initialized
        for each run(fetches, feed_dict):
            args = hook.before_run(run_context)    # None, or SessionRunArgs to add
            ...the caller's fetches and every hook's fetches are evaluated...
            hook.after_run(run_context, run_values)  # not called if the run raised
    hook.end(session)                              # at a clean close only

A hook that does not override ``before_run`` or ``after_run`` is not called for it, so an
idle method costs nothing per step.

Fetches a hook asks for follow ``Session.run``'s rules (callables are called, tensors returned
as they are, a ``GlobalStep`` gives its int, nested lists/tuples/dicts keep their shape) and are
evaluated after the caller's fetches, in the same run (a callable fetched twice is called
once). One addition for eager code: a string names an entry of the mapping the caller's fetch
returned in this run, so ``NanTensorHook("loss")`` works with a step function that returns
``{"loss": loss}``.

TF names: ``tf.compat.v1.train.SessionRunHook``, ``SessionRunArgs``, ``SessionRunContext``,
``SessionRunValues``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from torchsupervisor.core.coordinator import Coordinator
    from torchsupervisor.core.session import SessionLike

__all__ = [
    "SessionRunArgs",
    "SessionRunContext",
    "SessionRunHook",
    "SessionRunValues",
    "checkpoint_drivers",
]


class SessionRunHook:
    """Base class of the hooks of ``MonitoredSession``; every method is a no-op by default.

    Thread safety: every method is called on the thread that calls ``MonitoredSession.run``
    (``begin`` and ``end`` on the thread that creates and closes the session).

    Capabilities: a hook that writes checkpoints exposes its ``CheckpointDriver`` as
    ``checkpoint_driver`` (None here). Sessions look for that attribute, never for a hook
    class: they wait for its save in flight before re-creating a session, give its final
    checkpoint the preemption grace budget, and abandon its save on an abort.

    TF name: ``tf.compat.v1.train.SessionRunHook``.
    """

    checkpoint_driver: Any = None
    """The hook's ``CheckpointDriver`` if it writes checkpoints; None otherwise."""

    def begin(self) -> None:
        """Prepare before the session is created (called once per ``MonitoredSession``).

        Not called again when the session is re-created after a recoverable error.

        TF name: ``tf.compat.v1.train.SessionRunHook.begin``.
        """

    def after_create_session(self, session: SessionLike, coord: Coordinator) -> None:
        """Act on a new session whose state is restored or initialized.

        Called after every session creation, including re-creation after an ``AbortedError``
        or ``UnavailableError``, after the queue runners were started.

        Args:
            session: The new ``Session`` (no hooks).
            coord: The ``Coordinator`` of the session's threads.

        TF name: ``tf.compat.v1.train.SessionRunHook.after_create_session``.
        """

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs | None:
        """Ask for fetches and feeds to add to the coming run.

        Args:
            run_context: The run's context (shared by all hooks of the run).

        Returns:
            None, or ``SessionRunArgs`` whose fetches are evaluated with the caller's and whose
            ``feed_dict`` is merged into the caller's.

        TF name: ``tf.compat.v1.train.SessionRunHook.before_run``.
        """
        del run_context
        return None

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """Act on the results of a run (not called when the run raised).

        Args:
            run_context: The run's context; ``run_context.request_stop()`` ends the loop.
            run_values: ``results`` holds the values of this hook's fetches, shaped like them
                (None if the hook asked for nothing).

        TF name: ``tf.compat.v1.train.SessionRunHook.after_run``.
        """

    def end(self, session: SessionLike) -> None:
        """Act at the end of the session (a clean close, or end of input).

        Not called when the ``with`` block exits with an error other than ``OutOfRangeError``
        or ``StopIteration``.

        Args:
            session: The last ``Session`` (no hooks).

        TF name: ``tf.compat.v1.train.SessionRunHook.end``.
        """


class SessionRunArgs(NamedTuple):
    """What a hook adds to a run: fetches and feeds.

    Attributes:
        fetches: A fetch structure (as ``Session.run``), where a string names an entry of the
            caller's result mapping; None: nothing.
        feed_dict: Keyword arguments passed to the fetched callables (the caller's and every
            hook's); a key fed by two hooks, or by a hook and the caller, is an error.
        options: Accepted for TF compatibility; RunOptions have no counterpart and are ignored.

    TF name: ``tf.compat.v1.train.SessionRunArgs``.
    """

    fetches: object
    feed_dict: Mapping[str, Any] | None = None
    options: object = None


class SessionRunValues(NamedTuple):
    """What a hook receives after a run.

    Attributes:
        results: The values of the hook's fetches, shaped like them; None if it asked for
            nothing.
        options: The caller's ``options`` (no counterpart; passed through).
        run_metadata: The caller's ``run_metadata`` (no counterpart; passed through).

    TF name: ``tf.compat.v1.train.SessionRunValues``.
    """

    results: object
    options: object = None
    run_metadata: object = None


class SessionRunContext:
    """The context of one run, shared by every hook of that run.

    Args:
        original_args: ``SessionRunArgs`` with the caller's fetches and feed_dict.
        session: The session the run uses (no hooks).

    Thread safety: used on the training thread only.

    TF name: ``tf.compat.v1.train.SessionRunContext``.
    """

    __slots__ = ("_original_args", "_session", "_stop_requested")

    def __init__(self, original_args: SessionRunArgs, session: SessionLike) -> None:
        self._original_args = original_args
        self._session = session
        self._stop_requested = False

    @property
    def original_args(self) -> SessionRunArgs:
        """The caller's fetches and feed_dict, as ``SessionRunArgs``.

        TF name: ``tf.compat.v1.train.SessionRunContext.original_args``.
        """
        return self._original_args

    @property
    def session(self) -> Any:
        """The session the run uses (no hooks).

        TF name: ``tf.compat.v1.train.SessionRunContext.session``.
        """
        return self._session

    @property
    def stop_requested(self) -> bool:
        """True once a hook called ``request_stop()`` during this run.

        TF name: ``tf.compat.v1.train.SessionRunContext.stop_requested``.
        """
        return self._stop_requested

    def request_stop(self) -> None:
        """Ask the monitored session to stop after this run (``should_stop()`` turns True).

        TF name: ``tf.compat.v1.train.SessionRunContext.request_stop``.
        """
        self._stop_requested = True


def checkpoint_drivers(hooks: Any) -> list[Any]:
    """The ``checkpoint_driver`` of every hook that has one, in the hooks' order."""
    drivers = []
    for hook in hooks:
        driver = getattr(hook, "checkpoint_driver", None)
        if driver is not None:
            drivers.append(driver)
    return drivers
