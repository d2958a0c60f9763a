"""Checks of constructor arguments: a bad value fails when the object is built, by name.

Every public constructor (Supervisor, Saver, SummaryWriter, Coordinator, the hooks,
MonitoredTrainingSession) checks its arguments with these functions, so that
``Saver(max_to_keep=-1)`` or ``Supervisor(save_model_secs="x")`` raises at once with the
argument's name and value, instead of misbehaving hours later (every checkpoint deleted right
after it is written) or failing deep inside with another name.

Each function returns the value normalised (an ``int`` for integers, a ``float`` for numbers,
a ``str`` for paths) and raises:

* ``TypeError`` for a value of the wrong type: ``"max_to_keep must be an integer or None, got
  '3' (str)"``;
* ``ValueError`` for a value of the right type out of range: ``"max_to_keep must be >= 0, got
  -1"``.

``bool`` is never accepted as a number (``True`` is an ``int`` to Python, not a count to us).

TF name: none (TF checked some arguments when the graph was built, others never).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "check_bool",
    "check_clock",
    "check_duck",
    "check_hooks",
    "check_int",
    "check_iterable",
    "check_number",
    "check_path",
    "check_signals",
    "check_state",
    "check_str",
]


def _type_error(name: str, expected: str, value: object, allow_none: bool) -> TypeError:
    expected = f"{expected} or None" if allow_none else expected
    return TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")


def check_int(
    name: str, value: object, *, minimum: int | None = 0, allow_none: bool = False
) -> int | None:
    """Return ``value`` as an ``int`` after checking it is an integer ``>= minimum``.

    Args:
        name: The argument's name, for the message.
        value: The value given.
        minimum: The smallest value allowed; None: no bound.
        allow_none: Accept None (returned as None).

    Raises:
        TypeError: Not an integer (a float, a string, a bool).
        ValueError: Below ``minimum``.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _type_error(name, "an integer", value, allow_none)
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_number(
    name: str,
    value: object,
    *,
    minimum: float | None = 0.0,
    positive: bool = False,
    allow_none: bool = False,
    allow_inf: bool = True,
) -> float | None:
    """Return ``value`` as a ``float`` after checking it is a real number in range.

    Args:
        name: The argument's name, for the message.
        value: The value given (seconds, hours, ...).
        minimum: The smallest value allowed (inclusive); None: no bound.
        positive: Require ``value > 0`` (``minimum`` is then ignored).
        allow_none: Accept None (returned as None).
        allow_inf: Accept ``float("inf")`` ("never").

    Raises:
        TypeError: Not a real number (a string, a bool, a complex number).
        ValueError: NaN, infinite when not allowed, or out of range.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _type_error(name, "a number", value, allow_none)
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value:g}")
    if not positive and minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum:g}, got {value:g}")
    return value


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` after checking it is a ``bool`` (or numpy's).

    Raises:
        TypeError: Anything else (``"yes"``, ``1``).
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise _type_error(name, "True or False", value, False)


def check_str(
    name: str, value: object, *, allow_none: bool = False, allow_empty: bool = True
) -> Any:
    """Return ``value`` after checking it is a ``str``.

    Raises:
        TypeError: Not a string.
        ValueError: Empty when ``allow_empty`` is False.
    """
    if value is None and allow_none:
        return None
    if not isinstance(value, str):
        raise _type_error(name, "a string", value, allow_none)
    if not allow_empty and not value:
        raise ValueError(f"{name} must not be empty")
    return value


def check_path(name: str, value: object, *, allow_none: bool = True) -> str | None:
    """Return ``value`` as a ``str`` path after checking it is a ``str`` or ``os.PathLike``.

    Raises:
        TypeError: Anything else (``logdir=123``, bytes).
        ValueError: A path containing a NUL character.
    """
    if value is None and allow_none:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise _type_error(name, "a path (str or os.PathLike)", value, allow_none)
    path = os.fspath(value)
    if not isinstance(path, str):
        raise _type_error(name, "a path (str or os.PathLike)", value, allow_none)
    if "\x00" in path:
        raise ValueError(f"{name} must not contain a NUL character, got {path!r}")
    return path


def check_state(name: str, value: object) -> Mapping[str, Any] | None:
    """Return ``value`` after checking it is None or a mapping of ``str`` names.

    Raises:
        TypeError: Not a mapping (``state=[model]``), or a name that is not a ``str``.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be a mapping of names to stateful objects (e.g. {{'model': model, "
            f"'optimizer': optimizer}}), got {type(value).__name__}: {value!r:.100}"
        )
    for key in value:
        if not isinstance(key, str):
            raise TypeError(f"{name} names must be str, got {type(key).__name__}: {key!r}")
    return value


def check_signals(name: str, value: object) -> tuple[int, ...]:
    """Return ``value`` as a tuple of signal numbers after checking each is a valid signal.

    None or empty: no signals.

    Raises:
        TypeError: Not an iterable of integers.
        ValueError: A number that is not a signal of this platform.
    """
    import signal

    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of signals, got {value!r}")
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise TypeError(f"{name} must be a list of signals, got the item {item!r}")
        try:
            out.append(signal.Signals(int(item)))
        except ValueError:
            raise ValueError(f"{name}: {item!r} is not a signal of this platform") from None
    return tuple(out)


def check_duck(
    name: str, value: object, methods: tuple[str, ...], expected: str, *, allow_none: bool = True
) -> Any:
    """Return ``value`` after checking it has the callable attributes ``methods``.

    Args:
        name: The argument's name, for the message.
        value: The value given.
        methods: The methods it must have (``("create_session",)``).
        expected: What it should be, for the message (``"a SessionCreator"``).
        allow_none: Accept None (returned as None).

    Raises:
        TypeError: A method is missing, naming the argument, the value and what was expected.
    """
    if value is None and allow_none:
        return None
    if not all(callable(getattr(value, m, None)) for m in methods):
        raise _type_error(name, expected, value, allow_none)
    return value


def check_clock(name: str, value: object) -> Any:
    """Return ``value`` (None or a ``core.clock.Clock``-like object) after checking it.

    Raises:
        TypeError: It lacks ``time``, ``monotonic``, ``sleep`` or ``wait``.
    """
    return check_duck(name, value, ("time", "monotonic", "sleep", "wait"), "a Clock")


def check_hooks(name: str, value: object) -> Any:
    """Return ``value`` after checking it is None or an iterable of ``SessionRunHook`` s.

    Raises:
        TypeError: Not iterable, or an item without the hook methods (``before_run``,
            ``after_run``), naming the argument and the item.
    """
    check_iterable(name, value)
    if value is None:
        return None
    value = list(value)
    for i, hook in enumerate(value):
        check_duck(
            f"{name}[{i}]", hook, ("before_run", "after_run"), "a SessionRunHook", allow_none=False
        )
    return value


def check_iterable(name: str, value: object, *, allow_none: bool = True) -> Any:
    """Return ``value`` after checking it is None or an iterable other than a string.

    Raises:
        TypeError: Not iterable, or a string.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _type_error(name, "a list", value, allow_none)
    return value
