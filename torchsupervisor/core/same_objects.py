"""Whether mappings still hold the very same objects, checked in a few passes in C.

A save at every step boundary reads structures that rarely change between saves: a model's
modules and parameters, an optimizer's state dicts. Comparing them by object identity with
what they held at the last save, a pass in C over every key and value (``operator.is_``
mapped over lists), costs far less than deriving again what was derived from them, one Python
step per item.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Contents", "contents", "same_contents"]

Contents = tuple[list[int], list[Any], list[Any]]
"""The lengths, keys and values of a list of mappings, one mapping after the other."""


def contents(mappings: Sequence[Mapping[Any, Any]]) -> Contents:
    """What ``mappings`` hold now, for ``same_contents`` to compare with later."""
    keys = list(itertools.chain.from_iterable(mappings))
    values = list(itertools.chain.from_iterable(m.values() for m in mappings))
    return list(map(len, mappings)), keys, values


def same_contents(mappings: Sequence[Mapping[Any, Any]], known: Contents) -> bool:
    """Whether ``mappings`` hold the same keys (equal), in the same order, and the very same
    values (identical) as when ``contents`` made ``known``."""
    lengths, keys, values = known
    return (
        list(map(len, mappings)) == lengths
        and list(itertools.chain.from_iterable(mappings)) == keys
        and all(
            map(
                operator.is_,
                itertools.chain.from_iterable(m.values() for m in mappings),
                values,
            )
        )
    )
