"""Keep-best retention: which checkpoints are the best, by the metrics saved with them.

``Saver(keep_best=K, best_fn=..., best_mode="max")`` keeps, besides the newest
``max_to_keep``, the K checkpoints whose metrics score best, and never deletes one of them
until K better ones exist (Orbax's ``best_fn``/``best_mode`` are the model; here the newest are
kept as well, so a resume always finds the last checkpoint). A checkpoint's metrics are given
to ``Saver.save(metrics=...)`` and stored in its manifest, so a restarted run ranks the
checkpoints of the last one again (``Keeper.set_last_checkpoints_with_time``) and
``torchsupervisor ls`` shows them.

TF name: none (TF's ``Saver`` kept the newest only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torchsupervisor.core.checks import check_int

__all__ = ["BestRule", "best_rule", "check_metrics"]


@dataclass(frozen=True)
class BestRule:
    """The ``keep`` best checkpoints by ``score(metrics)``, besides the newest.

    Attributes:
        keep: How many best checkpoints to keep (> 0).
        score: ``metrics -> float``; a checkpoint without metrics, or whose score is None,
            ranks nowhere.
        higher_is_better: ``best_mode == "max"``.
    """

    keep: int
    score: Callable[[Mapping[str, float]], float | None]
    higher_is_better: bool

    def of(self, metrics: Mapping[str, float] | None) -> float | None:
        """The score of a checkpoint's metrics (None: it ranks nowhere)."""
        if metrics is None:
            return None
        value = self.score(metrics)
        return None if value is None else float(value)


def best_rule(keep_best: Any, best_fn: Any, best_mode: Any) -> BestRule | None:
    """The rule of ``Saver``'s ``keep_best``, ``best_fn`` and ``best_mode`` (None: no rule).

    Raises:
        TypeError: For a ``keep_best`` that is not an int, or a ``best_fn`` that is neither a
            metric's name nor a callable.
        ValueError: For a negative ``keep_best``, a ``keep_best`` without ``best_fn``, or a
            ``best_mode`` other than ``"max"`` and ``"min"``.
    """
    keep = check_int("keep_best", keep_best)
    if best_mode not in ("max", "min"):
        raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
    if not keep:
        return None
    if isinstance(best_fn, str):
        name = best_fn

        def score(metrics: Mapping[str, float]) -> float | None:
            return metrics.get(name)

    elif callable(best_fn):
        score = best_fn
    elif best_fn is None:
        raise ValueError(
            "keep_best needs best_fn: the name of a metric given to save(metrics=...), or a "
            "function of the metrics"
        )
    else:
        raise TypeError(f"best_fn must be a metric's name or a callable, got {best_fn!r}")
    return BestRule(keep, score, best_mode == "max")


def check_metrics(metrics: Any) -> dict[str, float] | None:
    """``save``'s ``metrics`` as stored: None, or names mapped to finite numbers.

    Raises:
        TypeError: For something else than a mapping of str to real numbers.
        ValueError: For a value that is not finite (NaN or infinite).
    """
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of names to numbers, got {metrics!r}")
    checked = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise TypeError(f"metrics names must be str, got {name!r}")
        if hasattr(value, "item") and callable(value.item):  # A one-element tensor.
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"metric {name!r} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"metric {name!r} is not finite: {value!r}")
        checked[name] = float(value)
    return checked
