"""The global random number generators as one stateful object, so they can be checkpointed.

An exact continuation after a restart needs the random streams to continue where they were:
dropout masks, random crops, noise. ``RNGState`` captures Python's ``random``, NumPy's global
generator, torch's CPU generator and the generator of every CUDA device, and restores them.
The Supervisor puts one in the state by default (``save_rng_state=False`` to opt out).

With replicas, every rank must draw its own numbers (else every rank applies the same dropout
mask to its part of the batch). A state records the rank that took it: that rank loads it as
it is (the chief from a shared checkpoint, every rank of a sharded run from its own memory-tier
snapshot). A state may also carry other ranks' states under ``"replicas"`` (the chief's
checkpoints of a replicated run: ``distributed/replica_streams``): rank ``r`` continues the one
it took. Any other rank ``r`` loads fresh generators seeded from a hash of the saved torch state
and ``r`` (``rank_rng_state``). Every rank's stream is therefore a deterministic function of
the checkpoint (or of the chief's state at the start) and of its rank.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import random
import struct
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torchsupervisor.core.checks import check_int

__all__ = [
    "REPLICAS",
    "RNGState",
    "decode_rng_state",
    "encode_rng_state",
    "rank_rng_state",
    "rank_seed",
    "rng_record_rank",
]

logger = logging.getLogger("torchsupervisor")

REPLICAS = "replicas"
"""The key of other ranks' states in a state dict: by rank as a string (``"1"``), each the
Base64 text of its ``encode_rng_state`` record (a plain value of the checkpoint's tree, which
every rank of a sharded restore reads whole)."""


def _replicas() -> bool:
    """True in a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _process_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _as_bytes(value: object, dtype: Any) -> bytes:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(value, dtype=dtype)).tobytes()


def rank_seed(state_dict: dict[str, Any], rank: int) -> int:
    """Return the 64-bit seed of rank ``rank``'s generators, derived from ``state_dict``.

    The seed is the first 8 bytes of the SHA-256 of ``rank`` and of the torch CPU generator's
    state: the same on every machine and in every process (no ``hash()``). Python's and
    NumPy's global generators are left out: unless the program seeds them they start from the
    OS's entropy, and two runs of one program would then give a rank other streams; torch's
    starts from a fixed seed, or the program's ``torch.manual_seed``.

    Args:
        state_dict: ``RNGState.state_dict()`` output (as saved or broadcast).
        rank: The rank.

    Returns:
        An integer in ``[0, 2**63)``.

    Raises:
        KeyError, TypeError, ValueError: If the dict is not in ``RNGState``'s format.

    TF name: none.
    """
    digest = hashlib.sha256(b"torchsupervisor.rng/rank/%d/" % int(rank))
    digest.update(_as_bytes(state_dict["torch"], np.uint8))
    return int.from_bytes(digest.digest()[:8], "little") & (2**63 - 1)


def rank_rng_state(state_dict: dict[str, Any], rank: int) -> dict[str, Any]:
    """Return the generator states that rank ``rank`` loads from ``state_dict``.

    The rank that took the state (its ``"rank"``; 0 in a state without one, as earlier
    versions saved) continues the saved streams: ``state_dict`` itself is returned. A rank
    whose own state the dict carries under ``"replicas"`` (``REPLICAS``) continues that one.
    Any other rank gets fresh generators seeded with ``rank_seed(state_dict, rank)``: Python's
    ``random.Random(seed)``, NumPy's ``RandomState`` seeded with the seed's two 32-bit words,
    torch's CPU generator ``manual_seed(seed)`` and, where CUDA is available, one CUDA
    generator per saved CUDA state, ``manual_seed(seed + 1 + i)``.

    Args:
        state_dict: ``RNGState.state_dict()`` output (as saved or broadcast).
        rank: The rank that loads it.

    Returns:
        A dict in ``RNGState``'s format; ``state_dict`` unchanged for the rank that took it.

    Raises:
        KeyError, TypeError, ValueError: If the dict is not in ``RNGState``'s format.

    TF name: none.
    """
    if rank == int(state_dict.get("rank", 0)):
        return state_dict
    own = _replica_state(state_dict, rank)
    if own is not None:
        return own
    seed = rank_seed(state_dict, rank)
    words = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32)
    cuda = []
    if state_dict.get("cuda") and torch.cuda.is_available():
        for i, _ in enumerate(state_dict["cuda"]):
            generator = torch.Generator(device="cuda")
            generator.manual_seed(seed + 1 + i)
            cuda.append(generator.get_state())
    return _state_dict(
        random.Random(seed).getstate(),
        np.random.RandomState(words).get_state(),
        torch.Generator().manual_seed(seed).get_state(),
        cuda,
    )


def _replica_state(state_dict: Mapping[str, Any], rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s own state carried under ``REPLICAS``, or None (none, or a record that
    cannot be read or is of another rank: told, and that rank derives)."""
    replicas = state_dict.get(REPLICAS)
    text = replicas.get(str(rank)) if isinstance(replicas, Mapping) else None
    if text is None:
        return None
    try:
        own = decode_rng_state(base64.b64decode(str(text), validate=True))
        if own["rank"] != rank:
            raise ValueError(f"it is rank {own['rank']}'s")
    except (ValueError, binascii.Error) as e:
        logger.warning(
            "Rank %d's random streams in the checkpoint cannot be used (%s): it derives new ones",
            rank,
            e,
        )
        return None
    return own


def _state_dict(python: tuple, numpy: tuple, cpu: torch.Tensor, cuda: list) -> dict[str, Any]:
    """``RNGState``'s format from ``random``'s, NumPy's legacy and torch's generator states."""
    version, internal, gauss = python
    kind, keys, pos, has_gauss, cached = numpy
    return {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": cpu,
        "cuda": cuda,
    }


_RECORD = struct.Struct("<4sqqqdqqdIIII")
_MAGIC = b"TSR1"
_MT19937 = "MT19937"


def encode_rng_state(state_dict: Mapping[str, Any]) -> bytes:
    """Encode a state in ``RNGState``'s format as bytes (no pickle), for another process.

    The layout (little-endian): ``_RECORD``'s header (magic ``TSR1``, the rank, Python's
    version, whether it holds a cached gaussian and its value, NumPy's position, its cached
    gaussian flag and value, the lengths of Python's state, NumPy's keys, torch's state and
    of each CUDA state, and their count), then Python's state and NumPy's keys as ``uint32``,
    torch's state, and each CUDA state (``uint8``). ``"replicas"`` is left out. About 10 KB
    (torch's CPU state is 5,056 bytes).

    Raises:
        KeyError, TypeError, ValueError: If the dict is not in ``RNGState``'s format (or its
            CUDA states differ in length).
    """
    python, numpy = state_dict["python"], state_dict["numpy"]
    if numpy["kind"] != _MT19937:
        raise ValueError(f"NumPy's generator is {numpy['kind']!r}, not {_MT19937!r}")
    internal = _as_bytes(python["state"], np.uint64)
    words = np.frombuffer(internal, dtype=np.uint64)
    if words.size and int(words.max()) >= 2**32:
        raise ValueError("Python's generator state holds a value of more than 32 bits")
    keys = np.frombuffer(_as_bytes(numpy["keys"], np.int64), dtype=np.int64)
    cpu = _as_bytes(state_dict["torch"], np.uint8)
    cuda = [_as_bytes(c, np.uint8) for c in state_dict.get("cuda") or []]
    if len({len(c) for c in cuda}) > 1:
        raise ValueError("The CUDA generator states differ in length")
    gauss = python["gauss"]
    header = _RECORD.pack(
        _MAGIC,
        int(state_dict.get("rank", 0)),
        int(python["version"]),
        0 if gauss is None else 1,
        0.0 if gauss is None else float(gauss),
        int(numpy["pos"]),
        int(numpy["has_gauss"]),
        float(numpy["cached_gaussian"]),
        words.size,
        keys.size,
        len(cpu),
        len(cuda[0]) if cuda else 0,
    )
    tail = struct.pack("<I", len(cuda))
    return b"".join(
        [header, tail, words.astype("<u4").tobytes(), keys.astype("<u4").tobytes(), cpu, *cuda]
    )


def _record_header(view: memoryview) -> tuple[tuple[Any, ...], int]:
    """The header fields and CUDA state count of a record, checked against its length."""
    if len(view) < _RECORD.size + 4:
        raise ValueError(f"A generator state record of {len(view)} bytes is too short")
    fields = _RECORD.unpack_from(view)
    if fields[0] != _MAGIC:
        raise ValueError(f"Not a generator state record (magic {bytes(fields[0])!r})")
    (count,) = struct.unpack_from("<I", view, _RECORD.size)
    n_python, n_keys, n_cpu, n_cuda = fields[8:]
    size = _RECORD.size + 4 + 4 * (n_python + n_keys) + n_cpu + count * n_cuda
    if len(view) != size:
        raise ValueError(f"A generator state record of {len(view)} bytes, not {size}")
    return fields, count


def rng_record_rank(data: bytes) -> int:
    """The rank of an ``encode_rng_state`` record, after checking its header and length.

    Raises:
        ValueError: As ``decode_rng_state``.
    """
    return int(_record_header(memoryview(data))[0][1])


def decode_rng_state(data: bytes) -> dict[str, Any]:
    """Decode ``encode_rng_state``'s bytes into a state in ``RNGState``'s format.

    Raises:
        ValueError: If ``data`` is not such a record (another magic, lengths that do not add
            up), naming what is wrong.
    """
    view = memoryview(data)
    fields, count = _record_header(view)
    _, rank, version, has_gauss, gauss, pos, np_gauss, cached = fields[:8]
    n_python, n_keys, n_cpu, n_cuda = fields[8:]
    offset = _RECORD.size + 4

    def take(n: int, dtype: Any) -> np.ndarray:
        nonlocal offset
        array = np.frombuffer(view, dtype=dtype, count=n, offset=offset)
        offset += n * array.itemsize
        return array

    words = take(n_python, "<u4")
    keys = take(n_keys, "<u4")
    cpu = torch.from_numpy(take(n_cpu, np.uint8).copy())
    cuda = [torch.from_numpy(take(n_cuda, np.uint8).copy()) for _ in range(count)]
    return {
        "python": {
            "version": version,
            "state": [int(w) for w in words],
            "gauss": gauss if has_gauss else None,
        },
        "numpy": {
            "kind": _MT19937,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": np_gauss,
            "cached_gaussian": cached,
        },
        "torch": cpu,
        "cuda": cuda,
        "rank": rank,
    }


class RNGState:
    """``state_dict``/``load_state_dict`` over the process-wide random generators.

    The state holds: ``python`` (``random.getstate()``: version, 625 ints, gauss),
    ``numpy`` (``np.random.get_state()``: the 624 MT19937 keys as an int64 tensor, position,
    has_gauss, cached gaussian), ``torch`` (``torch.get_rng_state()``, a uint8 tensor),
    ``cuda`` (one uint8 tensor per CUDA device; empty without CUDA), ``rank`` (the rank
    that took it) and, when ``replicas`` gives them, the other ranks' states under
    ``"replicas"`` (``{"1": "<Base64 of its encode_rng_state record>", ...}``).

    Generators owned by objects (a ``torch.Generator`` given to a DataLoader, a
    ``numpy.random.Generator``) are not global: save them with their owner.

    Args:
        rank: The rank whose streams ``load_state_dict`` sets up (see ``rank_rng_state``);
            None: the process group's rank when one is initialized, else 0.

    Thread safety: like the generators themselves; take and restore between steps.
    Distributed: in a process group of more than one rank, ``cuda`` holds only the current
    CUDA device's state (each rank owns its device; the others are not touched), and
    ``load_state_dict`` gives each rank its own streams: the rank that took the state
    continues it, a rank whose state it carries under ``"replicas"`` continues that one, any
    other rank ``r`` gets generators seeded from the saved state and ``r``
    (``rank_rng_state``). So the ranks never draw the same numbers, and a resume from one
    checkpoint always gives every rank the same numbers. The chief saves every rank's streams
    in what it saves of the steps it gathered them at (``distributed/replica_streams``: the
    step of an agreed stop, and every step of a replicated run's memory tier); a sharded
    run's memory tier holds each rank's own. After a resume from a checkpoint of another step
    (a periodic one without a replicated memory tier) the other ranks' numbers differ from
    those of an uninterrupted run.

    Attributes:
        replicas: Called by ``state_dict`` for the other ranks' states to save beside this
            rank's (``REPLICAS``' mapping, or None: none). Set by the Supervisor on the chief
            (``distributed/replica_streams``).
        loaded_replicas: The other ranks' states the last ``load_state_dict`` received (its
            ``"replicas"``), or None.

    TF name: none (TF 1 graph-level seeds made runs repeatable without saving a state).
    """

    def __init__(self, rank: int | None = None) -> None:
        self.rank = check_int("rank", rank, allow_none=True)
        self.replicas: Callable[[], Mapping[str, str] | None] | None = None
        self.loaded_replicas: Mapping[str, str] | None = None

    def state_dict(self) -> dict[str, Any]:
        """Return the current states of every global generator (see the class docstring)."""
        if not torch.cuda.is_available():
            cuda = []
        elif _replicas():
            cuda = [torch.cuda.get_rng_state(torch.cuda.current_device())]
        else:
            cuda = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
        state = _state_dict(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)
        state["rank"] = _process_rank() if self.rank is None else self.rank
        others = self.replicas() if self.replicas is not None else None
        if others:
            state[REPLICAS] = dict(others)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every generator from ``state_dict()`` output (derived for other ranks than
        the one that took it: ``rank_rng_state``).

        CUDA states are restored for the devices present (a checkpoint from a machine with more
        GPUs restores the first ones); in a process group of more than one rank only the
        current device is set, from the first CUDA state.

        Raises:
            KeyError, TypeError, ValueError: If the dict is not in the format above.
        """
        rank = _process_rank() if self.rank is None else self.rank
        replicas = state_dict.get(REPLICAS)
        self.loaded_replicas = dict(replicas) if isinstance(replicas, Mapping) else None
        state_dict = rank_rng_state(state_dict, rank)
        python = state_dict["python"]
        random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
        numpy = state_dict["numpy"]
        keys = numpy["keys"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        np.random.set_state(
            (
                numpy["kind"],
                keys.astype(np.uint32),
                int(numpy["pos"]),
                int(numpy["has_gauss"]),
                float(numpy["cached_gaussian"]),
            )
        )
        torch.set_rng_state(state_dict["torch"].to(torch.uint8))
        cuda = state_dict.get("cuda") or []
        if not cuda or not torch.cuda.is_available():
            return
        if _replicas():
            torch.cuda.set_rng_state(cuda[0].to(torch.uint8), torch.cuda.current_device())
            return
        for i, state in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state.to(torch.uint8), i)
