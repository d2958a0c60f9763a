"""Dtype codes: the safetensors name of each torch dtype, for files and for the wire.

Checkpoint manifests (``checkpoint/entries``) and replica messages (``distributed/replicas``)
name a tensor's dtype by its safetensors code (``torch.float32`` is ``"F32"``), so both live on
the core floor.
"""

from __future__ import annotations

import torch

from torchsupervisor.errors import ManifestError

__all__ = ["dtype_from_code", "dtype_to_code"]

_DTYPE_CODES: dict[torch.dtype, str] = {}
for _name, _code in [
    ("float64", "F64"),
    ("float32", "F32"),
    ("float16", "F16"),
    ("bfloat16", "BF16"),
    ("int64", "I64"),
    ("int32", "I32"),
    ("int16", "I16"),
    ("int8", "I8"),
    ("uint8", "U8"),
    ("bool", "BOOL"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("complex64", "C64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
]:
    if hasattr(torch, _name):
        _DTYPE_CODES[getattr(torch, _name)] = _code
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


def dtype_to_code(dtype: torch.dtype) -> str:
    """Return the safetensors code of ``dtype`` (``torch.float32`` -> ``"F32"``).

    Raises:
        ValueError: If safetensors has no code for ``dtype`` (e.g. ``complex128``).
    """
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in the safetensors format") from None


def dtype_from_code(code: str) -> torch.dtype:
    """Return the torch dtype of a safetensors code.

    Raises:
        ManifestError: For an unknown code.
    """
    try:
        return _CODE_DTYPES[code]
    except (KeyError, TypeError):
        raise ManifestError(f"unknown dtype code {code!r}") from None
