"""Checkpoints of a sharded state (FSDP2 / DTensor) taken by every replica at the same step.

With a sharded state no rank holds the whole model, so a checkpoint is a collective: every rank
saves (``Saver.save_async``, ``sharded.write_sharded``) at the same step and writes its own
shard in parallel. A periodic checkpoint blocks training only while each rank copies its local
shards into host buffers; the writer threads then write, agree and commit through a process
group of their own, while training goes on. The explicit (``save_now``) and final checkpoints
are written before they return.

The difficulty is to make every rank save at the same step without a collective on every
step. ``ShardedCheckpointService`` mirrors ``stop_agreement.StopAgreement`` and talks only
through the process group's key-value store:

1. **Request.** The chief's timer (``request``, every ``save_model_secs``) increments the
   counter ``save/requests`` in the store: request ``n``.
2. **Announce.** A poller thread on every rank (the chief's included) notices request ``n``. It
   FIRST queues a task on the session's ``StepBoundary`` (run by the training thread at its
   next step boundary: the entry of ``Session.run`` or ``Supervisor.should_stop``) and THEN
   posts the number of steps this rank has completed, ``c_r``.
3. **Agree.** The task, at a boundary, waits until every rank has posted (they are posted by
   the pollers, not by training threads, so this takes at most a poll interval) and computes
   ``A = max(c_r) + 1``. It re-queues itself at every boundary until this rank has completed
   ``A`` steps.
4. **Vote.** At step ``A`` each rank posts a vote: ``save``, ``same`` (its last checkpoint,
   written or restored, is already at step ``A``) or ``no: <why>``. The first rank that sees
   every vote (or a veto, or its deadline passing) records the decision with an atomic
   compare-and-set; every rank follows that single recorded decision. So the skip rule (a
   checkpoint at the step of the last one is skipped) is applied identically everywhere:
   ``save`` only if every rank voted ``save``, nothing if every rank voted ``same``, and a
   logged skip for any mix. No rank can enter the collective save unless every rank will.
5. **Save.** On ``save`` every rank starts its save (the copy of its local shards; a
   checkpoint still being written was waited for before the vote, so one is in flight at a
   time); the chief writes the ``SessionLog.CHECKPOINT`` event and flushes the summary writer
   once it is committed. A failure on any rank fails it on every rank (``on_error``).

Why no rank can pass step ``A`` before its task runs (the ordering argument). Take rank ``r``
and let its poller queue the task at time ``t1`` and read ``c_r`` at ``t2 > t1``. At ``t2``
rank ``r`` has completed ``c_r`` steps; the training thread runs one step at a time, so at
most one step (the ``c_r + 1``-th) can have begun before ``t1`` and still be running. Every
other step begins after a step boundary that comes after ``t1``, and a boundary runs every
task queued before it. Hence the task first runs when rank ``r`` has completed at most
``c_r + 1 <= max(c) + 1 = A`` steps, and from then on it runs at every boundary (it re-queues
itself) until it sees exactly ``A``: the global step grows by one per step and every step is
preceded by a boundary. Posting before queuing would break this: the training thread could run
several steps between the read and the queuing. The argument needs two things from the loop,
both true of ``while not sv.should_stop(): sess.run(step)``: a boundary between two steps, and
a global step that grows by one per step. A rank that finds itself past ``A`` (a loop that
steps without boundaries) votes ``no`` and nobody saves.

The final checkpoint (``final``) uses the same vote: all ranks stopped at the same step (the
stop agreement), a rank whose session failed raises the ``nosave`` flag instead of voting, and
the others wait at most ``stop_grace_secs`` (or what is left of a preemption's grace period)
for the votes. Requests still pending at the stop are resolved first: one whose agreed step is
the stop step saves there; a later one is dropped.

Distributed: every rank of the process group runs one service per session; only the chief's
timer issues requests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.coordinator import Coordinator, LooperThread
from torchsupervisor.core.global_step import read_step
from torchsupervisor.core.session import Session
from torchsupervisor.distributed.replicas import ReplicaAbort, ReplicaGroup
from torchsupervisor.driver.checkpoint_driver import CheckpointDriver
from torchsupervisor.errors import CheckpointSaveError, DeadlineExceededError

__all__ = ["DEFAULT_AGREEMENT_SECS", "ShardedCheckpointService", "veto_checkpoints"]

logger = logging.getLogger("torchsupervisor")

DEFAULT_AGREEMENT_SECS = 300.0
"""How long a rank waits for the others to answer a checkpoint request or vote, in seconds."""

_NOSAVE = "save/nosave"
_SAVE = "save"
_SAME = "same"
_SKIP = "skip: "
_NO_VOTE = "not every rank voted"


class _SaveTask:
    """One checkpoint request, as seen by one rank: queued on the boundary by the poller."""

    __slots__ = ("agreed", "done", "number", "posted", "service")

    def __init__(self, service: ShardedCheckpointService, number: int) -> None:
        self.service = service
        self.number = number
        self.posted: int | None = None  # The step count this rank posted (set by the poller).
        self.agreed: int | None = None  # The agreed step, once every rank has posted.
        self.done = False

    def __call__(self) -> None:
        if not self.done:
            self.service._advance(self, final=False)


class ShardedCheckpointService:
    """Every rank saves its shard of a sharded state at the same agreed step.

    Args:
        sess: This rank's session (its boundary runs the agreement and the save).
        driver: This rank's ``CheckpointDriver``: its saver (``save`` of a state of DTensors
            is a collective), its prefix without step (the same on every rank, e.g.
            ``logdir/model.ckpt``), its global step (required), its writer of CHECKPOINT
            events (the chief's; None on the others), its ``on_error`` (called with a
            ``CheckpointSaveError`` after it was logged; the Supervisor stops training with
            it when ``stop_on_checkpoint_error``) and the step of a checkpoint restored.
        group: The session's ``ReplicaGroup`` (store keys of this session).
        start: Starts the background save of a periodic checkpoint at the agreed step
            (called on the training thread with the step; ``CheckpointSaverHook`` calls its
            listeners around it); None: ``driver.start``.
        poll_secs: How often the poller looks for requests, in seconds.
        agreement_secs: How long to wait for the other ranks' answers and votes of a
            periodic or explicit checkpoint, in seconds.
        clock: Time for the agreement's deadlines and polls; None: the real clock.

    Raises:
        ValueError: If the driver has no global step.

    Thread safety: ``request`` on the chief's timer thread; the poller on its own thread only
    queues tasks and posts; ``save_now``, ``final`` and the tasks run on the training thread.
    Distributed: one per rank and session, created in the same order on every rank.

    TF name: none (TF's chief saved the parameter servers' variables alone).
    """

    def __init__(
        self,
        sess: Session,
        driver: CheckpointDriver,
        group: ReplicaGroup,
        *,
        start: Callable[[int], object] | None = None,
        poll_secs: float = 0.1,
        agreement_secs: float = DEFAULT_AGREEMENT_SECS,
        clock: Clock | None = None,
    ) -> None:
        if driver.global_step is None:
            raise ValueError("Sharded checkpoints of replicas need a global step to agree on")
        self._sess = sess
        self.driver = driver
        """Saves and reports (the chief's writes the events too); this service decides the
        step."""
        self._group = group
        self._start = start or (lambda step: driver.start(sess, step))
        self._poll_secs = poll_secs
        self._agreement_secs = agreement_secs
        self._clock = clock or REAL_CLOCK
        self._lock = threading.Lock()
        self._tasks: dict[int, _SaveTask] = {}
        self._seen = 0  # Requests announced by this rank's poller.
        self._issued = 0  # (Chief) requests issued.
        self._served = 0  # (Chief) requests resolved on this rank.
        self._explicit = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._poll, name="torchsupervisor-sharded-checkpoints", daemon=True
        )

    @property
    def last_step(self) -> int | None:
        """The step of the last checkpoint written or restored by this session (or None)."""
        return self.driver.last_step

    def start(self) -> None:
        """Start the poller thread."""
        self._thread.start()

    def close(self, wait: bool = True) -> None:
        """Stop the poller thread; pending requests are dropped.

        Args:
            wait: Wait (at most ``agreement_secs``) for a periodic checkpoint still being
                written (the other ranks write it too); False: leave it (a second Ctrl-C).
        """
        self._closed.set()
        if wait and not self.driver.wait(self._agreement_secs):
            logger.warning("Closing with a sharded checkpoint still being written")
        if self._thread.is_alive():
            self._thread.join(10)
        with self._lock:
            for task in self._tasks.values():
                task.done = True
            self._tasks.clear()

    def timer(self, coord: Coordinator, interval_secs: float) -> LooperThread:
        """(Chief) Return a thread (not started) calling ``request`` every ``interval_secs``."""
        return LooperThread(coord, interval_secs, target=self.request)

    # -------------------------------------------------------------- requests (store side)

    def request(self) -> None:
        """(Chief) Ask every rank for a checkpoint at an agreed step.

        Does nothing while the previous request is still being served on the chief, or its
        checkpoint written.
        """
        with self._lock:
            if self._served < self._issued or self.driver.in_flight:
                return
        issued = self._group.add("save/requests", 1)
        with self._lock:
            self._issued = issued

    def _completed(self) -> int:
        return read_step(self.driver.global_step)

    def _poll(self) -> None:
        # It ends with the session too (one that ended with an error is not told).
        while not self._closed.wait(self._poll_secs) and not self._sess.closed:
            try:
                latest = self._group.add("save/requests", 0)
                while self._seen < latest and not self._closed.is_set():
                    self._announce(self._seen + 1)
            except (RuntimeError, OSError) as e:  # The store went away with rank 0.
                logger.warning("Sharded checkpoints: the store is unreachable (%s)", e)
                return

    def _announce(self, number: int) -> None:
        task = _SaveTask(self, number)
        with self._lock:
            self._tasks[number] = task
        # The order of the next two statements is what the module docstring's argument
        # rests on: queue the task FIRST, THEN read the step count that is posted.
        self._sess.boundary.call_soon(task)
        completed = self._completed()
        task.posted = completed
        self._group.post(f"save/{number}/progress", completed)
        self._seen = number

    # ----------------------------------------------------- the task (training thread side)

    def _advance(self, task: _SaveTask, *, final: bool, timeout_secs: float | None = None) -> None:
        """Move ``task`` on at a boundary (or at the stop, with ``final``)."""
        timeout = self._agreement_secs if timeout_secs is None else timeout_secs
        step = self._completed()
        if task.agreed is None:
            what = f"Checkpoint request {task.number}"
            posts = self._group.collect(f"save/{task.number}/progress")
            if posts is None:
                if not final and task.posted is not None and step <= task.posted:
                    # One more step leaves this rank at or below the agreed step: no wait.
                    self._sess.boundary.call_soon(task)
                    return
                try:
                    posts = self._group.gather(
                        f"save/{task.number}/progress", timeout, what=what, abort=_NOSAVE
                    )
                except ReplicaAbort as e:
                    logger.info("%s dropped: %s", what, e.reason)
                    self._resolved(task)
                    return
            task.agreed = max(int(p) for p in posts) + 1
            logger.debug("%s: every rank saves at step %d", what, task.agreed)
        if step < task.agreed:
            if final:
                logger.info(
                    "Checkpoint request %d (at step %d) dropped: training stopped at step %d",
                    task.number,
                    task.agreed,
                    step,
                )
                self._resolved(task)
            else:
                self._sess.boundary.call_soon(task)
            return
        self._resolved(task)
        veto = None
        if step > task.agreed:
            veto = (
                f"rank {self._group.rank} is at step {step}, past the agreed step {task.agreed} "
                "(steps without a step boundary, or a global step that grows by more than one)"
            )
        try:
            self._vote_and_save(f"save/{task.number}", step, timeout, veto=veto)
        except CheckpointSaveError:
            if final:
                raise
            # Logged, reported in the event file and passed to on_error: training goes on
            # (or stops, by policy), as with the chief's background checkpoints.

    def _resolved(self, task: _SaveTask) -> None:
        task.done = True
        with self._lock:
            self._tasks.pop(task.number, None)
            self._served = max(self._served, task.number)

    # ------------------------------------------------------------------------ the vote

    def _vote_and_save(
        self, tag: str, step: int, timeout_secs: float, *, veto: str | None = None
    ) -> None:
        """A periodic checkpoint's vote; on ``save`` every rank starts its background save
        (``start``: the copy of its local shards; every rank's writer thread then writes and
        commits, and the driver reports it, ``on_error`` for a failure, on every rank)."""
        if self._vote(tag, step, timeout_secs, veto=veto):
            self._start(step)

    def _vote(self, tag: str, step: int, timeout_secs: float, *, veto: str | None = None) -> bool:
        """Vote on saving at ``step``; True if every rank agreed to save.

        The checkpoint still being written, if any, is waited for first (within
        ``timeout_secs``; a rank whose write has not ended votes no): the vote needs its
        outcome, and one save at a time is in flight.
        """
        if not self.driver.wait(timeout_secs) and veto is None:
            veto = f"rank {self._group.rank}'s previous checkpoint is still being written"
        if veto is not None:
            vote = f"no: {veto}"
        elif self.driver.unchanged(step):
            vote = _SAME
        else:
            vote = _SAVE
        self._group.post(f"{tag}/vote", {"vote": vote, "step": step})
        decision = self._decide(tag, timeout_secs)
        if decision == _SAME:
            logger.debug("Checkpoint %s skipped: step %d was already saved", tag, step)
            return False
        if decision != _SAVE:
            logger.warning("Checkpoint at step %d not taken: %s", step, decision[len(_SKIP) :])
            return False
        return True

    def _decide(self, tag: str, timeout_secs: float) -> str:
        group = self._group
        deadline = self._clock.monotonic() + timeout_secs
        decision_key = f"{tag}/decision"
        while True:
            decided = group.flag(decision_key)
            if decided is not None:
                return decided
            vetoed = group.flag(_NOSAVE)
            votes = group.collect(f"{tag}/vote")
            if vetoed is not None:
                proposal = _SKIP + vetoed
            elif votes is not None:
                proposal = _combine(votes)
            elif self._clock.monotonic() > deadline:
                missing = group.missing(f"{tag}/vote")
                proposal = f"{_SKIP}{_NO_VOTE} within {timeout_secs:g} s: rank(s) {missing}"
            else:
                self._clock.sleep(0.01)
                continue
            return group.decide(decision_key, proposal)

    def _save(self, step: int) -> str | None:
        """Every rank saves its shard (a collective); the driver reports it."""
        try:
            return self.driver.save(self._sess, step)
        except CheckpointSaveError as e:
            if self.driver.on_error is not None:
                self.driver.on_error(e)
            raise

    # ---------------------------------------------------------------- training-thread API

    def agree_now(self) -> bool:
        """Vote on a checkpoint at the current step now; every rank must call it at the same
        step. The caller saves (``driver.save`` or ``driver.start``: a collective) when it
        returns True, on every rank.

        Returns:
            True if every rank voted to save; False when skipped (the step was already
            saved, or a rank vetoed).

        Raises:
            DeadlineExceededError: If not every rank called it within ``agreement_secs``.
        """
        self._explicit += 1
        step = self._completed()
        tag = f"explicit/{self._explicit}"
        agreed = self._vote(tag, step, self._agreement_secs)
        decision = self._group.flag(f"{tag}/decision") or ""
        if decision.startswith(_SKIP + _NO_VOTE):
            raise DeadlineExceededError(
                None,
                None,
                f"checkpoint(): not every rank called it at step {step} within "
                f"{self._agreement_secs:g} s",
            )
        return agreed

    def save_now(self) -> str | None:
        """Save at the current step now; every rank must call it at the same step.

        Returns:
            The prefix, or None when skipped (the step was already saved, or a rank vetoed).

        Raises:
            DeadlineExceededError: If not every rank called it within ``agreement_secs``.
            CheckpointSaveError: If writing failed (on every rank).
        """
        return self._save(self._completed()) if self.agree_now() else None

    def veto(self, reason: str) -> None:
        """Tell every rank that this rank will not save again in this session
        (``veto_checkpoints``)."""
        veto_checkpoints(self._group, reason)

    def agree_final(self, timeout_secs: float, budget_secs: float | None = None) -> bool:
        """The vote on the final checkpoint of a clean stop: every rank saves or none does.

        Requests still pending are resolved first (one agreed at this step saves now; a later
        one is dropped); then every rank votes. The caller saves (``driver.save``, on every
        rank) when it returns True.

        Args:
            timeout_secs: Longest wait for the other ranks' votes (``stop_grace_secs``).
            budget_secs: What a preemption leaves for the final checkpoint, in seconds; a
                rank whose last save took longer than what is left votes no. A save in
                progress cannot be abandoned (it is a collective). None: no budget.

        Returns:
            True if every rank voted to save.

        Raises:
            CheckpointSaveError: If a pending periodic checkpoint failed to start.
        """
        start = self._clock.monotonic()

        def left() -> float:
            spent = self._clock.monotonic() - start
            limit = timeout_secs if budget_secs is None else min(timeout_secs, budget_secs)
            return max(0.0, limit - spent)

        with self._lock:
            pending = sorted(self._tasks.values(), key=lambda t: t.number)
        try:
            for task in pending:
                if not task.done:
                    self._advance(task, final=True, timeout_secs=left())
        except DeadlineExceededError as e:
            logger.error("No final checkpoint: %s", e)
            self.veto(str(e))
            return False
        step = self._completed()
        veto = None
        if budget_secs is not None:
            last = getattr(self.driver.saver, "last_save", None)
            remaining = budget_secs - (self._clock.monotonic() - start)
            if last is not None and last.total_secs > remaining:
                veto = (
                    f"rank {self._group.rank}'s last save took {last.total_secs:.1f} s and "
                    f"{remaining:.1f} s of the preemption grace period are left"
                )
        return self._vote("final", step, left(), veto=veto)

    def final(self, timeout_secs: float, budget_secs: float | None = None) -> str | None:
        """Save the final checkpoint of a clean stop, together with every rank or not at all
        (``agree_final``, then the collective save).

        Returns:
            The prefix, or None when nothing was saved.

        Raises:
            CheckpointSaveError: If writing failed (on every rank).
        """
        if not self.agree_final(timeout_secs, budget_secs):
            return None
        return self._save(self._completed())


def veto_checkpoints(group: ReplicaGroup, reason: str) -> None:
    """Tell every rank of ``group`` that this rank will not save again in this session.

    Called by a rank whose session failed: the others skip the checkpoint they may be voting
    on, and the final one, at once instead of waiting for this rank.

    Args:
        group: The session's ``ReplicaGroup``.
        reason: Why, for the others' logs (prefixed with this rank).
    """
    try:
        group.raise_flag(_NOSAVE, f"rank {group.rank}: {reason}")
    except (RuntimeError, OSError) as e:
        logger.warning("Could not tell the other replicas not to save: %s", e)


def _combine(votes: list[dict[str, Any]]) -> str:
    """The decision for a full set of votes (the same on every rank)."""
    steps = {v["step"] for v in votes}
    kinds = [v["vote"] for v in votes]
    if len(steps) > 1:
        return f"{_SKIP}the ranks are at different steps {[v['step'] for v in votes]}"
    if all(k == _SAVE for k in kinds):
        return _SAVE
    if all(k == _SAME for k in kinds):
        return _SAME
    reasons = [f"rank {r}: {k}" for r, k in enumerate(kinds) if k != _SAVE]
    return _SKIP + "; ".join(reasons)
