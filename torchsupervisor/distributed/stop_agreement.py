"""Every rank stops at the same step: ``StopAgreement``, through the process group's store.

A rank that wants to stop sets a flag in the store. A thread on every rank polls the flag; a
rank that sees it posts the number of steps it has completed, and every rank stops once it has
completed ``max(posted) + 1`` steps. That is the first step no rank had started when it posted,
so every rank reaches it and none has to wait in a collective for a rank that already stopped.
The poller marks the stop as pending *before* it posts, so that the training thread, which
checks the mark at every ``should_stop()``, finishes at most one step between the post and its
first look (see ``docs/distributed.md``). A rank that leaves with an error says so: the others
stop at once (another step would wait for it in a collective) and end with ``AbortedError``.

A rank that never posts does not hold the others beyond a deadline, and most often not that
long: a rank whose process on this machine is gone (``liveness``) is seen within about a
second; a rank on any machine whose poller stopped beating is seen within
``HEARTBEAT_STALE_SECS``. The poller adds one to the rank's counter in the store at every poll
(a beat: one more store operation every ``poll_secs``, 0.25 s); a waiting rank reads the
counters of the ranks it waits for and, by its own clock (no two machines' clocks are ever
compared), takes a counter that has not moved for that long as a rank that is gone (killed
with its node, or a session closed without a post). A rank that never beat (its session not
started yet) is waited for until the deadline.

Thread safety: ``request``, ``stop_step`` and ``reached`` on the training thread; the poller
thread only sets flags, beats and posts.
Distributed: every rank creates one per session (the same ``ReplicaGroup`` key namespace).

TF name: none.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from torchsupervisor.core.global_step import read_step
from torchsupervisor.distributed.liveness import LIVENESS_SECS
from torchsupervisor.distributed.replicas import ReplicaGroup

if TYPE_CHECKING:
    from torchsupervisor.core.global_step import GlobalStepLike

__all__ = ["HEARTBEAT_STALE_SECS", "StopAgreement"]

logger = logging.getLogger("torchsupervisor")

HEARTBEAT_STALE_SECS = 5.0
"""A rank that beat before and whose beat counter has not moved for this long (seconds, by
the waiting rank's clock) is gone: 20 polls missed at the default 0.25 s."""


_GONE = "-1"
"""The step count a rank posts when it leaves with an error: the others do not wait for it."""


class StopAgreement:
    """Agree on the step at which every rank stops, without a collective per step.

    A rank that wants to stop records why in the store (the first reason is kept); the poller
    thread of every rank sees it, marks the stop as pending, then posts how many steps its
    rank has completed. ``stop_step`` returns ``max(posted) + 1`` (module docstring).

    Args:
        group: The session's ``ReplicaGroup``.
        global_step: The global step (completed steps).
        poll_secs: How often the background thread looks at the store.

    Thread safety: ``request`` and ``stop_step`` on the training thread; the poller thread
    only sets flags, beats and posts.
    Distributed: every rank creates one per session; the reason of the first rank that asked
    is logged on every other rank (the root cause when that rank failed).

    TF name: none.
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
        self._beats: dict[int, tuple[int, float]] = {}  # Rank: its count, when it last moved.
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
        beat = self._group.key(f"beat/{self._group.rank}")
        while True:
            try:
                self._store.add(beat, 1)
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
            if self._closed.wait(self._poll_secs):
                return

    def _silent(self, ranks: list[int], now: float) -> list[int]:
        """The ranks among ``ranks`` that beat before and not for ``HEARTBEAT_STALE_SECS``
        (``now``: this rank's clock); each rank's count is read from the store."""
        silent = []
        for rank in ranks:
            count = self._group.add(f"beat/{rank}", 0)
            seen = self._beats.get(rank)
            if seen is None or seen[0] != count:
                self._beats[rank] = (count, now)
            elif count > 0 and now - seen[1] >= HEARTBEAT_STALE_SECS:
                silent.append(rank)
        return silent

    def stop_step(self, timeout_secs: float = 60.0) -> int | None:
        """The number of completed steps at which every rank stops (blocks until known).

        Returns:
            The step, or None (then this rank stops at once) if a rank left with an error
            (``request(..., failed=True)``: another step would wait for it in a collective),
            is gone (its process on this machine, ``liveness``; its beats, on any machine) or
            the other ranks did not answer within ``timeout_secs``.
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
                    missing = self._group.missing("progress")
                    gone = self._group.processes.gone(missing)
                    if gone:
                        logger.error("Stop agreement: rank(s) %s are gone; stopping now", gone)
                        return None
                    silent = self._silent(missing, now)
                    if silent:
                        logger.error(
                            "Stop agreement: rank(s) %s have not answered nor beaten for %.0f s "
                            "(gone, on another machine?); stopping now",
                            silent,
                            HEARTBEAT_STALE_SECS,
                        )
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
