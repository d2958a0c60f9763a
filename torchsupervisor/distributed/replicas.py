"""Replicas of one training run: the chief's decisions reach every rank, stops are agreed.

With several replicas (processes of a ``torch.distributed`` process group), the chief
restores or initializes the state and the others must start from exactly that state, and a
stop requested on one rank (a signal, an error, ``request_stop``) must stop every rank at the
same step: replicas that average gradients (DDP) run each step together, and a rank that stops
one step early leaves the others waiting in a collective forever (``stop_agreement``).

``ReplicaGroup`` uses the process group's key-value store (no collective on every step):

* ``publish_ready`` / ``wait_ready``: the chief announces the resume point (checkpoint prefix
  and step); the others poll every ``recovery_wait_secs`` and give up after ``max_wait_secs``
  with ``DeadlineExceededError``;
* ``broadcast_state``: the chief's state (tensors and plain values) is broadcast to the
  others, which load it (on the device the backend communicates from: the current CUDA
  device with NCCL, the CPU with gloo; see ``communication_device``);
* ``agree``: every rank posts a value and all check that the others posted the same.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.dtypes import dtype_from_code, dtype_to_code
from torchsupervisor.core.state import flatten_state
from torchsupervisor.core.state_load import load_state
from torchsupervisor.core.training_state import shared_entries
from torchsupervisor.core.tree import decode_tree, encode_tree
from torchsupervisor.distributed.attempt import DEFAULT_TIMEOUT_SECS, attempt_namespace
from torchsupervisor.distributed.env import (
    STORE_NAMESPACE,
    communication_device,
    store_outlives_attempts,
)
from torchsupervisor.distributed.liveness import LIVENESS_SECS, ProcessRecords, records_prefix
from torchsupervisor.errors import (
    AbortedError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    ReplicaAbort,
    ReplicaGoneError,
)

__all__ = [
    "ReplicaAbort",
    "ReplicaGroup",
    "agree",
    "communication_device",
]

logger = logging.getLogger("torchsupervisor")


def _store() -> Any:
    # The default group's store: the rendezvous every rank already shares.
    return dist.distributed_c10d._get_default_store()


# The namespace of this restart attempt in each process group's store (agreed once per group).
_ATTEMPTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _attempt_prefix(store: Any, rank: int, world_size: int) -> str:
    """A prefix for the default group's store, fresh for each torchrun restart attempt.

    Under torchrun the store can outlive an attempt with the dead workers' keys in it (a
    group made by ``init_process_group`` rather than ``connect``); every rank of the group
    reaches its first ``ReplicaGroup`` in the same order, where they agree on one.
    """
    group = dist.group.WORLD
    if not store_outlives_attempts(group):
        return STORE_NAMESPACE
    if group not in _ATTEMPTS:
        _ATTEMPTS[group] = attempt_namespace(store, rank, world_size, DEFAULT_TIMEOUT_SECS)
    return _ATTEMPTS[group]


class ReplicaGroup:
    """The chief/worker agreement of one session, through the process group's store.

    Args:
        generation: A number that all ranks give to the same session (the Supervisor counts
            its sessions), so that keys of earlier sessions are not mistaken for this one's.
        chief_rank: The rank of the chief.
        store: A ``torch.distributed.Store`` to agree through, with ``rank`` and
            ``world_size`` (tests run several "ranks" in one process this way); None: the
            default process group's store, rank and size, under a namespace of this torchrun
            restart attempt (``attempt.py``) that the ranks agree on at their first group.
        rank: This rank (with ``store``).
        world_size: The number of ranks (with ``store``).
        clock: Time for every wait and deadline of the agreements (tests pass a fake one);
            None: the real clock.

    Raises:
        InvalidArgumentError: Without ``store``, if no process group is initialized.

    Distributed: every rank creates one per session, in the same order.
    """

    def __init__(
        self,
        generation: int,
        chief_rank: int = 0,
        *,
        store: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        if store is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise InvalidArgumentError("ReplicaGroup needs an initialized process group")
            store, rank, world_size = _store(), dist.get_rank(), dist.get_world_size()
            attempt = _attempt_prefix(store, rank, world_size)
        else:
            attempt = STORE_NAMESPACE
        self.rank = int(rank or 0)
        self.world_size = int(world_size or 1)
        self.chief_rank = chief_rank
        self._prefix = f"{attempt}{generation}/"
        self._store = store
        self.clock = clock or REAL_CLOCK
        self.processes = ProcessRecords(store, records_prefix(attempt), self.rank)
        """Where each rank's process runs: a wait ends once the awaited rank is gone."""

    def key(self, name: str) -> str:
        """Return this session's store key for ``name``."""
        return self._prefix + name

    def _raise_if_gone(self, ranks: list[int], waiting_for: str) -> None:
        gone = self.processes.gone(ranks)
        if gone:
            raise ReplicaGoneError(
                gone,
                f"{waiting_for}: rank(s) {gone} are gone (their processes on this machine "
                "no longer exist); not waiting any longer",
            )

    def publish_ready(self, info: Mapping[str, Any], name: str = "ready") -> None:
        """(Chief) Announce that the state is ready, with the resume point ``info``."""
        self._store.set(self.key(name), json.dumps(dict(info)))

    def wait_ready(
        self,
        recovery_wait_secs: float,
        max_wait_secs: float | None,
        name: str = "ready",
        *,
        clock: Clock | None = None,
    ) -> dict[str, Any]:
        """(Non-chief) Wait until the chief published; return its resume point.

        Looks at the store, then every ``recovery_wait_secs``, as TF's ``wait_for_session``
        retried: with ``recovery_wait_secs=1`` and ``max_wait_secs=3`` it looks 4 times and
        raises after about 3 s.

        Args:
            recovery_wait_secs: Seconds between two looks at the store.
            max_wait_secs: Longest wait in seconds (None: forever).
            name: The key the chief publishes (``publish_ready`` uses ``"ready"``).
            clock: The time source and sleep; None: the group's.

        Returns:
            The mapping the chief gave to ``publish_ready``.

        Raises:
            DeadlineExceededError: ``"Session was not ready after waiting %d secs."`` (with
                ``max_wait_secs``), when less than ``recovery_wait_secs`` is left.
            ReplicaGoneError: The chief's process, on this machine, is gone (looked at about
                once a second: ``liveness``), whatever the deadline.

        Distributed: non-chief ranks; the chief calls ``publish_ready``.
        """
        clock = clock or self.clock
        key = self.key(name)
        limit = float("inf") if max_wait_secs is None else max_wait_secs
        start = clock.monotonic()
        look = start + LIVENESS_SECS
        while not self._store.check([key]):
            now = clock.monotonic()
            remaining = max(0.0, limit - (now - start))
            if remaining < recovery_wait_secs:
                raise DeadlineExceededError(
                    None, None, f"Session was not ready after waiting {int(limit)} secs."
                )
            if now >= look:
                look = now + LIVENESS_SECS
                self._raise_if_gone([self.chief_rank], f"Waiting for the chief's {name!r}")
            logger.info("Waiting for the chief to make the model ready.")
            clock.sleep(recovery_wait_secs)
        return json.loads(self._store.get(key).decode("utf-8"))

    # -------------------------------------------- every rank posts, every rank reads all

    def post(self, name: str, value: object) -> None:
        """Post this rank's value (JSON-serializable) under ``name``.

        Thread safety: any thread (the store client serializes its requests).
        """
        self._store.set(self.key(f"{name}/{self.rank}"), json.dumps(value))

    def collect(self, name: str) -> list[Any] | None:
        """Every rank's value of ``name`` in rank order, or None if some rank has not posted."""
        keys = [self.key(f"{name}/{r}") for r in range(self.world_size)]
        if not self._store.check(keys):
            return None
        return [json.loads(self._store.get(k).decode("utf-8")) for k in keys]

    def gather(
        self,
        name: str,
        timeout_secs: float,
        *,
        what: str,
        abort: str | None = None,
        poll_secs: float = 0.01,
    ) -> list[Any]:
        """Wait until every rank has posted ``name``; return the values in rank order.

        Args:
            name: The name the ranks post under.
            timeout_secs: Longest wait in seconds.
            what: What is being agreed on, for the error message.
            abort: A flag name (see ``raise_flag``): if some rank raised it, stop waiting.
            poll_secs: Seconds between two looks at the store.

        Raises:
            DeadlineExceededError: If some rank did not post within ``timeout_secs``, naming
                those ranks; ``ReplicaGoneError`` (a subclass) as soon as one of them is
                known to be gone (``liveness``: its process, on this machine, no longer
                exists), since it never will.
            ReplicaAbort: If the ``abort`` flag was raised (its text is the reason).
        """
        now = self.clock.monotonic()
        deadline, look = now + timeout_secs, now + LIVENESS_SECS
        while True:
            values = self.collect(name)
            if values is not None:
                return values
            if abort is not None:
                reason = self.flag(abort)
                if reason is not None:
                    raise ReplicaAbort(reason)
            now = self.clock.monotonic()
            if now >= look:
                look = now + LIVENESS_SECS
                self._raise_if_gone(self.missing(name), what)
            if now > deadline:
                missing = self.missing(name)
                raise DeadlineExceededError(
                    None,
                    None,
                    f"{what}: rank(s) {missing} did not answer within {timeout_secs:g} s (a "
                    "replica stopped, or its training thread is stuck)",
                )
            self.clock.sleep(poll_secs)

    def missing(self, name: str) -> list[int]:
        """The ranks that have not posted ``name``."""
        return [
            r for r in range(self.world_size) if not self._store.check([self.key(f"{name}/{r}")])
        ]

    def add(self, name: str, amount: int) -> int:
        """Add ``amount`` to the shared counter ``name`` (created at 0); return its new value."""
        return int(self._store.add(self.key(name), amount))

    def decide(self, name: str, proposal: str) -> str:
        """Record ``proposal`` as the decision ``name`` unless one exists; return the decision.

        The first rank to decide wins (an atomic compare-and-set in the store); every rank
        that asks gets that same decision back, whatever it proposed.
        """
        return self._store.compare_set(self.key(name), "", proposal).decode("utf-8")

    def raise_flag(self, name: str, reason: str) -> None:
        """Raise the flag ``name`` with ``reason`` (the first reason is kept)."""
        self._store.compare_set(self.key(name), "", reason)

    def flag(self, name: str) -> str | None:
        """The reason the flag ``name`` was raised with, or None if it is not raised."""
        key = self.key(name)
        if not self._store.check([key]):
            return None
        return self._store.get(key).decode("utf-8")

    def broadcast_state(self, state: Mapping[str, Any]) -> None:
        """Make every rank's state equal to the chief's (a collective: every rank calls it).

        The chief sends the encoded tree of plain values and every tensor; the others load
        them into their state with ``load_state_dict`` (so an optimizer that has not stepped
        yet receives the chief's moments). Per-rank entries (``InputPipelineState``: each
        rank's queues hold its own batches) are neither sent nor received.

        Every tensor travels on ``communication_device(dist.get_backend())`` on both sides
        (the current CUDA device with NCCL, the CPU with gloo). A non-chief then moves each
        tensor to the device of its own tensor of the same name; one it lacks (the moments
        of an optimizer that has not stepped) goes to the CPU if the chief's was there, else
        stays on the communication device (``load_state_dict`` places it further).

        Raises:
            RuntimeError: If a collective fails (a rank died, a timeout).
            InvalidArgumentError: (Non-chief) If the chief's state does not fit this rank's.
            AbortedError: (Non-chief) If the chief could not send its state (it raises its
                own error, after telling the others).
            Exception: What flattening this rank's state raised (a ``state_dict`` that
                raises), once this rank has taken its part in the broadcasts.

        Distributed: a collective of the default process group; every rank calls it once
        per session, after the chief's ``publish_ready``.
        """
        src = self.chief_rank
        chief = self.rank == src
        device = communication_device(dist.get_backend())
        state = shared_entries(state)  # Per-rank entries (input pipelines) stay each rank's.
        # What fails on one rank before the broadcasts (a ``state_dict`` that raises there)
        # is raised only once this rank has taken its part: a rank that raised at once would
        # leave the others waiting in a broadcast. The chief sends a size of -1 instead.
        error: Exception | None = None
        try:
            skeleton, tensors = flatten_state(state)  # A non-chief's: where the values go.
            if chief:
                names = sorted(tensors)
                header = {
                    "tree": encode_tree(skeleton),
                    "tensors": [
                        [n, dtype_to_code(t.dtype), list(t.shape), t.device.type]
                        for n, t in ((n, tensors[n]) for n in names)
                    ],
                }
                encoded = bytearray(json.dumps(header).encode())
                payload = torch.frombuffer(encoded, dtype=torch.uint8).to(device)
        except Exception as e:
            error, tensors = e, {}
        if chief:
            length = -1 if error is not None else payload.numel()
            size = torch.tensor([length], dtype=torch.int64, device=device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=device)
        dist.broadcast(size, src)
        chief_failed = error is not None if chief else int(size.item()) < 0  # It sent -1.
        if chief_failed:  # Nothing more is sent.
            if error is not None:
                raise error
            raise AbortedError(
                f"The chief (rank {src}) could not send its state to the replicas (it raised "
                "the error on its side)"
            )
        if not chief:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(payload, src)
        if not chief:
            header = json.loads(payload.cpu().numpy().tobytes().decode("utf-8"))
        received: dict[str, torch.Tensor] = {}
        for name, code, shape, chief_device_type in header["tensors"]:
            if chief:
                dist.broadcast(tensors[name].contiguous().to(device), src)
                continue
            buffer = torch.empty(shape, dtype=dtype_from_code(code), device=device)
            dist.broadcast(buffer, src)
            own = tensors.get(name)
            if own is not None:
                target = own.device
            else:
                target = torch.device("cpu") if chief_device_type == "cpu" else device
            received[name] = buffer.to(target)
        if error is not None:  # This rank has taken its part in every broadcast.
            raise error
        if not chief:
            tree = decode_tree(
                header["tree"], lambda n, nd: received[n].cpu().numpy() if nd else received[n]
            )
            load_state(state, tree, source=f"rank {src}")


def agree(
    replicas: ReplicaGroup,
    name: str,
    value: object,
    timeout_secs: float,
    *,
    what: str,
    abort: str | None = None,
) -> None:
    """Post ``value`` and check that every rank posted the same; raise on every rank if not.

    Raises:
        FailedPreconditionError: If the ranks posted different values (all of them listed),
            or (``ReplicaAbort``) if a rank raised the ``abort`` flag.
        DeadlineExceededError: If a rank did not post within ``timeout_secs``.

    Distributed: every rank calls it with the same ``name``.
    """
    replicas.post(name, value)
    values = replicas.gather(name, timeout_secs, what=f"Agreeing on {what}", abort=abort)
    if any(v != values[0] for v in values):
        listed = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise FailedPreconditionError(None, None, f"The replicas disagree on {what}: {listed}")
