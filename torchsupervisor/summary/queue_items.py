"""What a ``SummaryWriter`` queues, and how its writer thread turns items into framed records.

Items are built on the caller's thread by ``writer.py`` with values copied by ``snapshot.py``;
``step`` is an int (0 when none was given: the proto omits step 0 anyway) or a ``DeviceCopy``:

* a scalar is a plain ``tuple`` ``(wall_time, step, tag, value)``, ``value`` a float or a
  ``DeviceCopy`` (no proto, no kind field: ``add_scalar`` is the hot path);
* anything else is an ``Item`` (a ``tuple`` subclass, so ``type(item) is tuple`` tells the two
  apart): ``Item((SUMMARY_EVENT or RAW_EVENT, event, step))`` with a private ``Event`` copy, or
  ``Item((HISTOGRAM, IMAGE, AUDIO or TEXT, wall_time, step, tag, value, extra))``, ``extra``
  being the histogram bins, the image dataformats, the sample rate, or None for text.

On the writer thread, ``ItemEncoder`` resolves the snapshots, encodes the values
(``encoders/``), serializes the ``Event``s and frames them as TFRecords. Runs of scalars are
encoded together by ``scalar_batch.py`` (long runs) or one by one by ``scalar_event.py``. It
also applies TF's metadata rule: only the first value of a tag written by a ``SummaryWriter``
keeps its summary metadata (TensorBoard reads the plugin of a tag from its first occurrence).

TF name: the summary-to-event step of ``tf.compat.v1.summary.FileWriter``
(``SummaryToEventTransformer``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensorboard.compat.proto import event_pb2, summary_pb2

from torchsupervisor.summary import records
from torchsupervisor.summary.encoders.audio import torch_audio_pb
from torchsupervisor.summary.encoders.histogram import torch_histogram_pb
from torchsupervisor.summary.encoders.image import torch_image_pb
from torchsupervisor.summary.encoders.scalar import scalar_value
from torchsupervisor.summary.encoders.text import text_pb
from torchsupervisor.summary.scalar_batch import ScalarBatchEncoder
from torchsupervisor.summary.scalar_event import scalar_event_bytes
from torchsupervisor.summary.snapshot import DeviceCopy, resolve, resolve_step

__all__ = [
    "AUDIO",
    "HISTOGRAM",
    "IMAGE",
    "RAW_EVENT",
    "SUMMARY_EVENT",
    "TEXT",
    "VECTORIZE_MIN_RUN",
    "Item",
    "ItemEncoder",
    "queued_bytes",
]

logger = logging.getLogger("torchsupervisor")

# Kinds of ``Item`` (its first element).
SUMMARY_EVENT = 1
RAW_EVENT = 2
HISTOGRAM = 3
IMAGE = 4
AUDIO = 5
TEXT = 6

VECTORIZE_MIN_RUN = 64
"""Runs of at least this many scalars are encoded by ``ScalarBatchEncoder`` (measured: below,
its fixed cost of some 70 us outweighs the per-record savings)."""

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


class Item(tuple):
    """A queued item other than a scalar (a ``tuple`` subclass; see the module docstring)."""

    __slots__ = ()


def _value_bytes(value: object) -> int:
    if type(value) is DeviceCopy:
        value = value.tensor
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, (list, tuple)):
        return 8 * len(value)
    return 0


def queued_bytes(item: object) -> int:
    """Return the memory a queued item holds (0 for a scalar): what ``max_queue_bytes`` counts.

    An event's serialized size, or the bytes of the tensor or array copy of a histogram, image,
    audio clip or text (device memory for a tensor left on its device).
    """
    if type(item) is not Item:
        return 0  # a scalar (or a queue marker)
    kind = item[0]
    if kind in (SUMMARY_EVENT, RAW_EVENT):
        return item[1].ByteSize()
    return _value_bytes(item[4])


class ItemEncoder:
    """Encode batches of queued items into framed records, for one writer thread.

    Args:
        logdir: The log directory, named in log messages.
        seen_tags: The tags whose metadata this ``SummaryWriter`` has written; shared by the
            encoders of its successive files, updated here.

    Attributes:
        errors: Items dropped because they could not be encoded (each one logged).

    Thread safety: used by one writer thread only.
    """

    def __init__(self, logdir: str, seen_tags: set[str]) -> None:
        self.logdir = logdir
        self.seen_tags = seen_tags
        self.errors = 0
        self._scalar_heads: dict[str, bytes] = {}
        self._scalar_batch = ScalarBatchEncoder()
        self._batch_new_tags: list[str] = []

    @staticmethod
    def queued_bytes(item: object) -> int:
        """Return the memory an item holds while queued: its tensor or array copy, its proto.

        0 for scalars (their bound is ``max_queue``).
        """
        return queued_bytes(item)

    def encode_batch(self, batch: Sequence[Any]) -> tuple[list[Any], int]:
        """Return the framed records of ``batch`` (bytes-like chunks, in order) and their count.

        An item that cannot be encoded (e.g. a NaN in a histogram) is logged at ERROR, counted
        in ``errors`` and dropped; the others are still returned.
        """
        self._batch_new_tags = []
        chunks: list[Any] = []
        count = 0
        start = 0
        for index in [i for i, item in enumerate(batch) if type(item) is not tuple]:
            if index > start:
                count += self._encode_scalars(batch[start:index], chunks)
            start = index + 1
            try:
                payload = self._encode_item(batch[index])
            except Exception as e:
                self._dropped(batch[index], e)
                continue
            chunks.append(records.encode_record(payload))
            count += 1
        if start < len(batch):
            count += self._encode_scalars(batch[start:] if start else batch, chunks)
        return chunks, count

    def forget_batch(self) -> None:
        """Let the next occurrence of the tags first seen in the last batch carry metadata.

        Called when that batch was lost (its file could not be created or written).
        """
        self.seen_tags.difference_update(self._batch_new_tags)
        self._batch_new_tags = []

    def _dropped(self, item: object, error: Exception) -> None:
        self.errors += 1
        if type(item) is tuple:
            tag = item[2]
        else:
            tag = item[3] if len(item) > 3 else "<event>"
        logger.error(
            "Dropping summary %r for the events file in %s: could not encode it: %s",
            tag,
            self.logdir,
            error,
        )

    # -- scalars -----------------------------------------------------------------------------

    def _encode_scalars(self, run: Sequence[tuple[Any, ...]], chunks: list[Any]) -> int:
        if len(run) >= VECTORIZE_MIN_RUN:
            walls = [item[0] for item in run]
            steps = [item[1] for item in run]
            tags = [item[2] for item in run]
            values = [item[3] for item in run]
            try:
                chunks.append(self._scalar_batch.encode(walls, steps, tags, values))
                return len(run)
            except (TypeError, OverflowError, ValueError):
                pass  # Snapshots to resolve, or a bad step: item by item below.
            run = self._resolved(run)
            if len(run) >= VECTORIZE_MIN_RUN:
                columns = [[item[k] for item in run] for k in range(4)]
                chunks.append(self._scalar_batch.encode(*columns))
                return len(run)
        encode_record = records.encode_record
        heads = self._scalar_heads
        count = 0
        for item in run:
            wall, step, tag, value = item
            if type(value) is not float or type(step) is not int:
                resolved = self._resolved((item,))
                if not resolved:
                    continue
                wall, step, tag, value = resolved[0]
            elif not _INT64_MIN <= step <= _INT64_MAX:
                self._dropped(item, OverflowError(f"step {step} is outside the int64 range"))
                continue
            chunks.append(encode_record(scalar_event_bytes(wall, step, tag, value, heads)))
            count += 1
        return count

    def _resolved(self, run: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """Return the items with their snapshots read back; bad items are logged and dropped."""
        out = []
        for item in run:
            wall, step, tag, value = item
            try:
                if type(value) is DeviceCopy:
                    value = scalar_value(tag, value.get())
                step = resolve_step(step)
                if not _INT64_MIN <= step <= _INT64_MAX:
                    raise OverflowError(f"step {step} is outside the int64 range")
            except Exception as e:
                self._dropped(item, e)
                continue
            out.append((float(wall), step, tag, float(value)))
        return out

    # -- everything else ---------------------------------------------------------------------

    def _encode_item(self, item: Item) -> bytes:
        kind = item[0]
        if kind in (SUMMARY_EVENT, RAW_EVENT):
            _, event, step = item
            step = resolve_step(step)
            if step:
                event.step = step
            if kind == SUMMARY_EVENT:
                self._strip_seen_metadata(event.summary)
            return event.SerializeToString()
        _, wall_time, step, tag, value, extra = item
        if kind == HISTOGRAM:
            summary = torch_histogram_pb(tag, resolve(value), extra)
        elif kind == IMAGE:
            summary = torch_image_pb(tag, resolve(value), extra)
        elif kind == AUDIO:
            summary = torch_audio_pb(tag, resolve(value), extra)
        else:
            summary = text_pb(tag, value)
        self._strip_seen_metadata(summary)
        event = event_pb2.Event(wall_time=wall_time, summary=summary)
        step = resolve_step(step)
        if step:
            event.step = step
        return event.SerializeToString()

    def _strip_seen_metadata(self, summary: summary_pb2.Summary) -> None:
        for value in summary.value:
            if value.HasField("metadata"):
                if value.tag in self.seen_tags:
                    value.ClearField("metadata")
                else:
                    self.seen_tags.add(value.tag)
                    self._batch_new_tags.append(value.tag)
