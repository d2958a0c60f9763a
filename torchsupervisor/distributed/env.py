"""Master strings and the process group: how a session finds the other replicas.

TF 1 sessions connected to a "master" (``''`` in-process, ``'grpc://host:port'``). Replicas
here are processes of one ``torch.distributed`` process group, usually launched with
``torchrun``:

* ``''`` or ``'local'``: this process only, no process group (unless one is already
  initialized by the program, which is then used as is);
* ``'env://'``: the process group described by the launcher's environment (``launcher.py``:
  ``torchrun``'s ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, or SLURM's
  ``SLURM_PROCID``, ``SLURM_NTASKS``, ...); under ``torchrun`` the rendezvous keys of each
  restart attempt are kept apart (``attempt.py``), so that ``--max-restarts`` works with gloo,
  on one node or several;
* ``'tcp://host:port?rank=R&world_size=W'`` (``rank`` and ``world_size`` may come from the
  launcher instead): a rendezvous at ``host:port``, hosted by rank 0; this is what
  ``Server.target`` returns.

The backend is gloo on CPU and NCCL when CUDA is available. Parameter servers are not
emulated: replicas average gradients with all-reduce (``DistributedDataParallel``, FSDP).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

import torch
import torch.distributed as dist

from torchsupervisor.core import thread_registry
from torchsupervisor.core.session import join_masters_with
from torchsupervisor.distributed.attempt import DEFAULT_TIMEOUT_SECS
from torchsupervisor.distributed.launcher import NAMESPACED_GROUPS, current_launcher
from torchsupervisor.distributed.liveness import ProcessRecords, records_prefix
from torchsupervisor.errors import DeadlineExceededError, InvalidArgumentError, UnavailableError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "IN_PROCESS_MASTERS",
    "STORE_NAMESPACE",
    "background_group",
    "connect",
    "default_backend",
    "is_distributed_master",
    "rank",
    "streams_group",
    "world_size",
]

logger = logging.getLogger("torchsupervisor")

IN_PROCESS_MASTERS = ("", "local")

STORE_NAMESPACE = "torchsupervisor/"
"""The library's keys in a process group's store that is new in each run (the groups
``connect`` makes); under a store that outlives restart attempts, each attempt gets its own
namespace (``replicas``, ``attempt``)."""


def default_backend() -> str:
    """Return ``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def is_distributed_master(master: str) -> bool:
    """Return True for a master string naming a process group (``env://``, ``tcp://``).

    Raises:
        InvalidArgumentError: For a master string of another kind (``grpc://`` and others
            have no counterpart), naming the accepted forms.
    """
    if master in IN_PROCESS_MASTERS:
        return False
    scheme = urlparse(master).scheme
    if scheme in ("env", "tcp"):
        return True
    raise InvalidArgumentError(
        f"master={master!r} is not supported: use '' (in-process), 'env://' (torchrun) or "
        "'tcp://host:port?rank=R&world_size=W' (e.g. Server.target)"
    )


def rank() -> int:
    """This process's rank: the process group's, else the launcher's (``$RANK``,
    ``$SLURM_PROCID``), else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return current_launcher().rank


def world_size() -> int:
    """The number of replicas: the process group's, else the launcher's (``$WORLD_SIZE``,
    ``$SLURM_NTASKS``), else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return current_launcher().world_size


def communication_device(
    backend: str, cuda_device: Callable[[], int] = torch.cuda.current_device
) -> torch.device:
    """Return the device of the tensors that the collectives of ``backend`` take.

    NCCL moves only CUDA tensors: every rank uses its current CUDA device (the one set with
    ``torch.cuda.set_device``, usually ``LOCAL_RANK``). Gloo (and a mixed backend such as
    ``"cpu:gloo,cuda:nccl"``) communicates from the CPU.

    Args:
        backend: The process group's backend, as ``torch.distributed.get_backend()`` names it.
        cuda_device: Returns the index of the current CUDA device (called for NCCL only).

    Returns:
        ``torch.device("cuda", cuda_device())`` for ``"nccl"``, else ``torch.device("cpu")``.

    Distributed: every rank of a collective must pass tensors of this device (type).

    TF name: none.
    """
    if str(backend).lower() == "nccl":
        return torch.device("cuda", cuda_device())
    return torch.device("cpu")


def on_every_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (a collective of the default group), or ``flag``
    itself when no process group is initialized.

    For a check that each rank makes on its own before a collective (a file it can see): a
    rank that raised alone would leave the others waiting in the collective.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    device = communication_device(dist.get_backend())
    agreed = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


# By purpose: (default group, its gloo group for that purpose), held weakly: torch's registry
# keeps both alive until ``destroy_process_group``, and nothing here may keep them beyond it.
_GLOO_GROUPS: dict[str, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}


def _gloo_group(purpose: str) -> Any:
    """A gloo group of every rank for ``purpose``, made at the first call (a collective)
    after the default group exists and reused while it lives; None without a process group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    held = _GLOO_GROUPS.get(purpose)
    if held is not None:
        world_ref, group_ref = held
        group = group_ref()
        if world_ref() is world and group is not None:
            return group
    group = dist.new_group(backend="gloo")
    _GLOO_GROUPS[purpose] = (weakref.ref(world), weakref.ref(group))
    return group


def background_group() -> Any:
    """A gloo group of every rank for the collectives of a background thread, or None.

    Collectives of two threads must not share a process group (their order would differ
    between ranks), so a checkpoint written on the writer thread agrees through this group
    while training uses the default one. It is made at the first call after the default group
    exists (a collective: every rank calls it at the same point of its program, e.g. the
    first asynchronous sharded save) and reused while that default group lives.

    Only weak references are kept: ``destroy_process_group()`` ends both groups and their
    gloo threads. A group still referenced after it would live on until the interpreter's
    shutdown, and gloo's threads, releasing tensors then, could abort the process at exit
    ("terminate called without an active exception") after a run that succeeded.

    Returns:
        The group, or None when no process group is initialized.
    """
    return _gloo_group("background")


def streams_group() -> Any:
    """A gloo group of every rank for the training thread's gathers of the random streams
    (``replica_streams``): CPU tensors whatever the default group's backend, and never the
    writer thread's ``background_group``. Made at its first call (a collective: every rank
    at its first gather, on the training thread), held weakly as ``background_group``; None
    without a process group."""
    return _gloo_group("streams")


def store_outlives_attempts(group: ProcessGroup | None) -> bool:
    """Whether ``group``'s store may hold keys of an earlier restart attempt.

    True under torchrun's shared agent store (``TORCHELASTIC_USE_AGENT_STORE``) for a group
    that ``connect`` did not make (``init_process_group`` by the program); False otherwise:
    ``connect`` put its group under a namespace of its attempt, and other stores are new in
    each run. The launcher decides (``launcher.Launcher.store_outlives_attempts``).
    """
    return current_launcher().store_outlives_attempts(group)


_EXIT_HOOK: list[bool] = []


def _destroy_at_exit() -> None:
    """Destroy the process group ``connect`` created when the program exits (once).

    Without it, gloo's worker threads may release the tensors of the last collective after
    the interpreter began to shut down; taking the GIL then ends the thread inside a C++
    destructor and the process aborts ("terminate called without an active exception"),
    at random, after a run that succeeded. The teardown runs on a helper thread and is given
    a few seconds: a collective stuck with a dead peer must not keep the process alive.
    """
    if _EXIT_HOOK:
        return
    _EXIT_HOOK.append(True)

    def destroy() -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # Exiting anyway.
                logger.debug("Destroying the process group at exit failed: %s", e)

    def at_exit() -> None:
        helper = threading.Thread(target=destroy, name="torchsupervisor-pg-teardown", daemon=True)
        helper.start()
        helper.join(_TEARDOWN_SECS)

    thread_registry.register(
        "process group", order=thread_registry.DRAIN_PROCESS_GROUP, drain=at_exit
    )


_TEARDOWN_SECS = 5.0


def connect(master: str, timeout_secs: float | None = None, backend: str | None = None) -> bool:
    """Join the process group named by ``master`` (once; later calls reuse it).

    Args:
        master: A master string (see the module docstring).
        timeout_secs: How long to wait for the other replicas to join (None: torch's
            default, 30 minutes).
        backend: ``"gloo"`` or ``"nccl"``; None: ``default_backend()``.

    Returns:
        True if a process group is in use after the call.

    Raises:
        InvalidArgumentError: For an unsupported master string, or a ``tcp://`` master whose
            rank or world size is unknown.
        DeadlineExceededError: If the other replicas did not join within ``timeout_secs``
            (``"Session was not ready after waiting %d secs."``).
        UnavailableError: If the group could not form for another reason (a replica that
            went away while it formed), naming ``master`` and the cause.
    """
    if not is_distributed_master(master):
        return dist.is_available() and dist.is_initialized()
    if dist.is_initialized():
        return True
    joining = time.time()
    launcher = current_launcher()
    kwargs: dict[str, Any] = {"backend": backend or default_backend()}
    waited = int(DEFAULT_TIMEOUT_SECS if timeout_secs is None else timeout_secs)
    if urlparse(master).scheme == "tcp":
        query = parse_qs(urlparse(master).query)
        given = {name: (query.get(name) or [None])[0] for name in ("rank", "world_size")}
        if any(value is None for value in given.values()) and not launcher.launched:
            raise InvalidArgumentError(
                f"master={master!r} needs rank and world_size (in the URL, or from a launcher: "
                "$RANK and $WORLD_SIZE, or SLURM's)"
            )
        kwargs["init_method"] = master.split("?")[0]
        kwargs["rank"] = int(given["rank"] or launcher.rank)
        kwargs["world_size"] = int(given["world_size"] or launcher.world_size)
    else:
        kwargs.update(launcher.rendezvous(waited))
    if timeout_secs is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_secs)
    try:
        dist.init_process_group(**kwargs)
    except (RuntimeError, TimeoutError) as e:
        text = str(e).lower()
        if "connection refused" in text or "connection reset" in text:
            # A replica went away while the group formed.
            raise UnavailableError(
                None, None, f"Could not join the process group at {master}: {e}"
            ) from e
        if isinstance(e, TimeoutError) or "timeout" in text or "timed out" in text:
            raise DeadlineExceededError(
                None, None, f"Session was not ready after waiting {waited} secs."
            ) from e
        raise
    if "store" in kwargs:
        NAMESPACED_GROUPS.add(dist.group.WORLD)
    if not store_outlives_attempts(dist.group.WORLD):
        # Where this process runs, before any agreement: a rank that dies before its first
        # ReplicaGroup is seen gone by the others' waits (``liveness``).
        ProcessRecords(
            dist.distributed_c10d._get_default_store(),
            records_prefix(STORE_NAMESPACE),
            dist.get_rank(),
        )
    _JOINED[:] = [(joining, time.time())]
    _destroy_at_exit()
    logger.info(
        "Joined the process group as rank %d of %d (%s; launcher %s, restart %d)",
        dist.get_rank(),
        dist.get_world_size(),
        kwargs["backend"],
        launcher.name,
        launcher.restart_count,
    )
    return True


_JOINED: list[tuple[float, float]] = []  # When ``connect`` last formed the process group.


def joined_at() -> tuple[float, float] | None:
    """When ``connect`` formed this process's process group: its start and end in wall
    seconds (the rendezvous, for the goodput ledger), or None if it did not form one."""
    return _JOINED[-1] if _JOINED else None


join_masters_with(connect)  # Session(master=...) joins through this module.
