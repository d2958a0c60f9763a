"""One shared ``SummaryWriter`` per log directory per process.

TF names: ``tf.compat.v1.summary.FileWriterCache``, ``tf.compat.v1.train.SummaryWriterCache``.
"""

from __future__ import annotations

import os
import threading

from torchsupervisor.storage import paths as url_paths
from torchsupervisor.summary.writer import SummaryWriter

__all__ = ["FileWriterCache", "SummaryWriterCache"]


class SummaryWriterCache:
    """A process-wide cache of writers, so that hooks writing to one directory share one file.

    Directories are compared after ``os.path.abspath`` (``"logs/"`` and ``"./logs"`` share a
    writer). A cached writer that was closed stays cached (as in TF); ``reopen()`` it or
    ``clear()`` the cache.

    Thread safety: ``get`` and ``clear`` may be called from any thread.

    TF name: ``tf.compat.v1.summary.FileWriterCache`` (alias ``FileWriterCache``).
    """

    _lock = threading.Lock()
    _cache: dict[str, SummaryWriter] = {}

    @staticmethod
    def get(logdir: str | os.PathLike[str]) -> SummaryWriter:
        """Return the writer of ``logdir``, creating it (and the directory) on first use.

        Args:
            logdir: The log directory.

        Returns:
            The shared ``SummaryWriter`` for that directory.

        TF name: ``FileWriterCache.get``.
        """
        key = url_paths.abspath(os.fspath(logdir))
        with SummaryWriterCache._lock:
            writer = SummaryWriterCache._cache.get(key)
            if writer is None:
                writer = SummaryWriter(logdir)
                SummaryWriterCache._cache[key] = writer
            return writer

    @staticmethod
    def clear() -> None:
        """Close every cached writer (pending events are written) and forget them.

        TF name: ``FileWriterCache.clear``.
        """
        with SummaryWriterCache._lock:
            writers = list(SummaryWriterCache._cache.values())
            SummaryWriterCache._cache.clear()
        for writer in writers:
            writer.close()


FileWriterCache = SummaryWriterCache
"""TF 1's name for ``SummaryWriterCache``."""
