"""What a path given to ``ls``, ``inspect``, ``verify`` and ``export`` names.

A user types a log directory, a checkpoint prefix (``runs/exp/model.ckpt-3000``), or whatever
tab completion gives: one of the checkpoint's files (``model.ckpt-3000.index``,
``model.ckpt-3000.data-00000-of-00001``). Each resolves to the log directory and, for the
last two kinds, the checkpoint. Local paths and URLs alike.

TF name: none.
"""

from __future__ import annotations

import argparse
import os
import posixpath
import re
from dataclasses import dataclass

from torchsupervisor.errors import InvalidArgumentError, NotFoundError
from torchsupervisor.storage import is_url, storage_for

__all__ = ["Target", "add_path_argument", "missing", "resolve"]

_CHECKPOINT_FILE = re.compile(r"^(?P<prefix>.+)\.(?:index|data-\d{5}-of-\d{5})$")


@dataclass(frozen=True)
class Target:
    """The log directory a path names, and the checkpoint (prefix) if it names one."""

    logdir: str
    prefix: str | None


def add_path_argument(parser: argparse.ArgumentParser, dest: str, help: str) -> None:
    """Add the positional ``PATH`` argument (stored as ``dest``) that ``resolve`` reads."""
    parser.add_argument(dest, metavar="PATH", help=help)


def missing(path: str) -> NotFoundError:
    """The error for a path that does not exist: ``"no such file or directory: PATH"``."""
    return NotFoundError(f"no such file or directory: {path}")


def _dirname(prefix: str) -> str:
    if is_url(prefix):
        return posixpath.dirname(prefix)
    return os.path.dirname(prefix) or os.curdir


def _has_files(prefix: str) -> bool:
    """Whether ``prefix`` is a checkpoint prefix: its index or one of its data files exists."""
    storage = storage_for(prefix)
    if storage.is_file(prefix + ".index"):
        return True
    directory, base = _dirname(prefix), posixpath.basename(prefix)
    try:
        names = storage.list(directory)
    except (OSError, NotFoundError):
        return False
    return any(name.startswith(base + ".data-") for name in names)


def resolve(path: str) -> Target:
    """Resolve ``path``: a log directory, a checkpoint prefix, or a file of a checkpoint.

    Raises:
        NotFoundError: Nothing exists at ``path`` (``"no such file or directory: PATH"``).
        InvalidArgumentError: ``path`` exists but is neither.
    """
    if len(path) > 1 and path.endswith("/") and not path.endswith("://"):
        path = path.rstrip("/")
    storage = storage_for(path)
    if storage.is_dir(path) and not storage.is_file(path + ".index"):
        return Target(path, None)
    match = _CHECKPOINT_FILE.match(path)
    if match and storage.is_file(path):
        return Target(_dirname(match["prefix"]), match["prefix"])
    if _has_files(path):
        return Target(_dirname(path), path)
    if storage.exists(path):
        raise InvalidArgumentError(
            f"{path} is neither a log directory nor a checkpoint (a prefix such as "
            "model.ckpt-300, or one of its .index and .data-* files)"
        )
    raise missing(path)
