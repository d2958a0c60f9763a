"""The global random number generators as one stateful object, so they can be checkpointed.

An exact continuation after a restart needs the random streams to continue where they were:
dropout masks, random crops, noise. ``RNGState`` captures Python's ``random``, NumPy's global
generator, torch's CPU generator and the generator of every CUDA device, and restores them.
The Supervisor puts one in the state by default (``save_rng_state=False`` to opt out).

With replicas, every rank must draw its own numbers (else every rank applies the same dropout
mask to its part of the batch). A state records the rank that took it: that rank loads it as
it is (the chief from a shared checkpoint, every rank of a sharded run from its own memory-tier
snapshot), and any other rank ``r`` loads ``rank_rng_state(state, r)``: fresh generators seeded
from a hash of the saved state and ``r``. Every rank's stream is therefore a deterministic
function of the checkpoint (or of the chief's state at the start) and of its rank.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torchsupervisor.core.checks import check_int

__all__ = ["RNGState", "rank_rng_state", "rank_seed"]


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

    The seed is the first 8 bytes of the SHA-256 of ``rank`` and of the Python, NumPy and
    torch CPU states: the same on every machine and in every process (no ``hash()``).

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
    digest.update(_as_bytes(state_dict["python"]["state"], np.uint64))
    digest.update(_as_bytes(state_dict["numpy"]["keys"], np.int64))
    digest.update(b"%d" % int(state_dict["numpy"]["pos"]))
    digest.update(_as_bytes(state_dict["torch"], np.uint8))
    return int.from_bytes(digest.digest()[:8], "little") & (2**63 - 1)


def rank_rng_state(state_dict: dict[str, Any], rank: int) -> dict[str, Any]:
    """Return the generator states that rank ``rank`` loads from ``state_dict``.

    The rank that took the state (its ``"rank"``; 0 in a state without one, as earlier
    versions saved) continues the saved streams: ``state_dict`` itself is returned. Any other
    rank gets fresh generators seeded with ``rank_seed(state_dict, rank)``: Python's
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


class RNGState:
    """``state_dict``/``load_state_dict`` over the process-wide random generators.

    The state holds: ``python`` (``random.getstate()``: version, 625 ints, gauss),
    ``numpy`` (``np.random.get_state()``: the 624 MT19937 keys as an int64 tensor, position,
    has_gauss, cached gaussian), ``torch`` (``torch.get_rng_state()``, a uint8 tensor),
    ``cuda`` (one uint8 tensor per CUDA device; empty without CUDA) and ``rank`` (the rank
    that took it).

    Generators owned by objects (a ``torch.Generator`` given to a DataLoader, a
    ``numpy.random.Generator``) are not global: save them with their owner.

    Args:
        rank: The rank whose streams ``load_state_dict`` sets up (see ``rank_rng_state``);
            None: the process group's rank when one is initialized, else 0.

    Thread safety: like the generators themselves; take and restore between steps.
    Distributed: in a process group of more than one rank, ``cuda`` holds only the current
    CUDA device's state (each rank owns its device; the others are not touched), and
    ``load_state_dict`` gives each rank its own streams: the rank that took the state
    continues it, any other rank ``r`` gets generators seeded from the saved state and ``r``
    (``rank_rng_state``). So the ranks never draw the same numbers, and a resume from one
    checkpoint always gives every rank the same numbers. A shared checkpoint (DDP's, FSDP2's)
    holds the chief's streams only: after a resume from it the other ranks' numbers differ
    from those of an uninterrupted run (seed per-step generators from the step and rank for
    bitwise resumes); a sharded run's memory tier holds each rank's own, which each rank
    continues.

    TF name: none (TF 1 graph-level seeds made runs repeatable without saving a state).
    """

    def __init__(self, rank: int | None = None) -> None:
        self.rank = check_int("rank", rank, allow_none=True)

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
