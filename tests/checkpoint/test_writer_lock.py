"""One writer per logdir: a second writing process fails at once; readers are never blocked."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from supervisor_helpers import Trainer

import torchsupervisor as ts
from torchsupervisor import CheckpointReader, Saver, Session
from torchsupervisor.cli import main as cli_main
from torchsupervisor.errors import FailedPreconditionError, LogdirLockedError
from torchsupervisor.storage import lock as writer_lock

HOLDER = textwrap.dedent(
    """
    import os, sys, time, torch
    import torchsupervisor as ts
    logdir, fork = sys.argv[1], sys.argv[2] == "fork"
    state = {"w": torch.zeros(2), "global_step": ts.GlobalStep()}
    sv = ts.Supervisor(logdir=logdir, state=state, save_model_secs=3600, save_summaries_secs=0)
    with sv.managed_session() as sess:
        sv.checkpoint()
        if fork:
            child = os.fork()
            if child == 0:  # A data-loading worker that outlives its parent.
                time.sleep(60)
                os._exit(0)
            print("CHILD", child, flush=True)
        print("READY", flush=True)
        sys.stdin.read()
    """
)


def _holder(logdir, fork=False):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(logdir), "fork" if fork else "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    proc.child = None
    if line.startswith("CHILD"):
        proc.child = int(line.split()[1])
        line = proc.stdout.readline()
    assert line.strip() == "READY", proc.stderr.read()
    return proc


def _state():
    return {"w": torch.zeros(2), "global_step": ts.GlobalStep()}  # The holder's state.


def _supervisor(logdir):
    return ts.Supervisor(
        logdir=str(logdir), state=_state(), save_model_secs=3600, save_summaries_secs=0
    )


def _event_files(logdir):
    return sorted(n for n in os.listdir(logdir) if n.startswith("events.out"))


def test_a_second_writer_fails_at_once_naming_the_first(tmp_path):
    proc = _holder(tmp_path)
    events = _event_files(tmp_path)
    try:
        start = time.monotonic()
        with pytest.raises(LogdirLockedError) as caught, _supervisor(tmp_path).managed_session():
            pass
        assert time.monotonic() - start < 30  # No waiting for the lock (a busy machine: slack).
        error = caught.value
        assert isinstance(error, FailedPreconditionError)
        assert error.owner["pid"] == proc.pid and error.owner["host"] == socket.gethostname()
        message = str(error)
        assert f"Another process is writing to {tmp_path}: pid {proc.pid}" in message
        assert f"since {error.owner['since']}" in message
        assert _event_files(tmp_path) == events  # Nothing written before failing.
        # A bare Saver of another process is a writer too: its first save fails.
        with pytest.raises(LogdirLockedError):
            Saver().save(Session({"w": torch.zeros(1)}), str(tmp_path / "model.ckpt"), 99)
        # Readers are never blocked.
        assert CheckpointReader(str(tmp_path / "model.ckpt-0")).global_step == 0
        assert cli_main(["verify", str(tmp_path)]) == 0
        assert cli_main(["ls", str(tmp_path)]) == 0
    finally:
        proc.communicate("", timeout=60)
    assert proc.returncode == 0
    with _supervisor(tmp_path).managed_session() as sess:  # Released at its exit.
        assert sess.restored_checkpoint == str(tmp_path / "model.ckpt-0")


@pytest.mark.parametrize("fork", [False, True], ids=["alone", "with a forked worker"])
def test_a_killed_writer_never_blocks_its_restart(tmp_path, fork):
    proc = _holder(tmp_path, fork=fork)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    proc.stdin.close()
    proc.stdout.close()
    proc.stderr.close()
    try:
        if fork:
            os.kill(proc.child, 0)  # The worker is alive...
        # ... and the lock free at once: a forked worker does not hold it.
        with _supervisor(tmp_path).managed_session() as sess:
            assert sess.restored_checkpoint == str(tmp_path / "model.ckpt-0")
    finally:
        if fork:
            os.kill(proc.child, signal.SIGKILL)


def test_one_process_is_one_writer(tmp_path):
    """The Supervisor, its Saver and a user's extra save into the logdir share the lock."""
    trainer = Trainer()
    sv = ts.Supervisor(
        logdir=str(tmp_path), state=trainer.state, save_model_secs=3600, save_summaries_secs=0
    )
    with sv.managed_session() as sess:
        sess.run(trainer.train_step)
        sv.checkpoint()
        other = Saver()
        assert other.save(sess, str(tmp_path / "extra"), 1) == str(tmp_path / "extra-1")
        other.close()
    with writer_lock.acquire(str(tmp_path)) as lock:  # Released: free for anyone again.
        assert writer_lock.read_owner(str(tmp_path))["pid"] == os.getpid()
        assert lock.path == str(tmp_path / writer_lock.LOCK_FILENAME)


def test_a_monitored_training_session_is_a_writer(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(LogdirLockedError, match=f"pid {proc.pid}"):
            ts.MonitoredTrainingSession(checkpoint_dir=str(tmp_path), state=_state())
    finally:
        proc.communicate("", timeout=60)
    with ts.MonitoredTrainingSession(checkpoint_dir=str(tmp_path), state=_state()) as sess:
        sess.run(lambda: None)
    with writer_lock.acquire(str(tmp_path)):  # The session released it when it closed.
        pass


def test_a_directory_that_cannot_hold_the_lock_file_is_written_unlocked(tmp_path, caplog):
    (tmp_path / writer_lock.LOCK_FILENAME).mkdir()  # Cannot be opened for writing.
    with caplog.at_level("WARNING", logger="torchsupervisor"):
        prefix = Saver().save(Session({"w": torch.zeros(1)}), str(tmp_path / "m"), 1)
    assert CheckpointReader(prefix).global_step == 1
    assert "without a writer lock" in caplog.text


_TRY_LOCK = """
import sys
from torchsupervisor.errors import LogdirLockedError
from torchsupervisor.storage import lock
try:
    lock.acquire(sys.argv[1])
except LogdirLockedError:
    print("LOCKED")
"""


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo"])
def test_a_lock_file_that_names_something_else_is_replaced_never_written_through(
    tmp_path, kind, caplog
):
    # A logdir unpacked from an archive: the lock file's name is a link to a file of the
    # user's. O_CREAT followed it, and the writer truncated and overwrote that file.
    logdir, outside = tmp_path / "run", tmp_path / "precious.txt"
    logdir.mkdir()
    outside.write_text("the user's own file\n")
    lock_path = logdir / writer_lock.LOCK_FILENAME
    if kind == "symlink":
        lock_path.symlink_to(outside)
    elif kind == "hardlink":
        os.link(outside, lock_path)
    else:
        os.mkfifo(lock_path)
    with caplog.at_level("WARNING", logger="torchsupervisor"):
        sv = _supervisor(logdir)
        with sv.managed_session():
            assert outside.read_text() == "the user's own file\n"
            assert lock_path.is_file() and not lock_path.is_symlink()
            assert os.stat(lock_path).st_nlink == 1
            # (Read through the held descriptor: closing another one drops a record lock.)
            assert writer_lock.read_owner(str(logdir))["pid"] == os.getpid()
            other = subprocess.run(  # And it is a lock all the same.
                [sys.executable, "-c", _TRY_LOCK, str(logdir)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert other.stdout.strip() == "LOCKED", other.stderr
    assert outside.read_text() == "the user's own file\n"
    assert f"{lock_path} is " in caplog.text and "replaced by a lock file" in caplog.text
