"""Histogram summaries: TF's fixed bucket rule, or numpy's bins for ``add_histogram``.

TF counts every histogram in the same 1551 buckets (``default_bucket_limits``), whose limits
grow by 10% from 1e-12 to 1e20 on both sides of zero, and stores each run of empty buckets as
one entry. ``SummaryWriter.add_histogram`` may ask for ``numpy.histogram`` bins instead.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from tensorboard.compat.proto import histogram_pb2, summary_pb2

from torchsupervisor import errors
from torchsupervisor.summary.encoders.values import to_numpy

__all__ = ["check_bins", "default_bucket_limits", "histogram_pb", "torch_histogram_pb"]

DBL_MAX = sys.float_info.max


def _default_bucket_limits() -> np.ndarray:
    positive = []
    v = 1e-12
    while v < 1e20:
        positive.append(v)
        v *= 1.1
    positive.append(DBL_MAX)
    negative = [-x for x in reversed(positive)]
    return np.array([*negative, 0.0, *positive], dtype=np.float64)


_BUCKET_LIMITS = _default_bucket_limits()
_BUCKET_LIMITS.flags.writeable = False

# numpy's named bin-width estimators (``np.histogram(bins="auto")`` etc.).
_NUMPY_BIN_RULES = frozenset({"auto", "fd", "doane", "scott", "stone", "rice", "sturges", "sqrt"})


def default_bucket_limits() -> np.ndarray:
    """Return TF's default histogram bucket limits (1551 float64 values, read-only).

    ``-DBL_MAX``, the negated geometric series ``1e-12 * 1.1**k`` below ``1e20`` (descending),
    ``0.0``, the same series ascending, ``DBL_MAX``.

    TF name: ``histogram::InitDefaultBuckets``.
    """
    return _BUCKET_LIMITS


def _histogram_values(tag: str, values: object) -> np.ndarray:
    arr = to_numpy(values)
    if arr.dtype.kind not in "biuf":
        raise errors.InvalidArgumentError(
            f"histogram summary '{tag}' expects real numbers, got dtype {arr.dtype}"
        )
    x = arr.astype(np.float64, copy=False).ravel()
    finite = np.isfinite(x)
    if not finite.all():
        first = x[int(np.argmin(finite))]
        if np.isnan(first):
            raise errors.InvalidArgumentError(f"Nan in summary histogram for: {tag}")
        raise errors.InvalidArgumentError(f"Infinity in summary histogram for: {tag}")
    return x


def _histogram_stats(x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {"min": DBL_MAX, "max": -DBL_MAX, "num": 0.0, "sum": 0.0, "sum_squares": 0.0}
    with np.errstate(over="ignore"):  # sums beyond DBL_MAX are inf, as in TF's doubles
        return {
            "min": float(x.min()),
            "max": float(x.max()),
            "num": float(x.size),
            "sum": float(x.sum()),
            "sum_squares": float(np.dot(x, x)),
        }


def _tf_histogram_proto(x: np.ndarray) -> histogram_pb2.HistogramProto:
    limits = _BUCKET_LIMITS
    n = limits.size
    index = np.searchsorted(limits, x, side="right")
    np.minimum(index, n - 1, out=index)
    counts = np.bincount(index, minlength=n)
    # Keep every non-empty bucket, and one entry (its last bucket) for each run of empty ones.
    non_empty = counts > 0
    keep = non_empty.copy()
    keep[:-1] |= non_empty[1:]
    keep[-1] = True
    return histogram_pb2.HistogramProto(
        bucket_limit=limits[keep].tolist(),
        bucket=counts[keep].astype(np.float64).tolist(),
        **_histogram_stats(x),
    )


def _numpy_histogram_proto(x: np.ndarray, bins: Any) -> histogram_pb2.HistogramProto:
    counts, edges = np.histogram(x, bins=bins)
    return histogram_pb2.HistogramProto(
        bucket_limit=edges[1:].astype(np.float64).tolist(),
        bucket=counts.astype(np.float64).tolist(),
        **_histogram_stats(x),
    )


def check_bins(bins: Any) -> None:
    """Validate the ``bins`` argument of ``add_histogram`` without reading any value.

    Raises:
        ValueError: ``bins`` is neither ``"tensorflow"``, a numpy bin rule name, a positive int,
            nor a 1-D increasing sequence of at least 2 edges.
    """
    if isinstance(bins, str):
        if bins != "tensorflow" and bins not in _NUMPY_BIN_RULES:
            raise ValueError(
                f"bins must be 'tensorflow', a numpy bin rule ({sorted(_NUMPY_BIN_RULES)}), "
                f"an int or a sequence of bin edges; got {bins!r}"
            )
        return
    if isinstance(bins, (bool, np.bool_)):
        raise ValueError(f"bins must be a positive int or a sequence of edges, got {bins!r}")
    if isinstance(bins, (int, np.integer)):
        if bins < 1:
            raise ValueError(f"bins must be a positive int, got {bins}")
        return
    edges = np.asarray(bins, dtype=np.float64)
    if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) < 0):
        raise ValueError(
            "bins given as edges must be a 1-D increasing sequence of at least 2 numbers, "
            f"got {bins!r}"
        )


def histogram_pb(tag: str, values: object) -> summary_pb2.Summary:
    """Encode the distribution of ``values`` as a histogram summary with TF's default buckets.

    Buckets: ``default_bucket_limits()``; bucket ``i`` counts values in
    ``[limit[i-1], limit[i])``. Empty buckets are not stored one by one: each run of empty
    buckets is one entry (the limit of its last bucket, count 0). ``min``, ``max``, ``num``,
    ``sum`` and ``sum_squares`` describe the values; with no values ``min = DBL_MAX`` and
    ``max = -DBL_MAX``.

    Args:
        tag: The summary tag (used as is).
        values: Real numbers of any shape (flattened).

    Returns:
        A ``Summary`` with one value holding a ``HistogramProto``.

    Raises:
        InvalidArgumentError: A value is NaN (``"Nan in summary histogram for: <tag>"``) or
            infinite (``"Infinity in summary histogram for: <tag>"``); the first non-finite value
            in flattened order decides which. Also when the values are not real numbers.

    TF name: the ``HistogramSummary`` kernel.
    """
    return torch_histogram_pb(tag, values, "tensorflow")


def torch_histogram_pb(tag: str, values: object, bins: Any = "tensorflow") -> summary_pb2.Summary:
    """Encode the distribution of ``values`` with the bins ``add_histogram`` accepts.

    Args:
        tag: The summary tag (used as is).
        values: Real numbers of any shape (flattened).
        bins: ``"tensorflow"`` for TF's default buckets (as ``histogram_pb``); an int, a
            sequence of edges or a numpy rule name for ``numpy.histogram`` bins (values outside
            given edges are not counted). Checked by ``check_bins``.

    Returns:
        A ``Summary`` with one value holding a ``HistogramProto``.

    Raises:
        InvalidArgumentError: As ``histogram_pb``.

    TF name: none (``torch.utils.tensorboard.SummaryWriter.add_histogram``'s encoding).
    """
    x = _histogram_values(tag, values)
    if isinstance(bins, str) and bins == "tensorflow":
        histo = _tf_histogram_proto(x)
    else:
        histo = _numpy_histogram_proto(x, bins)
    summary = summary_pb2.Summary()
    summary.value.add(tag=tag, histo=histo)
    return summary
