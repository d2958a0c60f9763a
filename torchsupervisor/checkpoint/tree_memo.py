"""A skeleton's encoding and JSON texts, taken from the last save's where the walk gave the
very same containers.

At every save the writer (one process's, or the coordinator of a sharded save) encodes the
state's skeleton for the manifest (``tree.encode_tree``), then ``json`` writes the encoding
twice: on the file's readable line and in the canonical form the manifest's checksum covers.
For a state of 1,000 tensors that is about 2 ms of the writer thread a save, holding the GIL
beside training. Between two saves
the walk hands over most of the skeleton as the very same containers (``walk.WalkMemo`` takes
a mapping whose objects did not change as it was, its skeleton mapping included), and no
container of a skeleton is ever changed once the walk made it. ``TreeMemo`` therefore keeps
each container's encoding and texts by identity, for the next save to take while it meets the
very same container at the same depth. A container's texts are its children's joined as
``manifest_json``'s two encoders join them; strings go through their ``json_string``, every
other leaf through the encoders themselves.
"""

from __future__ import annotations

from typing import Any

from torchsupervisor.checkpoint.manifest_json import (
    CANONICAL_ENCODER,
    ITEM_ENCODER,
    EncodedItem,
    json_string,
)
from torchsupervisor.core.state import TensorRef
from torchsupervisor.core.tree import MAX_TREE_DEPTH, encode_tree

__all__ = ["TreeMemo"]

_CONTAINERS = (dict, list, tuple)


def _dumped(value: object) -> tuple[str, str]:
    """The texts of ``value`` (JSON data) as the manifest's two encoders write it."""
    return ITEM_ENCODER.encode(value), CANONICAL_ENCODER.encode(value)


def _join(items: list[tuple[str, str]]) -> tuple[str, str]:
    return (
        "[" + ", ".join([t for t, _ in items]) + "]",
        "[" + ",".join([c for _, c in items]) + "]",
    )


def _join_pairs(pairs: list[tuple[str, tuple[str, str]]]) -> tuple[str, str]:
    text = "{" + ", ".join([f"{json_string(k)}: {t}" for k, (t, _) in pairs]) + "}"
    ordered = sorted(pairs, key=lambda pair: pair[0])
    canonical = "{" + ",".join([f"{json_string(k)}:{c}" for k, (_, c) in ordered]) + "}"
    return text, canonical


class TreeMemo:
    """The encoding (``encode_tree``) and JSON texts of each container of the last skeleton
    encoded, by identity, for the next skeleton to take where it holds the very same one.

    Only for skeletons whose containers are never changed once made (``walk.walk_state``'s).
    Holds the containers of the last skeleton encoded (so their ids stay theirs) and their
    encodings until the next ``encode``, which keeps only what it met.

    Thread safety: one ``encode`` at a time (the writer thread).
    """

    def __init__(self) -> None:
        self._last: dict[int, tuple[Any, int, Any, str, str]] = {}
        self.taken = 0  # Containers taken again by the last ``encode`` (for tests).

    def encode(self, skeleton: Any) -> tuple[Any, EncodedItem]:
        """``encode_tree(skeleton)`` and its JSON texts (readable, canonical).

        Raises:
            As ``encode_tree``.
        """
        met: dict[int, tuple[Any, int, Any, str, str]] = {}
        last = self._last
        taken = 0

        def visit(node: object, depth: int) -> tuple[Any, str, str]:
            nonlocal taken
            kind = type(node)
            if kind is str:
                text = json_string(node)
                return node, text, text
            if kind is TensorRef:
                name = json_string(node.name)
                tag = '"ndarray"' if node.ndarray else '"tensor"'
                encoded = {tag[1:-1]: node.name}
                return encoded, "{" + tag + ": " + name + "}", "{" + tag + ":" + name + "}"
            if kind not in _CONTAINERS:
                encoded = encode_tree(node, depth=depth)
                return (encoded, *_dumped(encoded))
            known = last.get(id(node))
            if known is not None and known[0] is node and known[1] == depth:
                met[id(node)] = known
                taken += 1
                return known[2], known[3], known[4]
            if depth >= MAX_TREE_DEPTH:
                raise ValueError(f"the state tree nests deeper than {MAX_TREE_DEPTH} levels")
            if kind is dict and all(type(k) is str for k in node):
                children = {k: visit(v, depth + 1) for k, v in node.items()}
                inner = _join_pairs([(k, (t, c)) for k, (_, t, c) in children.items()])
                encoded = {"dict": {k: e for k, (e, _, _) in children.items()}}
                texts = _tagged("dict", inner)
            elif kind is dict:
                encoded = encode_tree(node, depth=depth)  # Other keys: as the codec writes them.
                texts = _dumped(encoded)
            else:
                items = [visit(v, depth + 1) for v in node]
                values = [e for e, _, _ in items]
                inner = _join([(t, c) for _, t, c in items])
                if kind is list:
                    encoded, texts = values, inner
                else:
                    encoded, texts = {"tuple": values}, _tagged("tuple", inner)
            met[id(node)] = (node, depth, encoded, *texts)
            return (encoded, *texts)

        try:
            encoded, text, canonical = visit(skeleton, 0)
        finally:
            visit = None  # type: ignore[assignment]  # It calls itself: a reference cycle.
        self._last, self.taken = met, taken
        return encoded, EncodedItem(text, canonical)


def _tagged(tag: str, inner: tuple[str, str]) -> tuple[str, str]:
    """The texts of ``{tag: value}`` given the texts of ``value``."""
    key = json_string(tag)
    return "{" + key + ": " + inner[0] + "}", "{" + key + ":" + inner[1] + "}"
