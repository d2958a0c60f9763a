"""Replicas of one training run: the chief's decisions reach every rank, stops are agreed.

With several replicas (processes of a ``torch.distributed`` process group), the chief
restores or initializes the state and the others must start from exactly that state, and a
stop requested on one rank (a signal, an error, ``request_stop``) must stop every rank at the
same step: replicas that average gradients (DDP) run each step together, and a rank that stops
one step early leaves the others waiting in a collective forever.

``ReplicaGroup`` uses the process group's key-value store (no collective on every step):

* ``publish_ready`` / ``wait_ready``: the chief announces the resume point (checkpoint prefix
  and step); the others poll every ``recovery_wait_secs`` and give up after ``max_wait_secs``
  with ``DeadlineExceededError``;
* ``broadcast_state``: the chief's state (tensors and plain values) is broadcast to the
  others, which load it (on the device the backend communicates from: the current CUDA
  device with NCCL, the CPU with gloo; see ``communication_device``);
* ``StopAgreement``: a rank that wants to stop sets a flag in the store. A thread on every
  rank polls the flag; a rank that sees it posts the number of steps it has completed, and
  every rank stops once it has completed ``max(posted) + 1`` steps. That is the first step no
  rank had started when it posted, so every rank reaches it and none has to wait in a
  collective for a rank that already stopped. The poller marks the stop as pending *before*
  it posts, so that the training thread, which checks the mark at every ``should_stop()``,
  finishes at most one step between the post and its first look (see
  ``docs/distributed.md``). A rank that leaves with an error says so: the others stop at
  once (another step would wait for it in a collective) and end with ``AbortedError``.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.dtypes import dtype_from_code, dtype_to_code
from torchsupervisor.core.global_step import read_step
from torchsupervisor.core.state import flatten_state
from torchsupervisor.core.state_load import load_state
from torchsupervisor.core.training_state import shared_entries
from torchsupervisor.core.tree import decode_tree, encode_tree
from torchsupervisor.distributed.attempt import DEFAULT_TIMEOUT_SECS, attempt_namespace
from torchsupervisor.distributed.env import communication_device, store_outlives_attempts
from torchsupervisor.distributed.liveness import LIVENESS_SECS, ProcessRecords
from torchsupervisor.errors import (
    AbortedError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    ReplicaAbort,
    ReplicaGoneError,
)

if TYPE_CHECKING:
    from torchsupervisor.core.global_step import GlobalStepLike

__all__ = [
    "ReplicaAbort",
    "ReplicaGroup",
    "StopAgreement",
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
        return "torchsupervisor/"
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
            attempt = "torchsupervisor/"
        self.rank = int(rank or 0)
        self.world_size = int(world_size or 1)
        self.chief_rank = chief_rank
        self._prefix = f"{attempt}{generation}/"
        self._store = store
        self.clock = clock or REAL_CLOCK
        self.processes = ProcessRecords(store, f"{attempt}process/", self.rank)
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


_GONE = "-1"
"""The step count a rank posts when it leaves with an error: the others do not wait for it."""


class StopAgreement:
    """Agree on the step at which every rank stops, without a collective per step.

    A rank that wants to stop records why in the store (the first reason is kept); the poller
    thread of every rank sees it, marks the stop as pending, then posts how many steps its
    rank has completed. ``stop_step`` returns ``max(posted) + 1``.

    Args:
        group: The session's ``ReplicaGroup``.
        global_step: The global step (completed steps).
        poll_secs: How often the background thread looks at the store.

    Thread safety: ``request`` and ``stop_step`` on the training thread; the poller thread
    only sets flags and posts.
    Distributed: every rank creates one per session; the reason of the first rank that asked
    is logged on every other rank (the root cause when that rank failed).
    """

    def __init__(
        self, group: ReplicaGroup, global_step: GlobalStepLike, poll_secs: float = 0.25
    ) -> None:
        self._group = group
        self._store = group._store
        self._global_step = global_step
        self._poll_secs = poll_secs
        self.pending = False
        """True once a stop was requested by some rank (set by the poller)."""
        self._requested = False
        self._reported = False
        self._report_lock = threading.Lock()
        self._post_lock = threading.Lock()
        self._gone = False
        self._stop_at: int | None = None
        self._closed = threading.Event()
        self.poller = threading.Thread(
            target=self._poll, name="torchsupervisor-stop-agreement", daemon=True
        )
        """The thread that polls the store; it ends once it has seen a stop, or at ``close``."""
        self.poller.start()

    def _completed(self) -> int:
        return 0 if self._global_step is None else read_step(self._global_step)

    def request(self, reason: str, *, failed: bool = False) -> None:
        """Ask every rank to stop (idempotent; the first rank's reason is kept).

        Args:
            reason: Why, for the logs of the other ranks (``"<ErrorType>: <message>"`` for
                an error).
            failed: This rank leaves with an error and takes no more steps: the others stop
                at once, and if its reason is the first, ``peer_failure()`` gives it to them.
        """
        if self._requested:
            return
        self._requested = True
        rank = self._group.rank
        mine = f"rank {rank}: {reason}"
        try:
            if failed:
                self._store.set(self._group.key(f"failed/{rank}"), mine)
                with self._post_lock:
                    self._gone = True
                    self._store.set(self._group.key(f"progress/{rank}"), _GONE)
            first = self._store.compare_set(self._group.key("stop"), "", mine).decode("utf-8")
        except (RuntimeError, OSError) as e:  # The store went away with rank 0.
            logger.warning("Stop agreement: the store is unreachable (%s)", e)
            return
        if first != mine:
            self._report(first)

    def _report(self, first: str) -> None:
        """Log the stop another rank asked for (once; from either thread)."""
        with self._report_lock:
            if self._reported or first.startswith(f"rank {self._group.rank}: "):
                return
            self._reported = True
        logger.warning("Every rank stops: %s", first)

    def peer_failure(self) -> str | None:
        """The first reason to stop, if another rank gave it and left with an error.

        Read from the store (not from the poller), so it is known as soon as this rank
        stops. None: no stop, this rank's own reason, a plain stop request, or no store.
        """
        try:
            first = self._group.flag("stop")
            if first is None or first.startswith(f"rank {self._group.rank}: "):
                return None
            rank = first.split(":", 1)[0].removeprefix("rank ")
            return first if self._group.flag(f"failed/{rank}") == first else None
        except (RuntimeError, OSError):  # The store went away with rank 0.
            return None

    def _poll(self) -> None:
        key = self._group.key("stop")
        while not self._closed.wait(self._poll_secs):
            try:
                if self._store.check([key]):
                    # Pending first, then post: the training thread looks at ``pending`` at
                    # every ``should_stop()``, so it completes at most one step after the
                    # count it posts (docs/distributed.md).
                    self.pending = True
                    with self._post_lock:
                        if not self._gone:
                            self._store.set(
                                self._group.key(f"progress/{self._group.rank}"),
                                str(self._completed()),
                            )
                    self._report(self._store.get(key).decode("utf-8"))
                    return
            except (RuntimeError, OSError) as e:  # The store went away with rank 0.
                logger.warning("Stop agreement: the store is unreachable (%s); stopping", e)
                self.pending = True
                return

    def stop_step(self, timeout_secs: float = 60.0) -> int | None:
        """The number of completed steps at which every rank stops (blocks until known).

        Returns:
            The step, or None (then this rank stops at once) if a rank left with an error
            (``request(..., failed=True)``: another step would wait for it in a collective),
            is gone (``liveness``) or the other ranks did not answer within
            ``timeout_secs``.
        """
        if self._stop_at is not None:
            return self._stop_at
        keys = [self._group.key(f"progress/{r}") for r in range(self._group.world_size)]
        clock = self._group.clock
        deadline = look = clock.monotonic()
        deadline += timeout_secs
        try:
            while not self._store.check(keys):
                now = clock.monotonic()
                if now > deadline:
                    logger.error("Stop agreement: not every rank answered; stopping now")
                    return None
                if now >= look:  # A rank whose process is gone never answers.
                    look = now + LIVENESS_SECS
                    gone = self._group.processes.gone(self._group.missing("progress"))
                    if gone:
                        logger.error("Stop agreement: rank(s) %s are gone; stopping now", gone)
                        return None
                clock.sleep(0.01)
            posted = [int(self._store.get(k)) for k in keys]
        except (RuntimeError, OSError) as e:
            logger.warning("Stop agreement: the store is unreachable (%s); stopping now", e)
            return None
        if int(_GONE) in posted:
            # A rank left with an error: another step would wait in its collectives.
            gone = [rank for rank, count in enumerate(posted) if count == int(_GONE)]
            logger.warning("Stop agreement: rank(s) %s left with an error; stopping now", gone)
            return None
        self._stop_at = max(posted) + 1
        logger.info("Every rank stops after %d steps", self._stop_at)
        return self._stop_at

    def reached(self, step: int | None) -> bool:
        """Whether this rank stops now, having completed ``step`` steps: a stop is pending
        and this rank completed the agreed number of steps, or no number can be agreed on
        (``stop_step`` returned None: it stops at once). Blocks as ``stop_step`` does."""
        if not self.pending:
            return False
        stop_at = self.stop_step()
        return stop_at is None or step is None or step >= stop_at

    @property
    def agreed_step(self) -> int | None:
        """The step every rank stops at, once ``stop_step`` returned it (None before, and
        after a stop without agreement: a rank that left with an error, no answer)."""
        return self._stop_at

    def close(self) -> None:
        """Stop the poller thread."""
        self._closed.set()
        self.poller.join(10)
