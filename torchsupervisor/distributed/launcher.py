"""The launcher seam: where a process learns its place in the job and finds the others.

A launcher (``torchrun``, SLURM's ``srun``) starts one process per rank and tells each, through
environment variables, its rank, the world size, its rank on its node, its node, how many
times the job was restarted, and where the ranks meet. Everything in torchsupervisor that needs
one of those asks ``current_launcher()``; nothing else reads ``RANK`` or ``SLURM_*``.

Two implementations:

* ``TorchrunLauncher`` (the default): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK``
  (the node), ``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_RUN_ID``; the ranks meet on
  ``MASTER_ADDR:MASTER_PORT``, or on the agents' store under a namespace of this restart attempt
  (``attempt.py``) when torchrun shares it (``TORCHELASTIC_USE_AGENT_STORE``). Also what a
  program that sets ``RANK``/``WORLD_SIZE`` by hand gets, and a plain single process (rank 0 of
  1).
* ``SlurmLauncher``: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``),
  ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_RESTART_COUNT`` (requeues), ``SLURM_JOB_ID``;
  the ranks meet on ``MASTER_ADDR`` (else the first host of ``SLURM_STEP_NODELIST`` or
  ``SLURM_JOB_NODELIST``, where task 0 runs) and ``MASTER_PORT`` (else a port derived from the
  job id, the same on every node), hosted by rank 0. Chosen inside a job step that ``srun``
  started (``SLURM_STEP_ID`` set) when ``RANK`` is not set: ``srun torchrun ...`` is
  torchrun's, and a program run straight from a batch script (which sees the job's
  ``SLURM_PROCID=0`` and ``SLURM_NTASKS``, but is one process) is a plain process.

``TORCHSUPERVISOR_LAUNCHER=torchrun`` or ``=slurm`` overrides the choice.

Call order: ``current_launcher()`` anywhere, at any time (it reads the environment each call;
a launcher's fields never change during a process's life). ``rendezvous`` is called once per
process, by ``env.connect`` on every rank at the same point (the first distributed session).
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from torchsupervisor.distributed.attempt import attempt_namespace
from torchsupervisor.errors import InvalidArgumentError, UnavailableError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "AGENT_STORE_WAIT_SECS",
    "LAUNCHER_ENV",
    "NAMESPACED_GROUPS",
    "SLURM_TIME_FORMAT_ENV",
    "Launcher",
    "SlurmLauncher",
    "TorchrunLauncher",
    "current_launcher",
    "first_host",
    "slurm_job_id",
]

LAUNCHER_ENV = "TORCHSUPERVISOR_LAUNCHER"
# How long a worker waits for torchrun's agent store to accept a connection (seconds). The
# rank-0 agent listens before any agent learns the address, so a store that refuses this long
# is gone, not slow.
AGENT_STORE_WAIT_SECS = 60.0
"""The environment variable that names the launcher (``torchrun`` or ``slurm``) over detection."""

# The process groups made on a rendezvous under a namespace of their attempt (``connect`` adds
# them), held weakly: nothing here may keep a group alive past ``destroy_process_group``.
NAMESPACED_GROUPS: weakref.WeakSet[Any] = weakref.WeakSet()

_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 10000  # Ports 20000-29999: below Linux's ephemeral range (32768-).


class Launcher(Protocol):
    """What a launcher tells this process (every field read once from the environment).

    Attributes:
        name: ``"torchrun"`` or ``"slurm"``.
        rank: This process's rank, 0 to ``world_size - 1``.
        world_size: The number of ranks in the job.
        local_rank: This process's rank on its node (its CUDA device, by convention).
        node_id: The index of this process's node, 0 to nodes - 1.
        restart_count: How many times the launcher restarted the job before this attempt
            (torchrun's ``--max-restarts`` count as this node's agent saw it; SLURM's requeues).
        job_id: The launcher's name for the job (torchrun's run id, SLURM's job id), or None.
        launched: Whether the launcher's variables are set (False for a plain process).

    Distributed: every rank has its own; ``world_size`` and ``job_id`` are the same on all.

    TF name: none (TF took these from ``TF_CONFIG`` and ``ClusterSpec``).
    """

    name: str
    rank: int
    world_size: int
    local_rank: int
    node_id: int
    restart_count: int
    job_id: str | None
    launched: bool

    def rendezvous(self, timeout_secs: float) -> dict[str, Any]:
        """The arguments of ``torch.distributed.init_process_group`` that make the ranks meet.

        Called once, on every rank, by ``env.connect`` for an ``env://`` master (a collective
        for the torchrun agent store's namespace).

        Args:
            timeout_secs: How long to wait for the other ranks (seconds).

        Returns:
            ``init_method`` or ``store`` with ``rank`` and ``world_size``.

        Raises:
            InvalidArgumentError: The environment does not say where the ranks meet.
            DeadlineExceededError: The other ranks did not answer in time.
        """
        ...

    def store_outlives_attempts(self, group: ProcessGroup | None) -> bool:
        """Whether ``group``'s store may hold keys of an earlier restart attempt."""
        ...


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise InvalidArgumentError(f"${name}={text!r} is not an integer") from None


@dataclass(frozen=True)
class _Placement:
    """The fields both launchers read (see ``Launcher``), and where the ranks meet."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node_id: int = 0
    restart_count: int = 0
    job_id: str | None = None
    launched: bool = False
    master_addr: str | None = None
    master_port: int | None = None


@dataclass(frozen=True)
class TorchrunLauncher(_Placement):
    """``torchrun``'s variables (and a plain process: rank 0 of 1). See the module docstring."""

    agent_store: bool = False
    name: str = "torchrun"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> TorchrunLauncher:
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK``, the restart count,
        the run id, the agent store flag and ``MASTER_ADDR:MASTER_PORT``.

        Raises:
            InvalidArgumentError: A variable that should be an integer is not.
        """
        return cls(
            rank=_int(environ, "RANK", 0),
            world_size=_int(environ, "WORLD_SIZE", 1),
            local_rank=_int(environ, "LOCAL_RANK", 0),
            node_id=_int(environ, "GROUP_RANK", 0),
            restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
            job_id=environ.get("TORCHELASTIC_RUN_ID") or None,
            launched="RANK" in environ and "WORLD_SIZE" in environ,
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            master_addr=environ.get("MASTER_ADDR") or None,
            master_port=_int(environ, "MASTER_PORT", 0) or None,
        )

    def rendezvous(self, timeout_secs: float) -> dict[str, Any]:
        """``env://``, or the agents' store under this attempt's namespace (see ``Launcher``)."""
        if not self.agent_store:
            return {"init_method": "env://"}
        if self.master_addr is None or self.master_port is None:
            raise InvalidArgumentError(
                "torchrun's agent store needs $MASTER_ADDR and $MASTER_PORT (unset here)"
            )
        _wait_for_agent_store(self.master_addr, self.master_port, AGENT_STORE_WAIT_SECS)
        timeout = datetime.timedelta(seconds=timeout_secs)
        store = dist.TCPStore(self.master_addr, self.master_port, is_master=False, timeout=timeout)
        prefix = attempt_namespace(store, self.rank, self.world_size, timeout_secs)
        return {
            "store": dist.PrefixStore(prefix, store),
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def store_outlives_attempts(self, group: ProcessGroup | None) -> bool:
        """True for a group on torchrun's shared agent store that ``connect`` did not make
        (``init_process_group`` by the program)."""
        return self.agent_store and group not in NAMESPACED_GROUPS


def _wait_for_agent_store(addr: str, port: int, within_secs: float) -> None:
    """Return once ``addr:port`` accepts a TCP connection.

    Raises:
        UnavailableError: Nothing listened there within ``within_secs`` seconds. The known
            cause, named in the message: a node that survives a lost rank-0 node keeps that
            node's store address into the next round (torch's c10d rendezvous caches it when
            the node is not rank 0 of the new round).
    """
    deadline = time.monotonic() + within_secs
    while True:
        try:
            with socket.create_connection((addr, port), timeout=5.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise UnavailableError(
                    None,
                    None,
                    f"torchrun's agent store at {addr}:{port} ($MASTER_ADDR:$MASTER_PORT) "
                    f"refused connections for {within_secs:g} s ({e}): its node is gone. "
                    "torchrun gives a node that survived a lost rank-0 node the old round's "
                    "store address; launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                    "where nodes can be lost",
                ) from e
        time.sleep(0.2)


@dataclass(frozen=True)
class SlurmLauncher(_Placement):
    """SLURM's variables (``srun``, ``sbatch``). See the module docstring."""

    name: str = "slurm"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> SlurmLauncher:
        """Read ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``),
        ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_RESTART_COUNT``, ``SLURM_JOB_ID`` and where
        the ranks meet.

        The meeting host is ``$MASTER_ADDR``, else the first host of ``$SLURM_STEP_NODELIST``
        (``$SLURM_JOB_NODELIST``, ``$SLURM_NODELIST``); the port ``$MASTER_PORT``, else 20000 +
        the job id modulo 10000.

        Raises:
            InvalidArgumentError: A variable that should be an integer is not, or a node list
                that cannot be read.
        """
        job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or None
        tasks = "SLURM_STEP_NUM_TASKS" if environ.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
        port = _int(environ, "MASTER_PORT", 0) or None
        if port is None and job_id is not None and job_id.isdigit():
            port = _SLURM_PORT_BASE + int(job_id) % _SLURM_PORT_SPAN
        nodelist = (
            environ.get("SLURM_STEP_NODELIST")
            or environ.get("SLURM_JOB_NODELIST")
            or environ.get("SLURM_NODELIST")
        )
        addr = environ.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else None)
        return cls(
            rank=_int(environ, "SLURM_PROCID", 0),
            world_size=_int(environ, tasks, 1),
            local_rank=_int(environ, "SLURM_LOCALID", 0),
            node_id=_int(environ, "SLURM_NODEID", 0),
            restart_count=_int(environ, "SLURM_RESTART_COUNT", 0),
            job_id=job_id,
            launched="SLURM_PROCID" in environ and "SLURM_NTASKS" in environ,
            master_addr=addr,
            master_port=port,
        )

    def rendezvous(self, timeout_secs: float) -> dict[str, Any]:
        """A TCP rendezvous at the meeting host and port, hosted by rank 0 (a requeued job
        starts a new one, so no key outlives an attempt)."""
        if self.master_addr is None or self.master_port is None:
            raise InvalidArgumentError(
                "Under SLURM the ranks meet at $MASTER_ADDR:$MASTER_PORT, or at the first host "
                "of $SLURM_JOB_NODELIST on a port derived from $SLURM_JOB_ID: neither is set"
            )
        return {
            "init_method": f"tcp://{self.master_addr}:{self.master_port}",
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def store_outlives_attempts(self, group: ProcessGroup | None) -> bool:
        """False: every attempt of a SLURM job starts its own rendezvous."""
        return False


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``).

    Raises:
        InvalidArgumentError: For a list that is empty or whose brackets do not close.
    """
    text = nodelist.strip()
    if not text:
        raise InvalidArgumentError("$SLURM_JOB_NODELIST is empty")
    bracket = text.find("[")
    comma = text.find(",")
    if bracket < 0 or (0 <= comma < bracket):
        return text.split(",")[0]
    close = text.find("]", bracket)
    if close < 0:
        raise InvalidArgumentError(f"$SLURM_JOB_NODELIST={nodelist!r}: a '[' is never closed")
    first = text[bracket + 1 : close].split(",")[0]
    match = _RANGE.match(first)
    if match is None:
        raise InvalidArgumentError(f"$SLURM_JOB_NODELIST={nodelist!r}: {first!r} is no range")
    return text[:bracket] + match.group(1)


SLURM_TIME_FORMAT_ENV = "SLURM_TIME_FORMAT"
"""How SLURM's commands print times (``%s``: seconds since the epoch, for ``squeue``)."""


def slurm_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The id of the SLURM job this process runs in (``$SLURM_JOB_ID``), whoever launched it
    (``srun``, torchrun or a batch script's plain process); None outside SLURM.

    TF name: none.
    """
    env = os.environ if environ is None else environ
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None


def current_launcher(environ: Mapping[str, str] | None = None) -> TorchrunLauncher | SlurmLauncher:
    """The launcher that started this process, read from ``environ`` (``os.environ``).

    Raises:
        InvalidArgumentError: ``$TORCHSUPERVISOR_LAUNCHER`` names no launcher, or a variable
            that should be an integer is not.

    TF name: none (TF 1 read ``TF_CONFIG``).
    """
    env = os.environ if environ is None else environ
    chosen = env.get(LAUNCHER_ENV, "").strip().lower()
    if chosen not in ("", "torchrun", "slurm"):
        raise InvalidArgumentError(
            f"${LAUNCHER_ENV}={env[LAUNCHER_ENV]!r}: use 'torchrun' or 'slurm'"
        )
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env  # Started by srun.
    if chosen == "slurm" or (
        not chosen and in_step and "SLURM_PROCID" in env and "RANK" not in env
    ):
        return SlurmLauncher.from_environ(env)
    return TorchrunLauncher.from_environ(env)
