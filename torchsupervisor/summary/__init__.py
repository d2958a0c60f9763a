"""TensorBoard summaries: encoders, TF 1's summary ops, the background ``SummaryWriter``.

Layout (data flows down)::

    encoders/        values -> Summary protos (pure; TF's histogram, image, audio rules)
    ops.py           TF 1's summary ops: callables in the default graph's collections
    writer.py        SummaryWriter / FileWriter: argument checks, enqueue only
    null_writer.py   NullSummaryWriter: a non-chief's writer, which writes nothing
    snapshot.py      copies of enqueued values, no host/device synchronisation
    queue_items.py   queued items -> framed records (writer thread; metadata once per tag)
    scalar_batch.py  runs of scalar events encoded and framed at once with numpy
    scalar_event.py  hand-written wire encoding of one scalar Event (short runs)
    event_file.py    the thread owning one events file: bounded queue, batches, flushes
    records.py       TFRecord framing with masked CRC-32C
    restarts.py      at a restart: the lost segment removed from older files, the restart
                     recorded
    reader.py        summary_iterator
    writer_cache.py  one shared writer per log directory

TF names: ``tf.compat.v1.summary`` (``scalar``, ``histogram``, ``image``, ``audio``, ``text``,
``merge``, ``merge_all``, ``FileWriter``, ``FileWriterCache``), ``tf.compat.v1.train``'s
``summary_iterator`` and ``SummaryWriterCache``, and the ``Summary``, ``Event``, ``SessionLog``
and ``HistogramProto`` protos (the classes shipped with TensorBoard).
"""

from __future__ import annotations

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.histogram_pb2 import HistogramProto
from tensorboard.compat.proto.summary_pb2 import Summary

from torchsupervisor.summary.counters import WriterCounters
from torchsupervisor.summary.encoders import audio_pb, histogram_pb, image_pb, scalar_pb, text_pb
from torchsupervisor.summary.null_writer import NullSummaryWriter
from torchsupervisor.summary.ops import (
    SummaryOp,
    audio,
    histogram,
    image,
    merge,
    merge_all,
    scalar,
    text,
    zero_fraction,
)
from torchsupervisor.summary.reader import summary_iterator
from torchsupervisor.summary.writer import FileWriter, SummaryWriter
from torchsupervisor.summary.writer_cache import FileWriterCache, SummaryWriterCache

__all__ = [
    "Event",
    "FileWriter",
    "FileWriterCache",
    "HistogramProto",
    "NullSummaryWriter",
    "SessionLog",
    "Summary",
    "SummaryOp",
    "SummaryWriter",
    "SummaryWriterCache",
    "WriterCounters",
    "audio",
    "audio_pb",
    "histogram",
    "histogram_pb",
    "image",
    "image_pb",
    "merge",
    "merge_all",
    "scalar",
    "scalar_pb",
    "summary_iterator",
    "text",
    "text_pb",
    "zero_fraction",
]
