"""One registry of the background machinery: exit drains in order, fork resets, quiet waits."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.repo_paths import ROOT
from torchsupervisor import GlobalStep, Saver, Session
from torchsupervisor.core import thread_registry
from torchsupervisor.testing import GatedStorage, wait_for_quiet

PACKAGE = Path(ROOT) / "torchsupervisor"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_the_package_registers_its_machinery():
    names = thread_registry.registered()
    assert "checksum helper" in names and "hurriable threads" in names


def test_drains_run_once_at_exit_in_their_order_and_one_failure_stops_none():
    done = _run(
        """
        from torchsupervisor.core import thread_registry as r
        r.register("group", order=r.DRAIN_PROCESS_GROUP, drain=lambda: print("group"))
        r.register("events", order=r.DRAIN_EVENTS, drain=lambda: print("events"))
        r.register("broken", order=r.DRAIN_EVENTS + 1, drain=lambda: 1 / 0)
        r.register("saves", order=r.DRAIN_SAVES, drain=lambda: print("saves"))
        print("exit")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["exit", "saves", "events", "group"]
    assert "Draining the broken at exit failed" in done.stderr


def test_the_drains_run_before_an_exit_hook_registered_before_a_later_part():
    # As each part's own atexit hook did: a hook registered before the first save runs
    # after that save is drained.
    done = _run(
        """
        import atexit
        from torchsupervisor.core import thread_registry as r
        r.register("group", order=r.DRAIN_PROCESS_GROUP, drain=lambda: print("group"))
        atexit.register(lambda: print("user"))
        r.register("saves", order=r.DRAIN_SAVES, drain=lambda: print("saves"))
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["saves", "group", "user"]


def test_a_forked_child_runs_each_at_fork_hook():
    done = _run(
        """
        import os
        from torchsupervisor.core import thread_registry as r
        r.register("part", at_fork=lambda: print("reset in", "child", flush=True))
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent", flush=True)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["reset", "in", "child", "parent"]


def test_nothing_else_in_the_package_registers_exit_or_fork_hooks():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "thread_registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("register_at_fork", "register"):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("atexit", "os"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_wait_for_quiet_names_a_save_still_in_flight(tmp_path):
    storage = GatedStorage()
    gate = storage.hold("fsync", timeout_secs=60)
    saver = Saver(storage=storage)
    sess = Session({"w": torch.zeros(10), "global_step": GlobalStep()})
    future = saver.save_async(sess, str(tmp_path / "model.ckpt"), global_step=0)
    try:
        assert gate.reached.wait(60)
        with pytest.raises(TimeoutError, match="checkpoint writer: 1 save"):
            wait_for_quiet(0.2)
    finally:
        gate.open()
    future.result(60)
    wait_for_quiet(10)  # Quiet now: the save is written and the writer thread ended.
    assert not saver.in_flight
