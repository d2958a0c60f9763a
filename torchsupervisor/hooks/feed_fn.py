"""``FeedFnHook``: feed the result of a function to every run.

TF name: ``tf.compat.v1.train.FeedFnHook``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torchsupervisor.hooks.session_run_hook import (
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
)

__all__ = ["FeedFnHook"]


class FeedFnHook(SessionRunHook):
    """Feed the result of ``feed_fn()`` to every run.

    Args:
        feed_fn: Returns the ``feed_dict`` (keyword arguments of the fetched callables) of the
            coming run.

    Raises:
        RuntimeError: From the run, if a key is also fed by the caller or another hook.

    Thread safety: used on the training thread only.

    TF name: ``tf.compat.v1.train.FeedFnHook``.
    """

    def __init__(self, feed_fn: Callable[[], Mapping[str, Any]]) -> None:
        if not callable(feed_fn):
            raise TypeError(f"feed_fn must be callable, got {feed_fn!r}")
        self.feed_fn = feed_fn

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        """Return ``feed_fn()`` as this run's feeds (no fetches).

        Returns:
            ``SessionRunArgs(fetches=None, feed_dict=feed_fn())``.

        TF name: ``tf.compat.v1.train.FeedFnHook.before_run``.
        """
        del run_context
        return SessionRunArgs(fetches=None, feed_dict=self.feed_fn())
