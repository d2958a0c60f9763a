"""The JSON text of a manifest (``P.index``): its readable layout and its canonical form.

The file is written for people to read and diff: one line per top-level field and per item of
the long fields (``tensors``, ``shards``), ``json``'s default separators. Its checksum covers
the canonical form instead (keys sorted, no spaces), which any JSON parser's result gives back
whatever the layout, so a reader checks it without caring how the text was laid out.

A manifest of 1,000 tensors has some 2,500 items; encoding each with ``json`` twice, once per
form, cost the writer 10 ms a save. Items can therefore come already encoded in both forms
(``EncodedItem``), written by the manifest's own f-strings, which give exactly ``json``'s text,
and a whole field can come encoded (``EncodedMapping``: a table of tensors whose texts are
kept from the last save).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CANONICAL_ENCODER",
    "ITEM_ENCODER",
    "EncodedItem",
    "EncodedMapping",
    "canonical",
    "json_int",
    "json_ints",
    "json_string",
    "pretty_json",
]


# One encoder each, made once: ``json.dumps`` with any non-default option builds a new
# encoder at every call (10 us), and a manifest of 1,000 tensors dumps 2,000 items.
ITEM_ENCODER = json.JSONEncoder(allow_nan=False)
CANONICAL_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)


class EncodedItem:
    """One item of a manifest's expanded fields, already encoded as JSON.

    Not a tuple, so that ``json`` refuses one found anywhere else (``TypeError``) instead of
    writing it as a list.

    Attributes:
        text: As the readable text writes it (``json``'s default separators, fields in the
            manifest's order).
        canonical: As the checksum covers it (keys sorted, no spaces: ``CANONICAL_ENCODER``).
    """

    __slots__ = ("canonical", "text")

    def __init__(self, text: str, canonical: str) -> None:
        self.text, self.canonical = text, canonical


class EncodedMapping:
    """A whole non-empty mapping field of a manifest (``tensors``), already encoded as JSON.

    Attributes:
        text: Its items as ``pretty_json`` lays them out (one per line, in the mapping's
            order, joined by ``",\n"``), without the braces.
        canonical: The whole mapping as ``canonical`` writes it (keys sorted), braces included.
    """

    __slots__ = ("canonical", "text")

    def __init__(self, text: str, canonical: str) -> None:
        self.text, self.canonical = text, canonical


def json_int(value: int | None) -> str:
    """An integer field as ``json`` writes it (``null`` for None); a float or a string is
    refused (``ValueError``) rather than written as something else."""
    return "null" if value is None else f"{value:d}"


def json_ints(values: tuple[int, ...], sep: str) -> str:
    """Integers as ``json`` writes the items of a list, joined by ``sep``."""
    return sep.join([f"{v:d}" for v in values])


json_string = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]
"""A ``str`` as JSON, as both of the manifest's encoders write it (``ensure_ascii``): quotes
included, every character outside printable ASCII escaped."""


def pretty_json(body: Mapping[str, Any], expanded: tuple[str, ...] = ("shards", "tensors")) -> str:
    """One line per top-level field and per item of the ``expanded`` fields; the tree on one
    line (a manifest a person can read and diff). A field's value, or an item of an expanded
    field, may be an ``EncodedItem`` (the tree's texts, say)."""

    dump = ITEM_ENCODER.encode

    def item(v: object) -> str:
        return v.text if isinstance(v, EncodedItem) else dump(v)

    lines = []
    for key, value in body.items():
        if isinstance(value, EncodedMapping):
            lines.append(f" {dump(key)}: {{\n" + value.text + "\n }")
        elif key in expanded and value:
            if isinstance(value, dict):
                items = [f"  {json_string(k)}: {item(v)}" for k, v in value.items()]
                lines.append(f" {dump(key)}: {{\n" + ",\n".join(items) + "\n }")
            else:
                items = [f"  {item(v)}" for v in value]
                lines.append(f" {dump(key)}: [\n" + ",\n".join(items) + "\n ]")
        else:
            lines.append(f" {dump(key)}: {item(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def canonical(body: Mapping[str, Any]) -> bytes:
    """``body`` (string keys) as ``CANONICAL_ENCODER`` writes it, its ``EncodedItem``s (a
    field's value, or in the values of its fields, one level down) by their canonical text."""
    dump = CANONICAL_ENCODER.encode

    def item(v: object) -> str:
        return v.canonical if isinstance(v, EncodedItem) else dump(v)

    fields = []
    for key in sorted(body):
        value = body[key]
        if isinstance(value, (EncodedMapping, EncodedItem)):
            fields.append(f"{json_string(key)}:{value.canonical}")
            continue
        items = value.values() if isinstance(value, dict) else value
        if not isinstance(value, (dict, list, tuple)) or not any(
            isinstance(v, EncodedItem) for v in items
        ):
            text = dump(value)
        elif isinstance(value, dict):
            pairs = [f"{json_string(k)}:{item(value[k])}" for k in sorted(value)]
            text = "{" + ",".join(pairs) + "}"
        else:
            text = "[" + ",".join([item(v) for v in value]) + "]"
        fields.append(f"{json_string(key)}:{text}")
    return ("{" + ",".join(fields) + "}").encode()
