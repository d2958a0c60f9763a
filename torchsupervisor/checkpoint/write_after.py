"""A background save that waits for something before it writes (``save_async``'s
``write_after``): the ``CheckpointDriver`` passes its summary writer's flush of the steps up to
the snapshot, so that they are on disk before the checkpoint commits.

TF name: none.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

__all__ = ["WRITE_AFTER_WAIT_SECS", "Waitable", "wait_before_writing"]

logger = logging.getLogger("torchsupervisor")

WRITE_AFTER_WAIT_SECS = 10.0
"""The longest a save waits for ``save_async``'s ``write_after`` before it writes anyway."""

_WAIT_SLICE_SECS = 0.05  # How often that wait looks for a cancellation.


class Waitable(Protocol):
    """Something a save can wait for (``save_async``'s ``write_after``): a
    ``threading.Event``, or any object with its ``wait``."""

    def wait(self, timeout: float | None = None) -> bool: ...


def wait_before_writing(event: Waitable | None, cancel: threading.Event) -> None:
    """Wait for ``event`` (on the writer thread), at most ``WRITE_AFTER_WAIT_SECS``, then
    write anyway with a warning; at once when ``cancel`` is set or ``event`` is None.

    Real time, not the Saver's clock: what is waited for is another thread's I/O, and a fake
    clock would skip the wait.
    """
    if event is None:
        return
    end = time.monotonic() + WRITE_AFTER_WAIT_SECS
    while not event.wait(_WAIT_SLICE_SECS):
        if cancel.is_set():
            return
        if time.monotonic() >= end:
            logger.warning(
                "The summaries up to this checkpoint were not flushed within %g s; "
                "writing it anyway",
                WRITE_AFTER_WAIT_SECS,
            )
            return
