"""The processes a test started, and theirs: ``torchrun`` starts each worker in a session of
its own, so a signal to the launcher's process group does not reach them."""

from __future__ import annotations

import os
import time


def descendants(pid: int) -> list[int]:
    """The pids of the living descendants of ``pid`` (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found.extend(kids)
        todo.extend(kids)
    return found


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
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
