"""Master strings and the process group: how a session finds the other replicas.

TF 1 sessions connected to a "master" (``''`` in-process, ``'grpc://host:port'``). Replicas
here are processes of one ``torch.distributed`` process group, usually launched with
``torchrun``:

* ``''`` or ``'local'``: this process only, no process group (unless one is already
  initialized by the program, which is then used as is);
* ``'env://'``: the process group described by the environment ``torchrun`` sets
  (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``); under ``torchrun`` the rendezvous
  keys of each restart attempt are kept apart, so that ``--max-restarts`` works with gloo;
* ``'tcp://host:port?rank=R&world_size=W'`` (``rank`` and ``world_size`` may come from the
  environment instead): a rendezvous at ``host:port``, hosted by rank 0; this is what
  ``Server.target`` returns.

The backend is gloo on CPU and NCCL when CUDA is available. Parameter servers are not
emulated: replicas average gradients with all-reduce (``DistributedDataParallel``, FSDP).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import threading
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch
import torch.distributed as dist

from torchsupervisor.errors import DeadlineExceededError, InvalidArgumentError

__all__ = [
    "IN_PROCESS_MASTERS",
    "connect",
    "default_backend",
    "is_distributed_master",
    "rank",
    "world_size",
]

logger = logging.getLogger("torchsupervisor")

IN_PROCESS_MASTERS = ("", "local")


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
    """This process's rank: the process group's, else ``$RANK``, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """The number of replicas: the process group's, else ``$WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _agent_store(timeout: datetime.timedelta | None) -> dict[str, Any]:
    """The torchrun agent's store, under a prefix of its own for this restart attempt.

    After ``torchrun --max-restarts`` restarts a group, the agent's store still holds the
    addresses that the previous attempt's ranks published, and gloo connects to the dead
    processes. A prefix per attempt (``TORCHELASTIC_RESTART_COUNT``) keeps attempts apart.
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timeout or datetime.timedelta(minutes=30),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"torchsupervisor/attempt_{attempt}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


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

    atexit.register(at_exit)


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
    """
    if not is_distributed_master(master):
        return dist.is_available() and dist.is_initialized()
    if dist.is_initialized():
        return True
    kwargs: dict[str, Any] = {"backend": backend or default_backend(), "init_method": master}
    if urlparse(master).scheme == "tcp":
        query = parse_qs(urlparse(master).query)
        rank_text = (query.get("rank") or [os.environ.get("RANK")])[0]
        size_text = (query.get("world_size") or [os.environ.get("WORLD_SIZE")])[0]
        if rank_text is None or size_text is None:
            raise InvalidArgumentError(
                f"master={master!r} needs rank and world_size (in the URL or as $RANK and "
                "$WORLD_SIZE)"
            )
        kwargs["init_method"] = master.split("?")[0]
        kwargs["rank"], kwargs["world_size"] = int(rank_text), int(size_text)
    if timeout_secs is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_secs)
    if (
        urlparse(master).scheme == "env"
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    ):
        kwargs.update(_agent_store(kwargs.get("timeout")))
        del kwargs["init_method"]
    try:
        dist.init_process_group(**kwargs)
    except (RuntimeError, TimeoutError) as e:
        if "timeout" in str(e).lower() or "timed out" in str(e).lower():
            raise DeadlineExceededError(
                None,
                None,
                f"Session was not ready after waiting {int(timeout_secs or 0)} secs.",
            ) from e
        raise
    _destroy_at_exit()
    logger.info(
        "Joined the process group as rank %d of %d (%s)",
        dist.get_rank(),
        dist.get_world_size(),
        kwargs["backend"],
    )
    return True
