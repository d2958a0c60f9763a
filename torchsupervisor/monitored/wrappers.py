"""The wrapper chain inside ``MonitoredSession``: one behaviour per wrapper.

::

    _RecoverableSession          (MonitoredSession only) AbortedError/UnavailableError:
     |                           close, create a new session, retry the same run
     +- _CoordinatedSession      the session's Coordinator: its threads' errors, stop, join
         +- HookedSession        SessionRunHooks around every run
             +- Session          the raw session: evaluates fetches (the step boundary)

``should_stop()`` asks each wrapper in turn (its own ``_check_stop()``, then the wrapped one).

TF names: ``monitored_session._WrappedSession``, ``_HookedSession``, ``_CoordinatedSession``,
``_RecoverableSession`` (internal in TF as here).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torchsupervisor.errors import AbortedError, NotFoundError, UnavailableError
from torchsupervisor.hooks.session_run_hook import (
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)

if TYPE_CHECKING:
    from torchsupervisor.core.coordinator import Coordinator
    from torchsupervisor.core.session import SessionLike

__all__ = ["PREEMPTION_ERRORS", "HookedSession", "StepContext"]

logger = logging.getLogger("torchsupervisor")

PREEMPTION_ERRORS = (AbortedError, UnavailableError)
"""Errors after which a new session is created and the run retried."""

_NO_VALUES = SessionRunValues(None)


class StepContext:
    """What ``run_step_fn`` passes to the step function.

    Args:
        session: The raw session (no hooks).
        run_with_hooks_fn: Runs fetches with the hooks (``MonitoredSession.run``'s chain).

    Thread safety: used on the training thread only.

    TF name: ``tf.compat.v1.train.MonitoredSession.StepContext``.
    """

    __slots__ = ("_run_with_hooks_fn", "_session")

    def __init__(self, session: SessionLike, run_with_hooks_fn: Callable[..., Any]) -> None:
        self._session = session
        self._run_with_hooks_fn = run_with_hooks_fn

    @property
    def session(self) -> Any:
        """The raw session: its ``run`` calls no hook.

        TF name: ``StepContext.session``.
        """
        return self._session

    def run_with_hooks(self, *args: object, **kwargs: object) -> Any:
        """Run fetches like ``MonitoredSession.run``: with every hook.

        TF name: ``StepContext.run_with_hooks``.
        """
        return self._run_with_hooks_fn(*args, **kwargs)

    def request_stop(self) -> None:
        """End the training loop: raise ``StopIteration`` out of the step function.

        The exception leaves ``run_step_fn``; leaving a ``with MonitoredSession(...)`` block by
        it is a clean exit (hooks' ``end()`` runs).

        Raises:
            StopIteration: ``"step_fn has requested the iterations to stop."``.

        TF name: ``StepContext.request_stop``.
        """
        raise StopIteration("step_fn has requested the iterations to stop.")


class _WrappedSession:
    """Forwards to the wrapped session; subclasses add one behaviour."""

    def __init__(self, sess: SessionLike) -> None:
        self._sess = sess
        self._wrapped_is_stoppable = isinstance(sess, _WrappedSession)

    def raw_session(self) -> Any:
        sess = self._sess
        return sess.raw_session() if isinstance(sess, _WrappedSession) else sess

    def _check_stop(self) -> bool:
        return False

    def should_stop(self) -> bool:
        if self._check_stop():
            return True
        sess = self._sess
        if sess is None:
            return True
        return self._wrapped_is_stoppable and sess.should_stop()

    def close(self) -> None:
        sess = self._sess
        if sess is None:
            return
        try:
            sess.close()
        except PREEMPTION_ERRORS as e:
            logger.error(
                "An error occurred when attempting to close the session. This may be due to a "
                "preemption in a connected worker. Error: %s",
                e,
            )
        finally:
            self._sess = None

    def run(self, *args: object, **kwargs: object) -> Any:
        return self._sess.run(*args, **kwargs)

    def run_step_fn(
        self, step_fn: Callable[[StepContext], Any], raw_session: SessionLike, run_with_hooks: Any
    ) -> Any:
        return step_fn(StepContext(raw_session, run_with_hooks or self.run))


class _Named:
    """A hook fetch naming an entry of the caller's result; evaluates to itself."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self) -> _Named:
        return self


def _scan(fetch: object) -> tuple[bool, bool]:
    """Return (has string leaves, has other non-None leaves) of a fetch structure."""
    if isinstance(fetch, str):
        return True, False
    if fetch is None:
        return False, False
    if isinstance(fetch, Mapping):
        children: Any = fetch.values()
    elif isinstance(fetch, (list, tuple)):
        children = fetch
    else:
        return False, True
    names = others = False
    for child in children:
        child_names, child_others = _scan(child)
        names = names or child_names
        others = others or child_others
    return names, others


def _mark_names(fetch: object) -> Any:
    """Replace the string leaves of a fetch structure by ``_Named`` markers."""
    if isinstance(fetch, str):
        return _Named(fetch)
    if isinstance(fetch, Mapping):
        return {k: _mark_names(v) for k, v in fetch.items()}
    if isinstance(fetch, tuple) and hasattr(fetch, "_fields"):
        return type(fetch)(*(_mark_names(v) for v in fetch))
    if isinstance(fetch, (list, tuple)):
        return type(fetch)(_mark_names(v) for v in fetch)
    return fetch


def _lookup(outputs: object, name: str) -> Any:
    if isinstance(outputs, Mapping):
        try:
            return outputs[name]
        except KeyError:
            raise NotFoundError(
                f"A SessionRunHook fetches {name!r}, which names no entry of the caller's "
                f"result; its keys are {sorted(str(k) for k in outputs)}"
            ) from None
    raise NotFoundError(
        f"A SessionRunHook fetches {name!r}, the name of an entry of the caller's result, but "
        f"the caller's fetch returned {type(outputs).__name__}, not a mapping"
    )


def _resolve(value: object, outputs: object, leaf: type) -> Any:
    """Replace the ``leaf`` leaves (``_Named`` markers, or strings) by the caller's entries."""
    if isinstance(value, leaf):
        return _lookup(outputs, value if leaf is str else value.name)
    if isinstance(value, Mapping):
        return {k: _resolve(v, outputs, leaf) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_resolve(v, outputs, leaf) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_resolve(v, outputs, leaf) for v in value)
    return value


def _raise_if_feeds_intersect(feeds: Mapping[str, Any], other: Mapping[str, Any], msg: str):
    conflicts = sorted(set(feeds) & set(other))
    if conflicts:
        raise RuntimeError(f"{msg} Conflict(s): {conflicts}")


def _overrides(hook: Any, method: str) -> bool:
    return getattr(type(hook), method, None) is not getattr(SessionRunHook, method)


class HookedSession(_WrappedSession):
    """Calls the hooks' ``before_run``/``after_run`` around every run.

    Hooks that do not override a method are not called for it.
    """

    def __init__(self, sess: SessionLike, hooks: list[Any]) -> None:
        super().__init__(sess)
        self._hooks = hooks
        self._before_hooks = [h for h in hooks if _overrides(h, "before_run")]
        self._after_hooks = [h for h in hooks if _overrides(h, "after_run")]
        self._should_stop = False

    def _check_stop(self) -> bool:
        return self._should_stop

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None) -> Any:
        """Run ``fetches`` with the hooks' ``before_run``/``after_run`` around it (TF's args)."""
        if self._should_stop:
            raise RuntimeError("Run called even after should_stop requested.")
        sess = self._sess
        context = SessionRunContext(SessionRunArgs(fetches, feed_dict, options), sess)
        requests = None
        hook_feeds = None
        for hook in self._before_hooks:
            args = hook.before_run(context)
            if args is None:
                continue
            if args.fetches is not None:
                if requests is None:
                    requests = []
                requests.append((hook, args.fetches))
            if args.feed_dict:
                if hook_feeds is None:
                    hook_feeds = {}
                else:
                    _raise_if_feeds_intersect(
                        hook_feeds, args.feed_dict, "Same tensor is fed by two hooks."
                    )
                hook_feeds.update(args.feed_dict)
        if hook_feeds is not None:
            if feed_dict:
                _raise_if_feeds_intersect(
                    hook_feeds, feed_dict, "Same tensor is fed by a SessionRunHook and user."
                )
                feed_dict = {**feed_dict, **hook_feeds}
            else:
                feed_dict = hook_feeds
        if requests is None:
            outputs = sess.run(fetches, feed_dict)
            results = None
        else:
            outputs, results = _run_with_requests(sess, fetches, feed_dict, requests)
        if self._after_hooks:
            no_values = (
                _NO_VALUES
                if options is None and run_metadata is None
                else SessionRunValues(None, options, run_metadata)
            )
            for hook in self._after_hooks:
                if results is not None and id(hook) in results:
                    values = SessionRunValues(results[id(hook)], options, run_metadata)
                else:
                    values = no_values
                hook.after_run(context, values)
        if context.stop_requested:
            self._should_stop = True
        return outputs


def _run_with_requests(
    sess: SessionLike, fetches: object, feed_dict: Any, requests: list[tuple[Any, Any]]
) -> tuple[Any, dict[int, Any]]:
    """Evaluate the caller's fetches, then the hooks', in one run; resolve named entries.

    A hook fetch made only of names needs no evaluation: it is looked up in the caller's
    result. Other fetches are evaluated after the caller's, with named leaves as markers.
    """
    plans = []
    evaluated = []
    for hook, fetch in requests:
        names, others = _scan(fetch)
        if not names:
            plans.append((hook, fetch, None))
            evaluated.append(fetch)
        elif others:
            marked = _mark_names(fetch)
            plans.append((hook, marked, _Named))
            evaluated.append(marked)
        else:
            plans.append((hook, fetch, str))
    if evaluated:
        values = sess.run([fetches, *evaluated], feed_dict)
        outputs = values[0]
        values_iter = iter(values[1:])
    else:
        outputs = sess.run(fetches, feed_dict)
    results = {}
    for hook, fetch, leaf in plans:
        if leaf is str:
            results[id(hook)] = _resolve(fetch, outputs, str)
        else:
            value = next(values_iter)
            results[id(hook)] = value if leaf is None else _resolve(value, outputs, _Named)
    return outputs, results


class _CoordinatedSession(_WrappedSession):
    """Adds the session's ``Coordinator``: thread errors surface, ``close`` stops and joins."""

    def __init__(
        self, sess: SessionLike, coord: Coordinator, stop_grace_period_secs: float = 120
    ) -> None:
        super().__init__(sess)
        self._coord = coord
        self._stop_grace_period_secs = stop_grace_period_secs

    def _check_stop(self) -> bool:
        coord = self._coord
        if coord.should_stop():
            coord.raise_requested_exception()
            return True
        return False

    def close(self) -> None:
        self._coord.request_stop()
        try:
            self._coord.join(
                stop_grace_period_secs=self._stop_grace_period_secs, ignore_live_threads=True
            )
        finally:
            try:
                _WrappedSession.close(self)
            except Exception:
                pass

    def run(self, *args: object, **kwargs: object) -> Any:
        try:
            return self._sess.run(*args, **kwargs)
        except PREEMPTION_ERRORS:
            raise
        except Exception:
            self._raise_preemption_error_of_a_thread()
            raise

    def run_step_fn(
        self, step_fn: Callable[[StepContext], Any], raw_session: SessionLike, run_with_hooks: Any
    ) -> Any:
        try:
            return _WrappedSession.run_step_fn(self, step_fn, raw_session, run_with_hooks)
        except PREEMPTION_ERRORS:
            raise
        except Exception:
            self._raise_preemption_error_of_a_thread()
            raise

    def _raise_preemption_error_of_a_thread(self) -> None:
        """Raise the preemption error a thread reported, if any: it explains the failure."""
        try:
            self._coord.raise_requested_exception()
        except PREEMPTION_ERRORS:
            raise
        except Exception:
            pass


class _RecoverableSession(_WrappedSession):
    """On a preemption error: close the session, create a new one, and retry."""

    def __init__(self, sess_creator: Any) -> None:
        self._sess_creator = sess_creator
        super().__init__(self._create_session())

    def _create_session(self) -> Any:
        while True:
            try:
                return self._sess_creator.create_session()
            except PREEMPTION_ERRORS as e:
                logger.info(
                    "An error was raised while a session was being created. This may be due "
                    "to a preemption of a connected worker. A new session will be created. "
                    "Error: %s",
                    e,
                )

    def _recover(self, error: BaseException) -> None:
        logger.info(
            "An error was raised. This may be due to a preemption in a connected worker. The "
            "current session will be closed and a new session will be created (restoring the "
            "newest checkpoint). Error: %s",
            error,
        )
        self.close()

    def _check_stop(self) -> bool:
        try:
            if self._sess is None:
                return True
            return self._sess._check_stop()
        except PREEMPTION_ERRORS as e:
            self._recover(e)
            self._sess = self._create_session()
            return False
        except Exception:
            return True  # close() raises it.

    def run(self, *args: object, **kwargs: object) -> Any:
        while True:
            try:
                if self._sess is None:
                    self._sess = self._create_session()
                return self._sess.run(*args, **kwargs)
            except PREEMPTION_ERRORS as e:
                self._recover(e)

    def run_step_fn(
        self, step_fn: Callable[[StepContext], Any], raw_session: SessionLike, run_with_hooks: Any
    ) -> Any:
        del raw_session, run_with_hooks
        while True:
            try:
                if self._sess is None:
                    self._sess = self._create_session()
                sess = self._sess
                return sess.run_step_fn(step_fn, sess.raw_session(), sess.run)
            except PREEMPTION_ERRORS as e:
                self._recover(e)
