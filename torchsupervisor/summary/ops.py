"""TF 1's summary ops: callables registered in the default graph's collections.

``scalar``, ``histogram``, ``image``, ``audio`` and ``text`` return a ``SummaryOp``, a
zero-argument callable that reads its source (a tensor's current value, a callable's result,
or a constant) each time it is called and encodes it with the matching encoder
(``encoders/``). They register themselves in the default graph's collections as TF's ops do,
so that ``merge_all()`` and the Supervisor's ``summary_op=USE_DEFAULT`` find them. ``merge``
concatenates ops; ``zero_fraction`` is the statistic TF code often summarizes.

Nothing here does I/O; the Supervisor's summary service evaluates the ops and hands the protos
to a ``SummaryWriter``.

The ops encode through ``encoders/`` (``scalar_pb`` ... ``text_pb``), which
``torchsupervisor.summary`` exports.

TF names: ``tf.compat.v1.summary.{scalar,histogram,image,audio,text,merge,merge_all}``,
``tf.math.zero_fraction``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from google.protobuf.message import DecodeError
from tensorboard.compat.proto import summary_pb2

from torchsupervisor import errors
from torchsupervisor.core import registry
from torchsupervisor.core.registry import GraphKeys
from torchsupervisor.summary.encoders import (
    audio_pb,
    histogram_pb,
    image_pb,
    scalar_pb,
    text_pb,
)

__all__ = [
    "SummaryOp",
    "audio",
    "histogram",
    "image",
    "merge",
    "merge_all",
    "scalar",
    "text",
    "zero_fraction",
]

logger = logging.getLogger("torchsupervisor")


class _NoValueYet(Exception):
    """A summary's source has no value yet (the op is skipped, see ``SummaryOp``)."""


def _read_source(source: object) -> Any:
    """Return the current value of a summary op's source.

    Raises:
        _NoValueYet: A callable source raised ``LookupError`` (``KeyError``, ``IndexError``:
            a value not computed yet, such as a validation loss before the first
            validation) or returned None.
    """
    if isinstance(source, torch.Tensor):
        return source.detach()
    if callable(source):
        try:
            value = source()
        except LookupError as e:
            raise _NoValueYet(f"{type(e).__name__}: {e}") from e
        if value is None:
            raise _NoValueYet("it returned None")
        return value
    return source


class SummaryOp:
    """A summary "op": calling it reads its source now and returns a ``Summary`` proto.

    Summary ops are what TF 1 kept in the ``SUMMARIES`` collection and ran with ``sess.run``.
    Here the Supervisor's summary service calls ``op()`` on its own thread.

    Args:
        name: The op's name (the summary's tag for single summaries); ``get_collection(key,
            scope=...)`` filters on it.
        fn: A zero-argument callable returning a ``Summary``.

    A source with no value yet (a callable that raises ``KeyError``/``IndexError`` or
    returns None: a validation loss before the first validation) gives an empty ``Summary``,
    with one WARNING per op, instead of stopping training.

    Thread safety: calling an op from several threads is safe when its source may be read from
    several threads (a tensor's value read while the training thread updates it in place may
    mix old and new elements, as in TF).

    TF name: the string ``Tensor`` returned by ``tf.compat.v1.summary.*``.
    """

    __slots__ = ("__weakref__", "_fn", "_warned", "name")

    def __init__(self, name: str, fn: Callable[[], summary_pb2.Summary]) -> None:
        self.name = name
        self._fn = fn
        self._warned = False

    def __call__(self) -> summary_pb2.Summary:
        """Evaluate the op: read the source and return the encoded ``Summary`` (empty while
        the source has no value yet)."""
        try:
            return self._fn()
        except _NoValueYet as e:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "Summary %r skipped: its source has no value yet (%s); skipped quietly "
                    "from now on until it has one",
                    self.name,
                    e,
                )
            return summary_pb2.Summary()

    def __repr__(self) -> str:
        return f"SummaryOp(name={self.name!r})"


_INVALID_TAG_CHARACTERS = re.compile(r"[^A-Za-z0-9_.\-/]")


def _clean_tag(name: str) -> str:
    """Replace characters TF does not allow in tags by ``_`` and drop leading slashes."""
    if not isinstance(name, str):
        raise TypeError(f"summary name must be a str, got {type(name).__name__}")
    new_name = _INVALID_TAG_CHARACTERS.sub("_", name).lstrip("/")
    if new_name != name:
        logger.info("Summary name %s is illegal; using %s instead.", name, new_name)
    return new_name


def _summary_tag(name: str, family: str | None) -> str:
    tag = _clean_tag(name)
    if family is not None:
        tag = f"{_clean_tag(family)}/{tag}"
    return tag


def _collect(op: SummaryOp, collections: Iterable[str] | None, default: list[str]) -> None:
    keys = default if collections is None else collections
    registry.add_to_collections(keys, op)


def scalar(
    name: str,
    tensor: torch.Tensor,
    collections: Iterable[str] | None = None,
    family: str | None = None,
) -> SummaryOp:
    """Create an op that summarizes one real number.

    Args:
        name: The tag; characters outside ``[A-Za-z0-9_.-/]`` become ``_`` and leading ``/`` are
            dropped (logged at INFO).
        tensor: The source, read at each call of the op: a tensor (its current value; one
            element), a zero-argument callable returning a number or tensor, or a constant.
        collections: Collection keys of the default graph to add the op to; ``None`` means
            ``[GraphKeys.SUMMARIES]``, ``[]`` adds it nowhere.
        family: If given, the tag becomes ``"<family>/<name>"`` (TensorBoard groups by it).

    Returns:
        A ``SummaryOp`` whose call returns ``scalar_pb(tag, value)``.

    Raises:
        TypeError: ``name`` is not a string. Calling the op raises what ``scalar_pb`` raises.

    TF name: ``tf.compat.v1.summary.scalar``.
    """
    tag = _summary_tag(name, family)
    op = SummaryOp(tag, lambda: scalar_pb(tag, _read_source(tensor)))
    _collect(op, collections, [GraphKeys.SUMMARIES])
    return op


def histogram(
    name: str,
    values: object,
    collections: Iterable[str] | None = None,
    family: str | None = None,
) -> SummaryOp:
    """Create an op that summarizes the distribution of ``values`` (TF's default buckets).

    Args:
        name: The tag (cleaned as in ``scalar``).
        values: The source, read at each call: a tensor, a zero-argument callable, or a
            constant array of real numbers.
        collections: As in ``scalar``.
        family: As in ``scalar``.

    Returns:
        A ``SummaryOp`` whose call returns ``histogram_pb(tag, values)``.

    Raises:
        TypeError: ``name`` is not a string. Calling the op raises ``InvalidArgumentError`` on
            NaN or infinite values (see ``histogram_pb``).

    TF name: ``tf.compat.v1.summary.histogram``.
    """
    tag = _summary_tag(name, family)
    op = SummaryOp(tag, lambda: histogram_pb(tag, _read_source(values)))
    _collect(op, collections, [GraphKeys.SUMMARIES])
    return op


def image(
    name: str,
    tensor: torch.Tensor,
    max_outputs: int = 3,
    collections: Iterable[str] | None = None,
    family: str | None = None,
) -> SummaryOp:
    """Create an op that summarizes a batch of images (``[N, H, W, C]``, TF's scaling).

    Args:
        name: The base tag (cleaned as in ``scalar``); values are tagged ``"<tag>/image"`` or
            ``"<tag>/image/<i>"`` (see ``image_pb``).
        tensor: The source, read at each call: a tensor, a zero-argument callable, or a
            constant array.
        max_outputs: At most this many images per call; >= 1.
        collections: As in ``scalar``.
        family: As in ``scalar``.

    Returns:
        A ``SummaryOp`` whose call returns ``image_pb(tag, images, max_outputs)``.

    Raises:
        TypeError: ``name`` is not a string. Calling the op raises what ``image_pb`` raises.

    TF name: ``tf.compat.v1.summary.image``.
    """
    tag = _summary_tag(name, family)
    op = SummaryOp(tag, lambda: image_pb(tag, _read_source(tensor), max_outputs))
    _collect(op, collections, [GraphKeys.SUMMARIES])
    return op


def audio(
    name: str,
    tensor: torch.Tensor,
    sample_rate: Any,
    max_outputs: int = 3,
    collections: Iterable[str] | None = None,
    family: str | None = None,
) -> SummaryOp:
    """Create an op that summarizes a batch of clips as 16-bit WAV.

    Args:
        name: The base tag (cleaned as in ``scalar``); values are tagged ``"<tag>/audio"`` or
            ``"<tag>/audio/<i>"``.
        tensor: The source, read at each call: float samples ``[N, frames]`` or
            ``[N, frames, channels]`` in [-1, 1] (a tensor, a zero-argument callable, or a
            constant).
        sample_rate: Samples per second (> 0), or a tensor or callable read at each call.
        max_outputs: At most this many clips per call; >= 1.
        collections: As in ``scalar``.
        family: As in ``scalar``.

    Returns:
        A ``SummaryOp`` whose call returns ``audio_pb(tag, audio, sample_rate, max_outputs)``.

    Raises:
        TypeError: ``name`` is not a string. Calling the op raises what ``audio_pb`` raises.

    TF name: ``tf.compat.v1.summary.audio``.
    """
    tag = _summary_tag(name, family)
    op = SummaryOp(
        tag,
        lambda: audio_pb(tag, _read_source(tensor), _read_source(sample_rate), max_outputs),
    )
    _collect(op, collections, [GraphKeys.SUMMARIES])
    return op


def text(name: str, tensor: torch.Tensor, collections: Iterable[str] | None = None) -> SummaryOp:
    """Create an op that summarizes strings for TensorBoard's text plugin.

    Args:
        name: The tag (cleaned as in ``scalar``).
        tensor: The source, read at each call: a string, an array of strings, or a
            zero-argument callable returning one.
        collections: As in ``scalar``.

    Returns:
        A ``SummaryOp`` whose call returns ``text_pb(tag, text)``.

    Raises:
        TypeError: ``name`` is not a string. Calling the op raises what ``text_pb`` raises.

    TF name: ``tf.compat.v1.summary.text``.
    """
    tag = _clean_tag(name)
    op = SummaryOp(tag, lambda: text_pb(tag, _read_source(tensor)))
    _collect(op, collections, [GraphKeys.SUMMARIES])
    return op


def _as_summary(item: object) -> summary_pb2.Summary:
    if isinstance(item, summary_pb2.Summary):
        return item
    if isinstance(item, (bytes, bytearray, memoryview)):
        try:
            return summary_pb2.Summary.FromString(bytes(item))
        except DecodeError as e:
            raise errors.InvalidArgumentError("Could not parse one of the summary inputs") from e
    raise _not_a_summary_input(item)


def _not_a_summary_input(item: object) -> TypeError:
    return TypeError(
        "summary inputs must be SummaryOps, Summary protos or serialized Summary bytes, "
        f"got {type(item).__name__}"
    )


def merge(
    inputs: Iterable[Any], collections: Iterable[str] | None = None, name: str | None = None
) -> SummaryOp:
    """Create an op that concatenates the values of several summaries into one ``Summary``.

    Args:
        inputs: ``SummaryOp``s (or other zero-argument callables returning a summary), ``Summary``
            protos, or serialized ``Summary`` bytes. Ops are called at each call of the merged
            op, in order.
        collections: Collection keys to add the merged op to; ``None`` adds it nowhere (TF's
            default for ``merge``).
        name: The op's name; ``None`` means ``"Merge"``.

    Returns:
        A ``SummaryOp`` returning one ``Summary`` with all input values, in input order.

    Raises:
        TypeError: An input is none of the accepted kinds (raised here, not at call time).
        InvalidArgumentError: At call time, when two values share a non-empty tag
            (``"Duplicate tag <tag> found in summary inputs"``) or bytes do not parse
            (``"Could not parse one of the summary inputs"``).

    TF name: ``tf.compat.v1.summary.merge``.
    """
    items = list(inputs)
    for item in items:
        if not (
            callable(item) or isinstance(item, (summary_pb2.Summary, bytes, bytearray, memoryview))
        ):
            raise _not_a_summary_input(item)

    def run() -> summary_pb2.Summary:
        merged = summary_pb2.Summary()
        seen: set[str] = set()
        for item in items:
            part = _as_summary(item() if callable(item) else item)
            for value in part.value:
                if value.tag:
                    if value.tag in seen:
                        raise errors.InvalidArgumentError(
                            f"Duplicate tag {value.tag} found in summary inputs"
                        )
                    seen.add(value.tag)
            merged.value.extend(part.value)
        return merged

    op = SummaryOp("Merge" if name is None else name, run)
    _collect(op, collections, [])
    return op


def merge_all(
    key: str = GraphKeys.SUMMARIES, scope: str | None = None, name: str | None = None
) -> SummaryOp | None:
    """Merge every summary op of a collection of the default graph, as it is now.

    Args:
        key: The collection to read.
        scope: If given, keep only ops whose name matches this regular expression at its start.
        name: The merged op's name (``None`` means ``"Merge"``).

    Returns:
        A ``SummaryOp`` (not added to any collection), or ``None`` if no op was found.

    TF name: ``tf.compat.v1.summary.merge_all``.
    """
    ops = registry.get_collection(key, scope)
    if not ops:
        return None
    return merge(ops, name=name)


def zero_fraction(value: object, name: str | None = None) -> torch.Tensor:
    """Return the fraction of zeros in ``value``, computed now.

    For a tensor the count runs on its device without a host synchronisation.

    Args:
        value: A tensor (any device), a numpy array, or a (nested) list of numbers.
        name: Ignored (TF's op name).

    Returns:
        A 0-d float32 tensor on ``value``'s device (CPU for non-tensors); NaN when ``value``
        is empty.

    TF name: ``tf.math.zero_fraction``.
    """
    del name
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    t = t.detach()
    total = t.numel()
    if total == 0:
        return torch.tensor(float("nan"), dtype=torch.float32, device=t.device)
    nonzero = torch.count_nonzero(t).to(torch.float64)
    return (1.0 - nonzero / total).to(torch.float32)
