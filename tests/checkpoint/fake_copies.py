"""Device copies on the CPU path: every ``Stager.stage`` reports one (fake) CUDA copy event,
and the order of staging, waiting for the copies and reading the buffers is recorded."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torchsupervisor.checkpoint.snapshot import Stager


class _Copy:
    """A ``torch.cuda.Event`` as the writer uses it: ``synchronize`` waits for the copies."""

    def __init__(self, order: list[str]) -> None:
        self.order = order

    def synchronize(self) -> None:
        self.order.append("copies done")


def fake_device_copies(
    order: list[str], reader: tuple[Any, str, str], set_attr: Callable[..., None] = setattr
) -> None:
    """Make staging report one copy event, and ``reader`` (a module, the name of the function
    that reads the buffers, and what to record at its call) record its call, in ``order``.

    ``set_attr``: ``monkeypatch.setattr`` in a test's own process, ``setattr`` in a rank's.
    """
    real_stage = Stager.stage

    def stage(self: Stager, *args: Any, **kwargs: Any) -> Any:
        order.append(f"staged, wait={kwargs.get('wait', True)}")
        return dataclasses.replace(real_stage(self, *args, **kwargs), copies=(_Copy(order),))

    module, name, label = reader
    real_read = getattr(module, name)

    def read(*args: Any, **kwargs: Any) -> Any:
        order.append(label)
        return real_read(*args, **kwargs)

    set_attr(Stager, "stage", stage)
    set_attr(module, name, read)
