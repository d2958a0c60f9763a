"""Text summaries: strings as a ``DT_STRING`` tensor tagged for TensorBoard's text plugin."""

from __future__ import annotations

import numpy as np
import torch
from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.plugins.text import metadata as _text_metadata

from torchsupervisor import errors

__all__ = ["string_array", "text_pb"]


def string_array(tag: str, value: object) -> np.ndarray:
    """Return ``value`` as a numpy array of ``str``/``bytes`` (``value`` itself if it is one).

    Args:
        tag: The summary tag, named in error messages.
        value: A ``str``/``bytes``, or a (nested) list or numpy array of them.

    Raises:
        InvalidArgumentError: ``value`` is not a string or an array of strings.
    """
    if isinstance(value, (str, bytes)):
        return np.array(value, dtype=object)
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, torch.Tensor):
        raise errors.InvalidArgumentError(
            f"text summary '{tag}' expects strings, got a torch.Tensor of dtype {value.dtype}"
        )
    else:
        arr = np.array(value, dtype=object)
    if arr.dtype.kind in "US":
        return arr
    if arr.dtype.kind == "O" and all(isinstance(e, (str, bytes)) for e in arr.flat):
        return arr
    raise errors.InvalidArgumentError(
        f"text summary '{tag}' expects a string or an array of strings, got {type(value).__name__}"
        + (f" of dtype {arr.dtype}" if arr.dtype.kind != "O" else " with non-string items")
    )


def _text_metadata_proto() -> summary_pb2.SummaryMetadata:
    return _text_metadata.create_summary_metadata(display_name="", description="")


def text_pb(tag: str, text: object) -> summary_pb2.Summary:
    """Encode strings as a text summary readable by TensorBoard's text plugin.

    Args:
        tag: The summary tag (used as is).
        text: A ``str``/``bytes``, or a (nested) list or numpy array of them; ``str`` is
            encoded as UTF-8. Markdown is rendered by TensorBoard.

    Returns:
        A ``Summary`` with one value: a ``DT_STRING`` tensor of the input's shape, with summary
        metadata ``plugin_data.plugin_name == "text"``.

    Raises:
        InvalidArgumentError: ``text`` is not a string or an array of strings.

    TF name: ``tf.compat.v1.summary.text`` (the encoding it produces).
    """
    arr = string_array(tag, text)
    shape = tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=int(d)) for d in arr.shape]
    )
    strings = [e.encode("utf-8") if isinstance(e, str) else bytes(e) for e in arr.flat]
    tensor = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING, tensor_shape=shape, string_val=strings
    )
    summary = summary_pb2.Summary()
    summary.value.add(tag=tag, metadata=_text_metadata_proto(), tensor=tensor)
    return summary
