"""``basic_train_loop``: TF's smallest training loop over a ``Supervisor``."""

from __future__ import annotations

from typing import Any

from torchsupervisor.errors import AbortedError
from torchsupervisor.supervisor.supervisor import Supervisor

__all__ = ["basic_train_loop"]


def basic_train_loop(
    supervisor: Supervisor,
    train_step_fn: Any,
    args: object = None,
    kwargs: object = None,
    master: str = "",
) -> None:
    """Run ``train_step_fn(sess, *args, **kwargs)`` until the supervisor stops.

    An ``AbortedError`` restarts the managed session (restoring the last checkpoint) and the
    loop continues.

    TF name: ``tf.compat.v1.train.basic_train_loop``.
    """
    args = args or []
    kwargs = kwargs or {}
    should_retry = True
    while should_retry:
        try:
            should_retry = False
            with supervisor.managed_session(master) as sess:
                while not supervisor.should_stop():
                    train_step_fn(sess, *args, **kwargs)
        except AbortedError:
            should_retry = True
