"""TF 1's ``tf.logging``: the verbosity of the library's log lines, and functions to log.

The library logs to the Python logger ``"torchsupervisor"``: ``LoggingTensorHook``'s values
and ``StepCounterHook``'s rate at INFO, a skipped summary or a failed checkpoint at WARNING
and ERROR. Python shows WARNING and above by default and INFO nowhere, so a TF program's
``tf.logging.set_verbosity(tf.logging.INFO)`` becomes ``ts.logging.set_verbosity(
ts.logging.INFO)``: it sets the logger's level and, where nothing configured logging (no
handler on it or on the root logger), prints its lines on stderr as ``INFO:torchsupervisor:
...``, as TF printed ``INFO:tensorflow:...``. A program that configures logging itself
(``logging.basicConfig(level=logging.INFO)``) needs none of this.

TF names: ``tf.compat.v1.logging.{set_verbosity,get_verbosity,debug,info,warning,warn,error,
fatal,DEBUG,INFO,WARN,ERROR,FATAL}``.
"""

from __future__ import annotations

import logging as _logging

__all__ = [
    "DEBUG",
    "ERROR",
    "FATAL",
    "INFO",
    "WARN",
    "debug",
    "error",
    "fatal",
    "get_verbosity",
    "info",
    "set_verbosity",
    "warn",
    "warning",
]

DEBUG = _logging.DEBUG
INFO = _logging.INFO
WARN = _logging.WARNING
ERROR = _logging.ERROR
FATAL = _logging.CRITICAL

_logger = _logging.getLogger("torchsupervisor")


class _StderrHandler(_logging.StreamHandler):
    """The handler ``set_verbosity`` adds where nothing configured logging."""


def set_verbosity(v: int) -> None:
    """Show the library's log lines of level ``v`` and above.

    Sets the level of the ``"torchsupervisor"`` logger; if neither it nor the root logger has
    a handler, adds one printing to stderr as ``LEVEL:torchsupervisor:message`` (once).

    Args:
        v: A level: ``DEBUG``, ``INFO``, ``WARN``, ``ERROR``, ``FATAL`` (Python's levels).

    Raises:
        TypeError: For a ``v`` that is not an int.

    TF name: ``tf.compat.v1.logging.set_verbosity``.
    """
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"v must be a logging level (an int such as ts.logging.INFO), got {v!r}")
    _logger.setLevel(v)
    configured = _logger.handlers or _logging.getLogger().handlers
    if not configured:
        handler = _StderrHandler()
        handler.setFormatter(_logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
        _logger.addHandler(handler)


def get_verbosity() -> int:
    """Return the level of the library's logger (its effective level when unset).

    TF name: ``tf.compat.v1.logging.get_verbosity``.
    """
    return _logger.getEffectiveLevel()


def debug(msg: str, *args: object, **kwargs: object) -> None:
    """Log ``msg % args`` at DEBUG to the library's logger.

    TF name: ``tf.compat.v1.logging.debug``.
    """
    _logger.debug(msg, *args, **kwargs)


def info(msg: str, *args: object, **kwargs: object) -> None:
    """Log ``msg % args`` at INFO to the library's logger.

    TF name: ``tf.compat.v1.logging.info``.
    """
    _logger.info(msg, *args, **kwargs)


def warning(msg: str, *args: object, **kwargs: object) -> None:
    """Log ``msg % args`` at WARNING.

    TF name: ``tf.compat.v1.logging.warning``.
    """
    _logger.warning(msg, *args, **kwargs)


def warn(msg: str, *args: object, **kwargs: object) -> None:
    """Log ``msg % args`` at WARNING.

    TF name: ``tf.compat.v1.logging.warn``.
    """
    _logger.warning(msg, *args, **kwargs)


def error(msg: str, *args: object, **kwargs: object) -> None:
    """Log ``msg % args`` at ERROR.

    TF name: ``tf.compat.v1.logging.error``.
    """
    _logger.error(msg, *args, **kwargs)


def fatal(msg: str, *args: object, **kwargs: object) -> None:
    """Log ``msg % args`` at CRITICAL (it does not exit).

    TF name: ``tf.compat.v1.logging.fatal``.
    """
    _logger.critical(msg, *args, **kwargs)
