"""Whether another rank's process is gone, where a waiting rank can tell: on its own machine.

A rank that waits in the store for another (a non-chief for the chief's word at a start, every
rank for the others' posts) waited until its deadline, or until torchrun, having seen a worker
die, sent it SIGTERM and then SIGKILL 30 s later: a rank killed in the first seconds of a
start cost every restart half a minute. Each rank now records where its process runs
(``ProcessIdentity``: this boot of the kernel, its pid namespace, its pid) in the store when
it makes its ``ReplicaGroup``; a waiting rank looks about once a second, and a rank whose
process ran in the same pid namespace of the same boot and no longer exists (or is a zombie)
ends the wait at once (``AbortedError``).

The record is written when ``connect`` has formed the group (a rank that dies before its
first ``ReplicaGroup``, while it builds its model, is seen gone too), and again by each
``ReplicaGroup`` (a group that ``connect`` did not make; under torchrun's shared store, in the
namespace of the restart attempt the ranks agree on at their first group).

A rank on another machine cannot be looked up: its wait runs to its deadline (or the
launcher's signals), except in a stop agreement, whose pollers beat in the store
(``stop_agreement``). A rank that died before it recorded itself: the same.

TF name: none.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["LIVENESS_SECS", "ProcessIdentity", "ProcessRecords", "process_gone", "records_prefix"]

LIVENESS_SECS = 1.0
"""How often a waiting rank looks whether the ranks it waits for are gone (seconds)."""

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class ProcessIdentity:
    """Where a process runs: what another process needs to tell whether it still exists.

    Attributes:
        boot: This boot of the kernel (``/proc/sys/kernel/random/boot_id``; "" off Linux).
        pid_namespace: The inode of its pid namespace (containers on one kernel differ).
        pid: Its pid in that namespace.
    """

    boot: str
    pid_namespace: int
    pid: int

    @classmethod
    def current(cls) -> ProcessIdentity:
        """This process's identity."""
        try:
            with open(_BOOT_ID, encoding="ascii") as f:
                boot = f.read().strip()
            namespace = os.stat("/proc/self/ns/pid").st_ino
        except OSError:  # Not Linux: no pid is ever checked (``same_place`` is False).
            boot, namespace = "", 0
        return cls(boot, namespace, os.getpid())

    def encode(self) -> str:
        """As stored (JSON)."""
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str) -> ProcessIdentity | None:
        """The identity ``encode`` gave, or None for a value it did not write."""
        try:
            fields = json.loads(text)
            return cls(str(fields["boot"]), int(fields["pid_namespace"]), int(fields["pid"]))
        except (ValueError, TypeError, KeyError):
            return None

    def same_place(self, other: ProcessIdentity) -> bool:
        """Whether this process can look up ``other``'s pid: same boot and pid namespace."""
        return bool(self.boot) and (self.boot, self.pid_namespace) == (
            other.boot,
            other.pid_namespace,
        )


def process_gone(identity: ProcessIdentity, here: ProcessIdentity | None = None) -> bool:
    """Whether the process ``identity`` names is known to be gone: it runs where this one
    (``here``, default: this process) can see its pid, and that pid no longer exists or is a
    zombie (killed, not yet reaped by its launcher). False whenever it cannot be told."""
    here = here or ProcessIdentity.current()
    if not here.same_place(identity) or identity.pid == here.pid:
        return False
    try:
        with open(f"/proc/{identity.pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    state = stat.rsplit(b")", 1)[-1].split()[:1]  # The field after the command's name.
    return state in ([b"Z"], [b"X"])


def records_prefix(namespace: str) -> str:
    """Where the ranks' records go in a store, under the library's ``namespace`` of it."""
    return f"{namespace}process/"


class ProcessRecords:
    """Each rank's ``ProcessIdentity`` in a store, under ``prefix`` (one record per rank).

    Args:
        store: A ``torch.distributed.Store`` every rank shares.
        prefix: Where the records go (a restart attempt's namespace: a record of a process
            of an earlier attempt is never read).
        rank: This rank, whose record ``__init__`` writes.

    Thread safety: as the store client.
    """

    def __init__(self, store: Any, prefix: str, rank: int) -> None:
        self._store = store
        self._prefix = prefix
        self.here = ProcessIdentity.current()
        self._known: dict[int, ProcessIdentity] = {}  # A record never changes once written.
        store.set(self.key(rank), self.here.encode())

    def key(self, rank: int) -> str:
        """The store key of ``rank``'s record."""
        return f"{self._prefix}{rank}"

    def gone(self, ranks: list[int]) -> list[int]:
        """The ranks among ``ranks`` whose process is known to be gone
        (``process_gone``); a rank elsewhere, or without a record yet, is never in it."""
        found = []
        for rank in ranks:
            identity = self._known.get(rank)
            key = self.key(rank)
            if identity is None and self._store.check([key]):
                identity = ProcessIdentity.decode(self._store.get(key).decode("utf-8"))
                if identity is not None:
                    self._known[rank] = identity
            if identity is not None and process_gone(identity, self.here):
                found.append(rank)
        return found
