"""The records of a TF 1 tensor bundle: its protobuf messages, its dtypes, its slice keys.

* ``BundleHeaderProto`` / ``BundleEntryProto``: the fields of TF's ``tensor_bundle.proto``
  (and of ``tensor_shape.proto``, ``tensor_slice.proto``, ``versions.proto``) this reader
  uses, described field by field in a private protobuf pool: never clashing with a
  TensorFlow installation's own classes; enums read as their numbers.
* ``TF_DTYPES``: TF's ``DataType`` numbers and the torch dtype of the same bytes.
* ``slice_key``: the table key of a slice of a partitioned variable (TF's
  ``checkpoint::EncodeTensorNameSlice``: numbers and strings in TF's ordered code).

TF name: ``tensorflow/core/protobuf/tensor_bundle.proto``, ``lib/strings/ordered_code``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = ["TF_DTYPES", "BundleEntryProto", "BundleHeaderProto", "slice_key"]

# TF's DataType numbers (types.proto) -> the torch dtype holding the same bytes, TF's name.
TF_DTYPES: dict[int, tuple[torch.dtype | None, str]] = {
    1: (torch.float32, "float32"),
    2: (torch.float64, "float64"),
    3: (torch.int32, "int32"),
    4: (torch.uint8, "uint8"),
    5: (torch.int16, "int16"),
    6: (torch.int8, "int8"),
    7: (None, "string"),
    8: (torch.complex64, "complex64"),
    9: (torch.int64, "int64"),
    10: (torch.bool, "bool"),
    11: (torch.int8, "qint8"),
    12: (torch.uint8, "quint8"),
    13: (torch.int32, "qint32"),
    14: (torch.bfloat16, "bfloat16"),
    15: (torch.int16, "qint16"),
    16: (torch.uint16, "quint16"),
    17: (torch.uint16, "uint16"),
    18: (torch.complex128, "complex128"),
    19: (torch.float16, "float16"),
    20: (None, "resource"),
    21: (None, "variant"),
    22: (torch.uint32, "uint32"),
    23: (torch.uint64, "uint64"),
    24: (torch.float8_e5m2, "float8_e5m2"),
    25: (torch.float8_e4m3fn, "float8_e4m3fn"),
}
"""TF's ``DataType`` numbers: the torch dtype of the same bytes (None: not numeric) and the
TF name."""


def _build_messages() -> dict[str, Any]:
    # tensor_bundle.proto, tensor_shape.proto, tensor_slice.proto and versions.proto, the
    # fields this reader uses, described field by field in a private pool (never clashing
    # with a TensorFlow installation's own classes). Enums are read as their varint numbers.
    fdp = descriptor_pb2.FieldDescriptorProto
    opt, rep = fdp.LABEL_OPTIONAL, fdp.LABEL_REPEATED
    file_proto = descriptor_pb2.FileDescriptorProto(
        name="torchsupervisor/tf_bundle.proto", package="tensorflow", syntax="proto3"
    )

    def message(name: str, fields: Iterable[tuple], parent: Any = None) -> Any:
        msg = (parent.nested_type if parent else file_proto.message_type).add(name=name)
        for fname, number, ftype, label, *type_name in fields:
            field = msg.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                field.type_name = type_name[0]
        return msg

    shape = message("TensorShapeProto", [
        ("dim", 2, fdp.TYPE_MESSAGE, rep, ".tensorflow.TensorShapeProto.Dim"),
        ("unknown_rank", 3, fdp.TYPE_BOOL, opt),
    ])  # fmt: skip
    message("Dim", [("size", 1, fdp.TYPE_INT64, opt), ("name", 2, fdp.TYPE_STRING, opt)], shape)
    tensor_slice = message("TensorSliceProto", [
        ("extent", 1, fdp.TYPE_MESSAGE, rep, ".tensorflow.TensorSliceProto.Extent"),
    ])  # fmt: skip
    extent = message("Extent", [
        ("start", 1, fdp.TYPE_INT64, opt), ("length", 2, fdp.TYPE_INT64, opt),
    ], tensor_slice)  # fmt: skip
    extent.oneof_decl.add(name="has_length")
    extent.field[1].oneof_index = 0
    message("VersionDef", [
        ("producer", 1, fdp.TYPE_INT32, opt), ("min_consumer", 2, fdp.TYPE_INT32, opt),
        ("bad_consumers", 3, fdp.TYPE_INT32, rep),
    ])  # fmt: skip
    message("BundleHeaderProto", [
        ("num_shards", 1, fdp.TYPE_INT32, opt), ("endianness", 2, fdp.TYPE_INT32, opt),
        ("version", 3, fdp.TYPE_MESSAGE, opt, ".tensorflow.VersionDef"),
    ])  # fmt: skip
    message("BundleEntryProto", [
        ("dtype", 1, fdp.TYPE_INT32, opt),
        ("shape", 2, fdp.TYPE_MESSAGE, opt, ".tensorflow.TensorShapeProto"),
        ("shard_id", 3, fdp.TYPE_INT32, opt), ("offset", 4, fdp.TYPE_INT64, opt),
        ("size", 5, fdp.TYPE_INT64, opt), ("crc32c", 6, fdp.TYPE_FIXED32, opt),
        ("slices", 7, fdp.TYPE_MESSAGE, rep, ".tensorflow.TensorSliceProto"),
    ])  # fmt: skip
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_proto)
    get_class = getattr(message_factory, "GetMessageClass", None)
    classes = {}
    for name in ("BundleHeaderProto", "BundleEntryProto"):
        descriptor = pool.FindMessageTypeByName(f"tensorflow.{name}")
        classes[name] = (
            get_class(descriptor)
            if get_class is not None
            else message_factory.MessageFactory(pool).GetPrototype(descriptor)  # protobuf < 4.22
        )
    return classes


_MESSAGES = _build_messages()
BundleHeaderProto = _MESSAGES["BundleHeaderProto"]
BundleEntryProto = _MESSAGES["BundleEntryProto"]

# -- TF's ordered code (lib/strings/ordered_code), to name a slice's entry.

_SIGNED_HEADER = ((0, 0), (0x80, 0), (0xC0, 0), (0xE0, 0), (0xF0, 0), (0xF8, 0), (0xFC, 0),
                  (0xFE, 0), (0xFF, 0), (0xFF, 0x80), (0xFF, 0xC0))  # fmt: skip
_ESCAPES = re.compile(rb"[\x00\xff]")


def _num_increasing(n: int) -> bytes:
    data = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([len(data)]) + data


def _string_increasing(s: bytes) -> bytes:
    escaped = _ESCAPES.sub(lambda m: b"\x00\xff" if m.group() == b"\x00" else b"\xff\x00", s)
    return escaped + b"\x00\x01"


def _signed_increasing(n: int) -> bytes:
    x = ~n if n < 0 else n
    if x < 64:
        return bytes([(0x80 ^ n) & 0xFF])
    length = x.bit_length() // 7 + 1  # 2..10 bytes: 7 bits of magnitude per byte.
    data = bytearray(n.to_bytes(10, "big", signed=True)[10 - length :])
    data[0] ^= _SIGNED_HEADER[length][0]
    data[1] ^= _SIGNED_HEADER[length][1]
    return bytes(data)


def slice_key(name: str, extents: Iterable[tuple[int, int]]) -> bytes:
    """The table key of a slice of tensor ``name``: ``(start, length)`` per dimension, a
    length of -1 for a whole dimension (TF's ``checkpoint::EncodeTensorNameSlice``)."""
    extents = list(extents)
    key = _num_increasing(0) + _string_increasing(name.encode()) + _num_increasing(len(extents))
    for start, length in extents:
        key += _signed_increasing(start) + _signed_increasing(length)
    return key
