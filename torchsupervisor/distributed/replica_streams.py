"""Every rank's random streams in the chief's checkpoints, so that a run with replicas
resumes bitwise on every rank.

A checkpoint that the replicas share held the chief's generators only: the chief of a
replicated run (DDP) saves alone, and a sharded run's (FSDP2) generator states come from its
coordinator. After a restart from it every other rank derived fresh streams
(``rng.rank_rng_state``): at the right step, but drawing other numbers (dropout masks) than
the run without the restart. ``ReplicaStreams`` gathers the generator states of every rank to
the chief at a step boundary (one ``gather`` of a record of about 10 KB per rank:
``rng.encode_rng_state``, never pickled, on a gloo group of its own: ``env.streams_group``), and
the chief's ``RNGState`` saves them beside its own under ``"replicas"``, as Base64 text in the
checkpoint's tree, in what it saves of that step. After a restore each rank finds its own
there (a replicated run's non-chiefs in the chief's broadcast, a sharded run's ranks in the
checkpoint's tree, which each reads whole) and continues it.

When: at the step every rank stops at after an agreed stop (the final checkpoint of a
Supervisor or of a ``MonitoredTrainingSession``: ``monitored/replica_stop``); and in a
replicated run with the memory tier (the Supervisor's, or the chief's of a
``MonitoredTrainingSession``), at every step boundary, before anything of the boundary (its
snapshot, a periodic checkpoint: ``StepBoundary.call_each(first=True)``). A sharded run's
memory tier needs none: each rank's snapshot holds its own streams. A checkpoint of a step
whose streams were not gathered (a periodic checkpoint without the memory tier, a run ended by
its own loop or a hook) holds the chief's alone, and the others derive theirs as before.

Cost: every rank encodes its generators (about 0.1 ms) and takes part in one gather per step
with the memory tier on (about 0.5 ms a step, 2 ranks on 2 cores); the chief receives
``world_size - 1`` records. A rank that died makes the gather fail at once (gloo sees its
connections close), before the chief's snapshot of that step: the newest snapshot is then one
that holds every rank's streams.

Thread safety: the training thread (its step boundaries and ``should_stop``).
Distributed: every rank of a run with replicas, an ``RNGState`` and a global step makes one
and gathers at the same boundaries (the same program on every rank).

TF name: none.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torchsupervisor.core.global_step import GlobalStepLike, read_step
from torchsupervisor.core.rng import RNGState, encode_rng_state, rng_record_rank
from torchsupervisor.core.session import Session
from torchsupervisor.distributed.env import streams_group
from torchsupervisor.distributed.replicas import ReplicaGroup

__all__ = ["ReplicaStreams", "rng_entry", "start_streams"]

logger = logging.getLogger("torchsupervisor")

_LENGTH_BYTES = 8  # Each rank's buffer: the record's length, then the record.


def rng_entry(state: Mapping[str, Any]) -> RNGState | None:
    """The first ``RNGState`` among the entries of ``state`` (the Supervisor's ``"rng"``)."""
    return next((value for value in state.values() if isinstance(value, RNGState)), None)


def start_streams(
    sess: Session,
    replicas: ReplicaGroup | None,
    global_step: GlobalStepLike | None,
    *,
    every_boundary: bool,
) -> ReplicaStreams | None:
    """With replicas, an ``RNGState`` in ``sess``'s state and a global step: a started
    ``ReplicaStreams`` (it gathers at an agreed stop, and with ``every_boundary`` at every
    step boundary); None otherwise. Every rank calls it at the same point of its session."""
    rng = rng_entry(sess.state)
    if replicas is None or rng is None or global_step is None:
        return None
    streams = ReplicaStreams(rng, global_step, rank=replicas.rank, world_size=replicas.world_size)
    streams.start(sess, every_boundary)
    return streams


class ReplicaStreams:
    """The gathering of every rank's generator states to the chief (module docstring).

    Args:
        rng: This rank's ``RNGState`` entry: on the chief (rank 0), it saves what was
            gathered.
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
        # The buffers of the gather, made at the first (their length, the longest record of
        # any rank, agreed then) and reused: a step boundary allocates no new ones.
        self._payload: np.ndarray | None = None
        self._sent: torch.Tensor | None = None  # The payload's tensor (one memory).
        self._received: list[torch.Tensor] | None = None
        # The chief's: the others' records (raw, or as saved: ``held`` encodes them once)
        # and the step they are of.
        self._records: dict[str, bytes] = {}
        self._states: Mapping[str, str] | None = None
        self._step: int | None = None
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
            self._records, self._states = {}, loaded or None
            self._step = read_step(self.global_step) if loaded else None
            self.rng.replicas = self.held
        if every_boundary:
            sess.boundary.call_each(self.gather, first=True)
            self._session = sess

    def follow(self, sess: Session) -> None:
        """Gather at the step boundaries of ``sess`` from now on, instead of the session's
        before (a ``MonitoredSession``'s session re-created after a recoverable error)."""
        if self._session is not None and self._session is not sess:
            self._session.boundary.remove_each(self.gather)
            sess.boundary.call_each(self.gather, first=True)
            self._session = sess

    def held(self) -> Mapping[str, str] | None:
        """The other ranks' states of the current step (the chief's ``RNGState.replicas``),
        or None when none were gathered at this step."""
        if self._step is None or read_step(self.global_step) != self._step:
            return None
        if self._states is None and self._records:
            self._states = {
                r: base64.b64encode(b).decode("ascii") for r, b in self._records.items()
            }
        return self._states or None

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
        group = streams_group()  # Made at the first gather, on every rank.
        chief = self.rank == 0
        # The chief's own streams are saved by its ``RNGState``: it sends an empty record.
        record = b"" if chief else encode_rng_state(RNGState(rank=self.rank).state_dict())
        payload = self._payload
        if payload is None:
            longest = torch.tensor([len(record)], dtype=torch.int64)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
            payload = self._payload = np.zeros(_LENGTH_BYTES + int(longest), dtype=np.uint8)
            self._sent = torch.from_numpy(payload)
            if chief:
                self._received = [
                    torch.empty(len(payload), dtype=torch.uint8) for _ in range(self.world_size)
                ]
        fits = len(record) <= len(payload) - _LENGTH_BYTES  # Else a length of 0: no state.
        length = len(record) if fits else 0
        payload[:_LENGTH_BYTES] = np.frombuffer(
            length.to_bytes(_LENGTH_BYTES, "little"), dtype=np.uint8
        )
        if length:
            payload[_LENGTH_BYTES : _LENGTH_BYTES + length] = np.frombuffer(record, np.uint8)
        dist.gather(self._sent, self._received, dst=0, group=group)
        if self._received is not None:
            self._records, self._states, self._step = self._read(self._received, step), None, step

    def _read(self, received: list[torch.Tensor], step: int) -> dict[str, bytes]:
        """The chief: each other rank's record, by rank as a string; a record that cannot be
        read, or of another rank, is left out (that rank derives its streams), told once."""
        records: dict[str, bytes] = {}
        for rank, buffer in enumerate(received[1:], start=1):
            data = buffer.numpy()
            length = int.from_bytes(data[:_LENGTH_BYTES].tobytes(), "little")
            record = data[_LENGTH_BYTES : _LENGTH_BYTES + length].tobytes()
            try:
                if length == 0:
                    raise ValueError("its record outgrew the first one's length")
                if rng_record_rank(record) != rank:
                    raise ValueError(f"it holds the state of rank {rng_record_rank(record)}")
            except ValueError as e:
                self._tell(f"rank {rank}", f"rank {rank}'s generator states at step {step}: {e}")
                continue
            records[str(rank)] = record
        return records

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
        self._records, self._states, self._step = {}, None, None
