"""One writer per local directory: an advisory lock the operating system releases on a crash.

Two runs writing to one directory corrupt each other quietly: each deletes the other's
checkpoints through retention, they overwrite one state file, and an incremental checkpoint can
reference the other run's data. So every writer (the ``Supervisor``'s chief, a chief
``MonitoredTrainingSession``, a ``Saver`` at its first save to a directory) takes the directory's
writer lock first, and a second process fails at once with ``LogdirLockedError`` naming the
holder (pid, host, since when, command).

The lock is a POSIX record lock (``fcntl.lockf(LOCK_EX | LOCK_NB)``) on
``<directory>/.torchsupervisor-writer.lock``, a regular file of its own: a symbolic link, a
hard link or a special file found under that name (a logdir unpacked from an archive) is
replaced, never followed, so the writer never truncates or writes anything outside it. The
kernel drops the lock when the holding process ends, however it ends (``kill -9`` included), so
a crashed run never blocks its own restart, and no stale-lock guessing is needed. Unlike
``flock``, a record lock is not inherited by forked children: data-loading workers that outlive
a killed trainer by a few seconds do not keep its lock. (A record lock is also dropped when its
process closes any descriptor of the file, so this module keeps the process's only one open.)
The file's content (JSON: pid, host, since, command) only serves the error message. Readers
(``ls``, ``verify``, TensorBoard, ``CheckpointReader``) never touch the lock.

Within one process the lock is shared and counted: the Supervisor and its Saver, or a user's
extra ``sv.saver.save`` into the logdir, are one writer. Where the lock cannot be taken for a
reason other than another holder (a read-only directory, a file system without record locks), a
warning is logged and writing goes on unlocked (a save into a read-only directory then fails
with its own clear error).

TF name: none (TF had no writer lock).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import sys
import threading
from dataclasses import dataclass

from torchsupervisor.errors import LogdirLockedError
from torchsupervisor.storage import base

__all__ = ["LOCK_FILENAME", "DirectoryLock", "acquire", "describe_owner", "read_owner"]

logger = logging.getLogger("torchsupervisor")

LOCK_FILENAME = ".torchsupervisor-writer.lock"
"""The lock file's name inside the locked directory."""

_MAX_OWNER_BYTES = 4096


@dataclass
class _Held:
    fd: int | None  # None: could not be locked (read-only, no lockf); nothing to release.
    count: int
    pid: int  # A forked child does not inherit the lock: its copy of this entry is void.


_lock = threading.Lock()
_held: dict[str, _Held] = {}


class DirectoryLock(base.DirectoryLock):
    """A handle on a directory's writer lock; ``release`` it once (later calls do nothing).

    Thread safety: ``release`` may be called from any thread.
    """

    def __init__(self, key: str, directory: str) -> None:
        self._key = key
        self.directory = directory
        self._released = False

    @property
    def path(self) -> str:
        """The lock file."""
        return os.path.join(self.directory, LOCK_FILENAME)

    def release(self) -> None:
        """Give the handle back; the lock is released when the process holds no handle."""
        with _lock:
            if self._released:
                return
            self._released = True
            held = _held.get(self._key)
            if held is None or held.pid != os.getpid():
                return
            held.count -= 1
            if held.count > 0:
                return
            del _held[self._key]
        if held.fd is not None:
            try:
                fcntl.lockf(held.fd, fcntl.LOCK_UN)
            finally:
                os.close(held.fd)


def acquire(directory: str, mode: int = 0o644) -> DirectoryLock:
    """Take the writer lock of ``directory`` for this process.

    Args:
        directory: The log or checkpoint directory.
        mode: The permission bits of a lock file it creates (the storage's ``file_mode``).

    Returns:
        A handle; ``release()`` it when done writing (the lock also ends with the process).

    Raises:
        LogdirLockedError: Another process holds the lock; the message names it: ``"Another
            process is writing to runs/exp: pid 4242 on host gpu-3 since
            2026-11-25T10:00:00+00:00 (python train.py). One writer per log directory:
            stop it, or use another directory."``.

    Thread safety: safe from any thread; the handles of one process share one lock.
    """
    directory = directory or os.curdir
    key = os.path.realpath(directory)
    with _lock:
        held = _held.get(key)
        if held is not None and held.pid == os.getpid():
            held.count += 1
            return DirectoryLock(key, directory)
        fd = _lock_file(directory, mode)
        _held[key] = _Held(fd, 1, os.getpid())
    return DirectoryLock(key, directory)


_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_OPEN_ATTEMPTS = 8


def _open_lock_file(path: str, mode: int) -> int:
    """Open the lock file ``path`` of a directory, never anything it points to.

    A log directory may come from an archive: a symbolic link, a hard link or a special file
    in the lock file's place would make the writer truncate and overwrite whatever it names
    (``O_CREAT`` follows links). Such a file is replaced by a regular file of our own
    (removing a link does not touch its target).

    Raises:
        OSError: If it cannot be opened or replaced.
    """
    for _ in range(_OPEN_ATTEMPTS):
        try:
            fd = os.open(path, _OPEN_FLAGS, mode)
        except OSError as e:
            if e.errno != errno.ELOOP:  # ELOOP: the name is a symbolic link.
                raise
            _replace(path, "a symbolic link")
            continue
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
            return fd
        os.close(fd)
        _replace(path, "a hard link" if stat.S_ISREG(info.st_mode) else "not a regular file")
    raise OSError(errno.ELOOP, "replaced too often by someone else", path)


def _replace(path: str, what: str) -> None:
    logger.warning(
        "%s is %s: it is replaced by a lock file of its own (nothing it names is touched)",
        path,
        what,
    )
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _still_named(path: str, fd: int) -> bool:
    """True if ``path`` still names the file open as ``fd`` (not replaced meanwhile)."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _lock_file(directory: str, mode: int) -> int | None:
    path = os.path.join(directory, LOCK_FILENAME)
    for _ in range(_OPEN_ATTEMPTS):
        fd = _lock_named_file(directory, path, mode)
        # A lock on a file that another starting writer replaced (unlinked) locks nothing:
        # take it again on the file the name stands for now.
        if fd is None or _still_named(path, fd):
            return fd
        os.close(fd)
    logger.warning("Writing to %s without a writer lock: %s keeps being replaced", directory, path)
    return None


def _lock_named_file(directory: str, path: str, mode: int) -> int | None:
    try:
        fd = _open_lock_file(path, mode)
    except OSError as e:
        logger.warning(
            "Writing to %s without a writer lock: %s cannot be opened: %s", directory, path, e
        )
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            owner = _read_fd(fd)
            os.close(fd)
            raise LogdirLockedError(
                f"Another process is writing to {directory}: {describe_owner(owner)}. One "
                "writer per log directory: stop it, or use another directory.",
                path=path,
                directory=directory,
                owner=owner,
            ) from None
        os.close(fd)
        logger.warning("Writing to %s without a writer lock: lockf failed: %s", directory, e)
        return None
    owner = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv)[:512],
    }
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode("utf-8") + b"\n", 0)
    except OSError as e:  # The lock holds; only the description is missing.
        logger.debug("Could not describe the writer in %s: %s", path, e)
    return fd


def _read_fd(fd: int) -> dict[str, object]:
    try:
        data = os.pread(fd, _MAX_OWNER_BYTES, 0)
        owner = json.loads(data.decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def read_owner(directory: str) -> dict[str, object]:
    """Return what the lock file of ``directory`` says about its writer (may be stale).

    Returns:
        ``{"pid": ..., "host": ..., "since": ..., "command": ...}``; empty if there is no
        lock file or it cannot be read. The writer it names may have ended since: only a
        failed ``acquire`` proves that a writer is alive.
    """
    with _lock:
        held = _held.get(os.path.realpath(directory or os.curdir))
        if held is not None and held.fd is not None and held.pid == os.getpid():
            return _read_fd(held.fd)  # Closing another descriptor would drop our lock.
    try:
        path = os.path.join(directory, LOCK_FILENAME)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return {}
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def describe_owner(owner: dict[str, object]) -> str:
    """Name a lock's writer for a message: ``"pid 4242 on host gpu-3 since ... (cmd)"``."""
    if not owner:
        return "its writer did not say who it is"
    text = f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}"
    if owner.get("since"):
        text += f" since {owner['since']}"
    if owner.get("command"):
        text += f" ({owner['command']})"
    return text
