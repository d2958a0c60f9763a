"""Every rank's random streams in the chief's checkpoints, so that a replicated run resumes
bitwise on every rank.

In a replicated run (DDP) the chief alone saves the state: its checkpoints and memory-tier
snapshots held its own generators only, and after a restart every other rank derived fresh
streams (``rng.rank_rng_state``): at the right step, but drawing other numbers (dropout
masks) than the run without the restart. ``ReplicaStreams`` gathers the generator states of
every rank to the chief at a step boundary (one ``gather`` of a small record per rank, about
10 KB: ``rng.encode_rng_state``, never pickled, on the gloo group of ``env.background_group``),
and the chief's ``RNGState`` saves them beside its own under ``"replicas"`` in what it saves
of that step. After a restore the chief's broadcast carries them, and each rank continues its
own streams.

When: with the memory tier on, at every step boundary, before anything of the boundary (its
snapshot, a periodic checkpoint: ``StepBoundary.call_each(first=True)``); and at the step
every rank stops at after an agreed stop (the final checkpoint). A checkpoint of a step
whose streams were not gathered (a periodic checkpoint without the memory tier, a run ended
by its own loop) holds the chief's alone, and the others derive theirs as before.

Cost: every rank encodes its generators (tens of microseconds) and takes part in one gather
per step with the memory tier on; the chief receives ``world_size - 1`` records. A rank that
died makes the gather fail at once (gloo sees its connections close), before the chief's
snapshot of that step: the newest snapshot is then one that holds every rank's streams.

Thread safety: the training thread (its step boundaries and ``should_stop``).
Distributed: every rank of a replicated run with an ``RNGState`` and a global step makes one
and gathers at the same boundaries (the same program on every rank).

TF name: none.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torchsupervisor.core.global_step import GlobalStepLike, read_step
from torchsupervisor.core.rng import RNGState, decode_rng_state, encode_rng_state
from torchsupervisor.core.session import Session
from torchsupervisor.distributed.env import background_group

__all__ = ["ReplicaStreams", "rng_entry"]

logger = logging.getLogger("torchsupervisor")

_LENGTH_BYTES = 8  # Each rank's buffer: the record's length, then the record.


def rng_entry(state: Mapping[str, Any]) -> RNGState | None:
    """The first ``RNGState`` among the entries of ``state`` (the Supervisor's ``"rng"``)."""
    return next((value for value in state.values() if isinstance(value, RNGState)), None)


class ReplicaStreams:
    """The gathering of every rank's generator states to the chief (module docstring).

    Args:
        rng: This rank's ``RNGState`` entry: on the chief, it saves what was gathered.
        global_step: The run's global step (the gathered states are of one step).
        rank: This rank (the chief is rank 0).
        world_size: The ranks of the process group.

    Attributes:
        gathered_step: The step of the last gather on this rank, or None.
    """

    def __init__(
        self, rng: RNGState, global_step: GlobalStepLike, *, rank: int, world_size: int
    ) -> None:
        self.rng = rng
        self.global_step = global_step
        self.rank = rank
        self.world_size = world_size
        self.gathered_step: int | None = None
        self._capacity: int | None = None  # The longest record, agreed at the first gather.
        self._states: Mapping[str, Any] | None = None  # The chief's: the others' states,
        self._step: int | None = None  # of this step.
        self._session: Session | None = None
        self._told: set[str] = set()

    def start(self, sess: Session, every_boundary: bool) -> None:
        """Begin (after the restore, before the chief's broadcast of its state).

        On the chief, what the restore loaded (``rng.loaded_replicas``) is held for the
        restored step, so that the broadcast gives each rank its own streams, and the
        ``RNGState`` saves the states gathered for the step it is saved at. With
        ``every_boundary`` (the memory tier), every rank gathers at every step boundary.
        """
        loaded, self.rng.loaded_replicas = self.rng.loaded_replicas, None  # This restore's.
        if self.rank == 0:
            self._states = loaded or None
            self._step = read_step(self.global_step) if loaded else None
            self.rng.replicas = self.held
        if every_boundary:
            sess.boundary.call_each(self.gather, first=True)
            self._session = sess

    def held(self) -> Mapping[str, Any] | None:
        """The other ranks' states of the current step (the chief's ``RNGState.replicas``),
        or None when none were gathered at this step."""
        if self._states is None or self._step is None:
            return None
        return self._states if read_step(self.global_step) == self._step else None

    def gather(self) -> None:
        """Gather every rank's generator states to the chief, once per step (every rank, at
        the same boundaries).

        Raises:
            RuntimeError: The gather failed (a rank died: this boundary's snapshot is not
                taken, and the error ends the session).
        """
        step = read_step(self.global_step)
        if step is None or step == self.gathered_step:
            return
        self.gathered_step = step
        group = background_group()
        chief = self.rank == 0
        # The chief's own streams are saved by its ``RNGState``: it sends an empty record.
        record = b"" if chief else encode_rng_state(RNGState(rank=self.rank).state_dict())
        if self._capacity is None:
            longest = torch.tensor([len(record)], dtype=torch.int64)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
            self._capacity = int(longest.item())
        payload = np.zeros(_LENGTH_BYTES + self._capacity, dtype=np.uint8)
        if record and len(record) <= self._capacity:  # Else a length of 0: no state.
            payload[:_LENGTH_BYTES] = np.frombuffer(
                len(record).to_bytes(_LENGTH_BYTES, "little"), dtype=np.uint8
            )
            payload[_LENGTH_BYTES : _LENGTH_BYTES + len(record)] = np.frombuffer(
                record, dtype=np.uint8
            )
        buffer = torch.from_numpy(payload)
        received = [torch.empty_like(buffer) for _ in range(self.world_size)] if chief else None
        dist.gather(buffer, received, dst=0, group=group)
        if received is not None:
            self._states, self._step = self._decode(received, step), step

    def _decode(self, received: list[torch.Tensor], step: int) -> dict[str, Any]:
        """The chief: each other rank's state, by rank as a string; a record that cannot be
        read, or of another rank, is left out (that rank derives its streams), told once."""
        states: dict[str, Any] = {}
        for rank, buffer in enumerate(received):
            if rank == 0:
                continue
            data = buffer.numpy().tobytes()
            length = int.from_bytes(data[:_LENGTH_BYTES], "little")
            try:
                if length == 0:
                    raise ValueError("its record outgrew the first one's length")
                state = decode_rng_state(data[_LENGTH_BYTES : _LENGTH_BYTES + length])
                if state["rank"] != rank:
                    raise ValueError(f"it holds the state of rank {state['rank']}")
            except ValueError as e:
                self._tell(f"rank {rank}", f"rank {rank}'s generator states at step {step}: {e}")
                continue
            states[str(rank)] = state
        return states

    def _tell(self, kind: str, message: str) -> None:
        (logger.debug if kind in self._told else logger.warning)(
            "%s; that rank derives its streams after a restore from it", message
        )
        self._told.add(kind)

    def close(self) -> None:
        """Stop gathering; the chief's ``RNGState`` saves its own streams alone again."""
        if self._session is not None:
            self._session.boundary.remove_each(self.gather)
            self._session = None
        if self.rng.replicas == self.held:
            self.rng.replicas = None
        self._states = self._step = None
