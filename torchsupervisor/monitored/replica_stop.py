"""The stops of a ``MonitoredSession`` under DDP that every rank agrees on.

A stop that one rank alone sees (a preemption signal or notice, ``request_stop()`` from
another thread) used to end that rank's loop at its next ``should_stop()`` while the others
went on into the next step, whose collectives then waited for it: a signal to one rank left
the others failing in their all-reduce (a worker's signal cost the chief its final checkpoint),
and even a signal to every rank at once could land on either side of a step boundary. With a
replica group (``master="env://"``, rank 0 the chief), the session creators make a
``ReplicaStop`` at the first session of each rank: such a stop goes through the Supervisor's
``StopAgreement`` (the store, no collective per step), and every rank stops after the same
number of steps; there every rank sends its random streams to the chief
(``ReplicaStreams.gather``), so that the chief's final checkpoint (and its memory tier's
snapshot of the stop) resume every rank bitwise. A stop that every rank sees at the same
step by itself (a ``StopAtStepHook``, the end of the input on every rank) is not delayed: it
ends each rank's loop where the hooks say, as in TF.

A rank that leaves with an error records it (``end``): the others stop at their next
``should_stop()`` and name it in their logs.

Thread safety: the training thread (``should_stop``, ``end``).
Distributed: every rank of a replicated ``MonitoredSession`` makes one, at its first session.

TF name: none (TF's replicas had no stop agreement).
"""

from __future__ import annotations

from torchsupervisor.core.global_step import GlobalStepLike, read_step
from torchsupervisor.distributed.replica_streams import ReplicaStreams
from torchsupervisor.distributed.replicas import ReplicaGroup
from torchsupervisor.distributed.stop_agreement import StopAgreement
from torchsupervisor.driver.sharded_checkpoints import veto_checkpoints

__all__ = ["ReplicaStop"]


class ReplicaStop:
    """The agreed stop of one rank's ``MonitoredSession`` (module docstring).

    Args:
        group: The replica group of the session creators' first session.
        global_step: The global step (the agreement counts completed steps).
        streams: This rank's ``ReplicaStreams`` (gathered at the agreed step), or None.
        saves_together: Every rank saves each checkpoint (a sharded state): a rank that
            leaves with an error also vetoes the checkpoints (``veto_checkpoints``), so that
            the others do not wait for its vote.
    """

    def __init__(
        self,
        group: ReplicaGroup,
        global_step: GlobalStepLike | None,
        streams: ReplicaStreams | None,
        saves_together: bool = False,
    ) -> None:
        self.agreement = StopAgreement(group, global_step)
        self.group = group
        self.saves_together = saves_together
        self.global_step = global_step
        self.streams = streams
        self.stopped = False
        """True once this rank reached the agreed step (``should_stop`` stays True)."""

    def should_stop(self, requested: bool, reason: str) -> bool:
        """Whether this rank stops now: True once every rank agreed on a step and this rank
        completed it (or at once, when a rank left with an error or did not answer).

        Args:
            requested: This rank wants to stop (a preemption, ``request_stop()``): every
                rank is asked.
            reason: Why, for the other ranks' logs (with ``requested``).
        """
        if self.stopped:
            return True
        agreement = self.agreement
        if requested:
            agreement.request(reason)
        if not agreement.pending:  # The usual case: one attribute read a step.
            return False
        step = None if self.global_step is None else read_step(self.global_step)
        if not agreement.reached(step):
            return False
        if agreement.agreed_step is not None and self.streams is not None:
            self.streams.gather()  # Every rank, at the same step: for the final checkpoint.
        self.stopped = True
        return True

    def end(self, failure: BaseException | None) -> None:
        """At the end of the session: with ``failure`` (the error it ended with), tell the
        other ranks to stop at once (``"<ErrorType>: <message>"`` in their logs); then stop
        polling. Idempotent."""
        if failure is not None:
            reason = f"{type(failure).__name__}: {failure}"
            self.agreement.request(reason, failed=True)
            if self.saves_together:
                veto_checkpoints(self.group, f"its session ended with an error: {reason}")
        self.agreement.close()
