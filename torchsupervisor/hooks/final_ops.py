"""``FinalOpsHook``: evaluate fetches once, at the end of the session.

TF name: ``tf.compat.v1.train.FinalOpsHook``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchsupervisor.errors import OutOfRangeError
from torchsupervisor.hooks.session_run_hook import SessionRunHook

if TYPE_CHECKING:
    from torchsupervisor.core.session import SessionLike

__all__ = ["FinalOpsHook"]

logger = logging.getLogger("torchsupervisor")


class FinalOpsHook(SessionRunHook):
    """Evaluate fetches once, at the end of the session; the values are kept.

    Args:
        final_ops: A fetch structure (as ``Session.run``) evaluated by ``end()``.
        final_ops_feed_dict: Keyword arguments for the fetched callables.

    Raises:
        OutOfRangeError, StopIteration: From ``end()``, re-raised after a warning: a final op
            should not read from the input.

    Thread safety: used on the training thread only.

    TF name: ``tf.compat.v1.train.FinalOpsHook``.
    """

    def __init__(
        self, final_ops: Any, final_ops_feed_dict: Mapping[str, Any] | None = None
    ) -> None:
        self._final_ops = final_ops
        self._final_ops_feed_dict = final_ops_feed_dict
        self._final_ops_values: Any = None

    @property
    def final_ops_values(self) -> Any:
        """The values of the final ops, shaped like them (None before ``end()``).

        TF name: ``tf.compat.v1.train.FinalOpsHook.final_ops_values``.
        """
        return self._final_ops_values

    def end(self, session: SessionLike) -> None:
        """Evaluate the final ops on ``session`` (nothing if ``final_ops`` is None).

        Raises:
            OutOfRangeError, StopIteration: Re-raised after a warning.

        TF name: ``tf.compat.v1.train.FinalOpsHook.end``.
        """
        if self._final_ops is None:
            return
        try:
            self._final_ops_values = session.run(
                self._final_ops, feed_dict=self._final_ops_feed_dict
            )
        except (OutOfRangeError, StopIteration):
            logger.warning(
                "An OutOfRangeError or StopIteration was raised by the final ops of a "
                "FinalOpsHook. A final op should not have a dependency back to some input "
                "source: it should only read values (metrics computed during the run), not "
                "read another batch from an input that is now exhausted."
            )
            raise
