"""The tree codec: a state's skeleton as JSON data, and back.

``flatten_state`` (``state.py``) turns a state into a *skeleton*: nested containers (dicts,
lists, tuples) whose leaves are plain values or ``TensorRef`` s. ``encode_tree`` writes it as
JSON-compatible data (the ``tree`` of a checkpoint's manifest, the chief's broadcast to the
replicas); ``decode_tree`` reads it back, handing each tensor leaf to a callback, and refuses
anything that is not a valid encoding with ``ManifestError`` (never executing anything: no
pickle). ``check_tree_depth`` bounds the nesting before a recursive decode.

TF name: none (TF's checkpoints held variables only, no Python values).
"""

from __future__ import annotations

import base64
import math
from typing import Any

import torch

from torchsupervisor.core.state import MAX_STATE_DEPTH, TensorRef
from torchsupervisor.errors import ManifestError

__all__ = [
    "MAX_TREE_DEPTH",
    "as_dict",
    "as_list",
    "as_str",
    "check_tree_depth",
    "decode_tree",
    "encode_tree",
]

MAX_TREE_DEPTH = MAX_STATE_DEPTH + 1
"""The deepest nesting of containers (dicts, lists, tuples) a manifest's tree may have.

A real training state nests a few levels (``optimizer/state/0/exp_avg``); a manifest whose
tree nests deeper is damage (decoding it would exhaust the interpreter's stack).
``state.flatten_state`` refuses to save a state nested deeper than ``MAX_STATE_DEPTH`` below
its entries (the tree adds one level: the mapping of the entries), so that every checkpoint
written can be read back.
"""


def as_str(x: object) -> str:
    if not isinstance(x, str):
        raise ManifestError(f"expected a string, got {x!r}")
    return x


def _pair(item: object) -> list[Any]:
    return item if isinstance(item, list) else []


def as_list(x: object) -> list[Any]:
    if not isinstance(x, list):
        raise ManifestError(f"expected a list, got {type(x).__name__}")
    return x


def as_dict(x: object) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise ManifestError(f"expected an object, got {type(x).__name__}")
    return x


def check_tree_depth(tree: object) -> None:
    """Refuse a tree nested deeper than ``MAX_TREE_DEPTH`` containers (without recursing)."""
    pending = [(tree, 0)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, list):
            children = node
        elif isinstance(node, dict) and len(node) == 1:
            ((tag, value),) = node.items()
            if tag == "dict" and isinstance(value, dict):
                children = list(value.values())
            elif tag in ("tuple", "items") and isinstance(value, list):
                children = value if tag == "tuple" else [v for p in value for v in _pair(p)]
            else:
                continue
        else:
            continue
        if depth >= MAX_TREE_DEPTH:
            raise ManifestError(f"the state tree nests deeper than {MAX_TREE_DEPTH} levels")
        pending.extend((child, depth + 1) for child in children)


_FLOAT_TAGS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode_tree(node: object, *, depth: int = 0) -> Any:
    """Encode a skeleton (from ``state.flatten_state``) as JSON-compatible data.

    ``depth``: how many containers hold ``node`` in the whole skeleton (0: it is the
    skeleton), for the limit on nesting.

    Raises:
        TypeError: For a leaf type the format does not know.
        ValueError: For a skeleton nested deeper than ``MAX_TREE_DEPTH`` containers, which
            no reader would accept (the walks that make skeletons refuse such states first;
            this keeps a manifest that cannot be read from ever being committed).
    """
    return _encode(node, depth)


def _encode(node: object, depth: int) -> Any:
    if node is None or isinstance(node, (bool, int, str)):
        return node
    if isinstance(node, float):
        if math.isfinite(node):
            return node
        return {"float": "nan" if math.isnan(node) else ("inf" if node > 0 else "-inf")}
    if isinstance(node, TensorRef):
        return {"ndarray" if node.ndarray else "tensor": node.name}
    if isinstance(node, (dict, list, tuple)):
        if depth >= MAX_TREE_DEPTH:
            raise ValueError(f"the state tree nests deeper than {MAX_TREE_DEPTH} levels")
        depth += 1
        if isinstance(node, list):
            return [_encode(v, depth) for v in node]
        if isinstance(node, tuple):
            return {"tuple": [_encode(v, depth) for v in node]}
        if all(isinstance(k, str) for k in node):
            return {"dict": {k: _encode(v, depth) for k, v in node.items()}}
        return {"items": [[_encode_key(k), _encode(v, depth)] for k, v in node.items()]}
    if isinstance(node, bytes):
        return {"bytes": base64.b64encode(node).decode("ascii")}
    if isinstance(node, torch.dtype):
        return {"dtype": str(node).removeprefix("torch.")}
    if isinstance(node, torch.device):
        return {"device": str(node)}
    raise TypeError(f"cannot encode {type(node).__name__} in a manifest")


def _encode_key(key: object) -> Any:
    if isinstance(key, float) and not math.isfinite(key):
        return encode_tree(key)
    return key


def decode_tree(node: object, tensor: torch.Tensor) -> Any:
    """Rebuild the state tree from its JSON encoding.

    Args:
        node: The ``tree`` of a manifest.
        tensor: Called as ``tensor(name, ndarray)`` for each tensor leaf; its result takes the
            leaf's place (e.g. the restored tensor, or a numpy array when ``ndarray``).

    Raises:
        ManifestError: For anything that is not a valid encoding.
    """
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [decode_tree(v, tensor) for v in node]
    if not isinstance(node, dict) or len(node) != 1:
        raise ManifestError(f"bad tree node {node!r:.80}")
    ((tag, value),) = node.items()
    if tag == "tensor" or tag == "ndarray":
        return tensor(as_str(value), tag == "ndarray")
    if tag == "dict":
        return {k: decode_tree(v, tensor) for k, v in as_dict(value).items()}
    if tag == "items":
        out = {}
        for pair in as_list(value):
            if not isinstance(pair, list) or len(pair) != 2:
                raise ManifestError(f"bad dict item {pair!r:.80}")
            key = pair[0] if not isinstance(pair[0], dict) else decode_tree(pair[0], tensor)
            if isinstance(key, (list, dict)):
                raise ManifestError(f"bad dict key {key!r:.80}")
            out[key] = decode_tree(pair[1], tensor)
        return out
    if tag == "tuple":
        return tuple(decode_tree(v, tensor) for v in as_list(value))
    if tag == "float" and value in _FLOAT_TAGS:
        return _FLOAT_TAGS[value]
    if tag == "bytes":
        try:
            return base64.b64decode(as_str(value), validate=True)
        except ValueError:
            raise ManifestError("bad base64 bytes leaf") from None
    if tag == "dtype":
        dtype = getattr(torch, as_str(value), None)
        if not isinstance(dtype, torch.dtype):
            raise ManifestError(f"unknown dtype {value!r}")
        return dtype
    if tag == "device":
        try:
            return torch.device(as_str(value))
        except RuntimeError:
            raise ManifestError(f"bad device {value!r}") from None
    raise ManifestError(f"unknown tree tag {tag!r}")
