"""One fresh store namespace per ``torchrun`` restart attempt, agreed by every rank.

Under ``torchrun`` (c10d rendezvous) the workers share the agents' TCP store, and that store
outlives a restart: after ``--max-restarts`` restarts a group, it still holds the keys the dead
workers published (gloo's peer addresses among them), and a new worker that reads them
connects to a dead process ("Connection refused"). ``TORCHELASTIC_RESTART_COUNT`` cannot name
the attempt on several nodes: each agent counts only its own workers' failures, so after one
node's worker dies the nodes disagree (pytorch/pytorch#135712, #108158).

The ranks therefore agree on a namespace through the store itself, relying on one fact of the
rendezvous: every worker of an attempt starts after every worker of the previous attempt has
stopped (an agent stops its workers before it joins the next round, and a round completes only
when every agent has joined). Rank 0 deletes the "hello" keys (any left there are from dead
workers), draws a random token, and answers each rank's hello; every other rank posts a hello
holding a nonce of its own, again and again until the answer for that nonce appears. No rank
can read a stale answer (its nonce is new) and rank 0 never answers a stale hello (it deleted
them before reading).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from torchsupervisor.errors import DeadlineExceededError

__all__ = ["DEFAULT_TIMEOUT_SECS", "attempt_namespace"]

_PREFIX = "torchsupervisor/attempt/"
POLL_SECS = 0.05
# How long ranks wait for each other by default: torch's default for a process group.
DEFAULT_TIMEOUT_SECS = 1800.0


def attempt_namespace(
    store: Any, rank: int, world_size: int, timeout_secs: float, poll_secs: float = POLL_SECS
) -> str:
    """The store prefix this attempt's ranks share: the same on every rank, new each attempt.

    Args:
        store: The agents' store (a ``torch.distributed.Store``: ``set``, ``get``, ``check``,
            ``delete_key``).
        rank: This process's rank, 0 to ``world_size - 1``.
        world_size: The number of ranks in this attempt.
        timeout_secs: How long to wait for the other ranks (seconds).
        poll_secs: How often a rank looks for the others' keys (seconds).

    Returns:
        A prefix such as ``"torchsupervisor/attempt/<32 hex digits>/"``.

    Raises:
        DeadlineExceededError: The other ranks did not answer within ``timeout_secs``
            (``"Session was not ready after waiting N secs."``, naming the ranks missing).
    """
    deadline = time.monotonic() + timeout_secs
    if rank == 0:
        token = _answer_every_hello(store, world_size, deadline, timeout_secs, poll_secs)
    else:
        token = _hello_until_answered(store, rank, deadline, timeout_secs, poll_secs)
    return f"{_PREFIX}{token}/"


def _answer_every_hello(
    store: Any, world_size: int, deadline: float, timeout_secs: float, poll_secs: float
) -> str:
    for other in range(1, world_size):
        store.delete_key(f"{_PREFIX}hello/{other}")
    token = uuid.uuid4().hex
    waiting = list(range(1, world_size))
    while waiting:
        for other in list(waiting):
            key = f"{_PREFIX}hello/{other}"
            if store.check([key]):
                nonce = store.get(key).decode()
                store.set(f"{_PREFIX}answer/{nonce}", token)
                waiting.remove(other)
        if waiting:
            _wait_or_give_up(deadline, timeout_secs, poll_secs, f"ranks {waiting} did not join")
    return token


def _hello_until_answered(
    store: Any, rank: int, deadline: float, timeout_secs: float, poll_secs: float
) -> str:
    nonce = uuid.uuid4().hex
    answer = f"{_PREFIX}answer/{nonce}"
    while True:
        # Again each time: rank 0 deletes the hellos it finds when it starts, maybe this one.
        store.set(f"{_PREFIX}hello/{rank}", nonce)
        if store.check([answer]):
            token = store.get(answer).decode()
            store.delete_key(answer)
            return token
        _wait_or_give_up(deadline, timeout_secs, poll_secs, "rank 0 did not answer")


def _wait_or_give_up(deadline: float, timeout_secs: float, poll_secs: float, why: str) -> None:
    if time.monotonic() >= deadline:
        raise DeadlineExceededError(
            None, None, f"Session was not ready after waiting {timeout_secs:g} secs ({why})."
        )
    time.sleep(poll_secs)
