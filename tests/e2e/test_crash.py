"""Kill -9 at every stage of a checkpoint commit: the restart always finds a complete one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from repo_paths import worker

from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.storage import is_temporary_name

WORKER = worker("crash_worker.py")


def _start(logdir: str, stage: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, WORKER, logdir, stage],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_until_stalled(logdir: str, stage: str) -> None:
    proc = _start(logdir, stage)
    try:
        assert proc.stdout.readline().startswith("RESTORED 0 ")
        line = proc.stdout.readline()
        assert line.strip() == "STALLED", (line, proc.stderr.read() if proc.poll() else "")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


def _restart(logdir: str) -> str:
    proc = subprocess.run(
        [sys.executable, WORKER, logdir, "none"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()[0]


# Stages of the save at step 20, in commit order (one shard): the shard's write and fsync,
# its rename, the directory fsync, the index's write, fsync and rename (the commit point),
# the directory fsync after it, the state file's write and rename.
BEFORE_COMMIT = ["write:1", "fsync:1", "rename:1", "fsync_dir:1", "write:2", "fsync:2", "rename:2"]
AFTER_COMMIT = ["fsync_dir:2", "write:3", "rename:3"]


@pytest.mark.parametrize("stage", BEFORE_COMMIT + AFTER_COMMIT)
def test_kill_during_a_checkpoint_write(tmp_path, stage):
    logdir = str(tmp_path)
    _run_until_stalled(logdir, stage)
    for name in os.listdir(logdir):
        if name.endswith(".index"):  # Whatever is committed is complete and intact.
            CheckpointReader(os.path.join(logdir, name[: -len(".index")])).verify()
    restored = _restart(logdir)
    expected = 10 if stage in BEFORE_COMMIT else 20
    # The weight equals the step: the state restored is exactly the step's snapshot.
    assert restored == f"RESTORED {expected} {expected}"
    assert not [n for n in os.listdir(logdir) if is_temporary_name(n)]
    data = {n.split(".data-")[0] for n in os.listdir(logdir) if ".data-" in n}
    indexes = {n[: -len(".index")] for n in os.listdir(logdir) if n.endswith(".index")}
    assert data <= indexes  # No orphaned shard of an uncommitted save survives the restart.
