"""``NullSummaryWriter``: the summary writer of a replica that writes no summaries.

Only the chief writes events (TF's rule, and ours: one events file per run). TF's non-chief
``Supervisor.summary_writer`` was None, so a loop written for one process,
``sv.summary_writer.add_scalar(...)``, raised ``AttributeError`` on every other rank under
``torchrun`` and took the group down. A non-chief gets this writer instead: every call of
``SummaryWriter``'s API is accepted and does nothing (as Lightning's loggers on rank > 0).

TF name: none (TF's non-chief writer was None).
"""

from __future__ import annotations

import threading
from typing import Any

from torchsupervisor.summary.counters import WriterCounters

__all__ = ["NullSummaryWriter"]


class NullSummaryWriter:
    """A writer that accepts every ``SummaryWriter`` call and writes nothing.

    ``add_scalar``, ``add_histogram``, ``add_image``, ``add_audio``, ``add_text``,
    ``add_summary``, ``add_session_log``, ``add_event``, ``flush``, ``close``, ``reopen``
    (and every other method of ``SummaryWriter``) return None; ``request_flush`` returns an
    event that is set; ``get_logdir`` returns None; ``counters`` returns zeros. A name that
    ``SummaryWriter`` does not have raises ``AttributeError``, as it would there.

    ``bool(writer)`` is False, so ``if sv.summary_writer:`` still tells a writing chief.

    Thread safety: every method may be called from any thread.

    TF name: none (see the module docstring).
    """

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "NullSummaryWriter()"

    def __enter__(self) -> NullSummaryWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def get_logdir(self) -> None:
        """None: there is no events file.

        TF name: ``FileWriter.get_logdir``.
        """
        return None

    def request_flush(self) -> threading.Event:
        """Return an event that is set (nothing to flush).

        TF name: none.
        """
        done = threading.Event()
        done.set()
        return done

    def counters(self) -> WriterCounters:
        """Zeros: nothing was written.

        TF name: none.
        """
        return WriterCounters()

    def __getattr__(self, name: str) -> Any:
        from torchsupervisor.summary.writer import SummaryWriter

        if name.startswith("_") or not callable(getattr(SummaryWriter, name, None)):
            raise AttributeError(f"'NullSummaryWriter' object has no attribute {name!r}")
        return _nothing


def _nothing(*args: object, **kwargs: object) -> None:
    del args, kwargs
