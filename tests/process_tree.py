"""The processes a test started, and theirs (psutil): ``torchrun`` starts each worker in a
session of its own, so a signal to the launcher's process group does not reach them."""

from __future__ import annotations

import os
import time

import psutil


def children(pid: int) -> list[int]:
    """The pids of the living children of ``pid`` (torchrun's workers are its children)."""
    try:
        return [p.pid for p in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def descendants(pid: int) -> list[int]:
    """The pids of the living descendants of ``pid``."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def rank_of(pid: int) -> int | None:
    """The ``RANK`` in the environment of process ``pid`` (None: none, or it is gone)."""
    try:
        rank = psutil.Process(pid).environ().get("RANK")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return int(rank) if rank is not None else None


def signal_tree(pid: int, sig: int) -> list[int]:
    """Send ``sig`` to ``pid`` and every descendant (the workers first); return them all."""
    tree = descendants(pid)
    for target in [*reversed(tree), pid]:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass
    return tree


def wait_gone(pids: list[int], timeout_secs: float = 60) -> None:
    """Wait until none of ``pids`` is alive (a zombie counts as gone)."""
    deadline = time.monotonic() + timeout_secs
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes still alive after {timeout_secs} s: {pids}")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
