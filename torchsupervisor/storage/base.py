"""The storage seam: every checkpoint and event file is written and read through a ``Storage``.

A ``Storage`` is a place that holds named objects: a directory tree on a disk
(``LocalStorage``), or a bucket of an object store. Its operations are the ones an object store
has, so that the commit protocol above it is the same code on a disk and on a bucket:

* ``put``: write a whole object atomically from chunks (it then holds all of them, or the put
  failed and it holds what it held before or nothing; never a part);
* ``open_read``: read ranges of an object (``Readable``); ``read_bytes`` reads a small one;
* ``list``: the names of the committed objects under a directory (never a write in progress);
* ``delete``, ``exists``, ``is_file``, ``size``, ``mtime``, ``makedirs``;
* ``lock``: one writer per directory (a lock released when its holder dies);
* ``open_append``: an event file that grows, made durable by ``Appendable.sync``;
* ``clean_leftovers``: remove what an interrupted write left (temporary files, unfinished
  uploads), at the start of a run.

No rename, no append and no fsync appear above this seam: the local implementation does them
inside ``put`` (temporary name, write, fsync, rename, fsync of the directory) and
``Appendable.sync``; an object store does a single or multipart PUT.

Paths are strings: a local path, or (for object stores) a URL. ``os.path.join``,
``os.path.dirname`` and ``os.path.basename`` work on both; ``canonical`` tells whether two
paths name the same place.

Every operation of a ``Storage`` may be called from any thread; one object is written by one
writer at a time (the directory's lock holder).

TF name: none (TF's ``gfile`` played this part).
"""

from __future__ import annotations

import abc
import errno
import io
import stat
import threading
from collections.abc import Callable, Iterable
from typing import Any

from torchsupervisor.errors import NotRegularFileError, OutsideDirectoryError, WriteCancelled

__all__ = [
    "Appendable",
    "DirectoryLock",
    "NotRegularFileError",
    "OutsideDirectoryError",
    "Readable",
    "Storage",
    "WriteCancelled",
    "file_kind",
    "read_exactly",
    "read_whole",
]

Buffer = Any
"""Bytes-like: ``bytes``, ``bytearray``, ``memoryview`` (a staging buffer's view)."""


def file_kind(mode: int) -> str:
    """Describe what ``st_mode`` is, for messages (``"a FIFO"``, ``"a regular file"``)."""
    for test, kind in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


class Readable(abc.ABC):
    """An object opened for reading: ranged reads at any offset.

    Attributes:
        path: The object's path.
        size: Its size in bytes when it was opened.
        concurrent_reads: How many ``readinto`` calls a reader of many bytes should keep in
            flight at once (1: read in order, and say ``read_ahead`` first).

    Thread safety: ``readinto`` may be called from several threads at once (each read names
    its offset); ``close`` once, after the last read.
    """

    concurrent_reads: int = 1

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size

    @abc.abstractmethod
    def readinto(self, view: memoryview, offset: int) -> int:
        """Read up to ``len(view)`` bytes at ``offset`` into ``view``; return how many.

        Fewer bytes than asked may be returned; 0 means the end of the object.

        Raises:
            OSError: The read failed.
        """

    def read_ahead(self, offset: int) -> None:
        """Hint that the bytes from ``offset`` on will be read soon (may do nothing)."""
        del offset  # Only a hint: nothing to do unless the storage can prefetch.

    @abc.abstractmethod
    def close(self) -> None:
        """Release the object; further reads are errors."""

    def stream(self, offset: int = 0) -> io.RawIOBase:
        """A sequential reader from ``offset`` (bytes; for ``io.BufferedReader``)."""
        return _Stream(self, offset)

    def __enter__(self) -> Readable:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_exactly(readable: Readable, view: memoryview, offset: int) -> None:
    """Fill ``view`` with the bytes of ``readable`` at ``offset``.

    Raises:
        EOFError: The object ends before ``view`` is full.
        OSError: A read failed.
    """
    done = 0
    while done < len(view):
        n = readable.readinto(view[done:], offset + done)
        if not n:
            raise EOFError(f"{readable.path} ends at byte {offset + done}")
        done += n


def read_whole(f: Readable, *, max_bytes: int) -> bytes:
    """Every byte of ``f``, up to its size when it was opened (fewer if it ended sooner).

    Raises:
        OSError: A read failed; ``EFBIG`` if ``f`` is larger than ``max_bytes``.
    """
    if f.size > max_bytes:
        raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes ({f.size})", f.path)
    data = bytearray(f.size)
    done = 0
    while done < f.size:
        n = f.readinto(memoryview(data)[done:], done)
        if not n:
            break
        done += n
    return bytes(data[:done])


class _Stream(io.RawIOBase):
    """A ``Readable`` read in order from an offset (events files, manifests, record files)."""

    def __init__(self, readable: Readable, offset: int = 0) -> None:
        self._readable = readable
        self._offset = offset

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = self._readable.readinto(view, self._offset)
        self._offset += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._readable.close()
        super().close()


class Appendable(abc.ABC):
    """An object that grows by appends (an events file); durable up to the last ``sync``.

    Attributes:
        path: Where it lives.
        roll_bytes: Advice to the writer: start a new file once this one holds this many
            bytes (on an object store, where each ``sync`` uploads the file whole, it bounds
            what one ``sync`` sends); None: never.

    Thread safety: one writer thread.
    """

    path: str
    roll_bytes: int | None = None

    @abc.abstractmethod
    def write(self, data: Buffer) -> None:
        """Append all of ``data``.

        Raises:
            OSError: The write failed (what came before stays).
        """

    @abc.abstractmethod
    def sync(self) -> None:
        """Make everything appended so far durable (locally: fsync; a bucket: upload).

        Raises:
            OSError: It could not be made durable.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Close the object (without a ``sync``)."""


class DirectoryLock(abc.ABC):
    """A handle on a directory's writer lock; ``release`` it once (later calls do nothing).

    Attributes:
        directory: The locked directory.

    Thread safety: ``release`` may be called from any thread.
    """

    directory: str

    @abc.abstractmethod
    def release(self) -> None:
        """Give the handle back."""

    def on_lost(self, callback: Callable[[Exception], object]) -> None:
        """Call ``callback(error)`` if the lock is ever lost (a lease on an object store that
        another writer took over); a lock the operating system holds is never lost."""
        del callback

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class Storage(abc.ABC):
    """Where checkpoints and events files live (see the module docstring).

    Call order of a checkpoint's commit (``checkpoint/commit.py``), on one writer:

    1. ``lock(directory)`` once, at the writer's first save to the directory;
    2. ``exists`` / ``list`` / ``open_read``: check what the save references and overwrites;
    3. ``delete(P.index)`` if the prefix is saved again (``P`` is then incomplete);
    4. ``put(P.data-i-of-N)`` for each shard (in a sharded save: each rank its own);
    5. ``put(P.index)``: the commit point (the coordinator only);
    6. ``put(<state file>)``, then ``delete`` what retention lets go.

    Thread safety: every method may be called from any thread.
    """

    # ------------------------------------------------------------------------------ writing

    @abc.abstractmethod
    def put(
        self, path: str, chunks: Iterable[Buffer], *, cancel: threading.Event | None = None
    ) -> None:
        """Write the object ``path`` from ``chunks``, atomically.

        Args:
            path: The object (its directory must exist).
            chunks: Its bytes, in order (read once; buffers are not kept after the call).
            cancel: Checked between writes: once set, the put stops and raises
                ``WriteCancelled``.

        Raises:
            WriteCancelled: ``cancel`` was set; the object is as before.
            OSError: The write failed; the object holds what it held before, or nothing
                (locally: the rename happened but could not be made durable, and the new
                object was taken back). Nothing else of the attempt remains.
        """

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Delete the object ``path``, durably.

        Raises:
            FileNotFoundError: It does not exist.
            OSError: It could not be deleted.
        """

    @abc.abstractmethod
    def makedirs(self, path: str) -> None:
        """Create directory ``path`` and its parents if missing (a bucket has nothing to do).

        Raises:
            OSError: It could not be created.
        """

    @abc.abstractmethod
    def open_append(self, path: str) -> Appendable:
        """Create the object ``path``, which must not exist, to append to it.

        Raises:
            FileExistsError: It exists.
            OSError: It could not be created.
        """

    # ------------------------------------------------------------------------------ reading

    @abc.abstractmethod
    def open_read(self, path: str, *, inside: str | None = None) -> Readable:
        """Open the object ``path`` for ranged reads.

        Args:
            path: The object.
            inside: A directory the object must really lie in (locally: after symbolic
                links are resolved); None: not checked.

        Raises:
            FileNotFoundError: It does not exist.
            NotRegularFileError: It is a FIFO, a device, a socket or a directory (checked
                before anything is read: opening never blocks).
            OutsideDirectoryError: It lies outside ``inside`` (a ``PermissionError``).
            OSError: It cannot be opened.
        """

    def read_bytes(self, path: str, *, max_bytes: int) -> bytes:
        """Return the whole object ``path`` (a manifest, a state file).

        Raises:
            FileNotFoundError, NotRegularFileError, OSError: As ``open_read``; ``OSError``
                with ``EFBIG`` if it is larger than ``max_bytes``.
        """
        with self.open_read(path) as f:
            return read_whole(f, max_bytes=max_bytes)

    @abc.abstractmethod
    def list(self, directory: str) -> list[str]:
        """Return the names (not paths) of the committed objects in ``directory``.

        Writes in progress (temporary files) are never listed; sub-directories are.

        Raises:
            FileNotFoundError: The directory does not exist.
            OSError: It cannot be listed.
        """

    @abc.abstractmethod
    def list_tree(self, directory: str) -> list[str]:
        """Return the paths, relative to ``directory``, of every object below it, sorted.

        Raises:
            FileNotFoundError: The directory does not exist.
            OSError: It cannot be listed.
        """

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Return True if ``path`` exists (an object, or locally anything at all)."""

    @abc.abstractmethod
    def is_file(self, path: str) -> bool:
        """Return True if ``path`` is a regular object (locally: a regular file, after links)."""

    @abc.abstractmethod
    def is_dir(self, path: str) -> bool:
        """Return True if ``path`` is a directory (a bucket: a prefix holding objects)."""

    def accepts_objects(self, directory: str) -> bool:
        """Return True if objects can be put in ``directory`` now.

        Locally: it is a directory (``makedirs`` made it); on an object store: any prefix
        (a prefix needs no directory object).
        """
        return self.is_dir(directory)

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Return the size of object ``path`` in bytes.

        Raises:
            OSError: It does not exist or cannot be examined.
        """

    @abc.abstractmethod
    def mtime(self, path: str) -> float:
        """Return the modification time of ``path`` in seconds since the epoch.

        Raises:
            OSError: It does not exist or cannot be examined.
        """

    @abc.abstractmethod
    def canonical(self, path: str) -> str:
        """Return the one name of the place ``path`` names (locally: links resolved)."""

    # ----------------------------------------------------------------------- one writer

    @abc.abstractmethod
    def lock(self, directory: str) -> DirectoryLock:
        """Take the writer lock of ``directory`` for this process (shared within it).

        Raises:
            LogdirLockedError: Another process holds it; the message names that writer.
        """

    @abc.abstractmethod
    def lock_owner(self, directory: str) -> dict[str, object]:
        """Return what ``directory``'s lock says about its writer (may be stale); {} if none."""

    def recover_spooled(self, directory: str) -> list[str]:
        """Upload what an earlier run of ``directory`` left in a local spool; return the
        paths uploaded. Nothing to do where writes go straight to their place (local files).
        """
        del directory
        return []

    @abc.abstractmethod
    def leftovers(self, directory: str) -> list[str]:
        """Return what interrupted writes left in ``directory`` (not recursively), sorted.

        Locally: temporary files; in a bucket: unfinished uploads. Empty if the directory
        does not exist.

        Raises:
            OSError: The directory could not be listed.
        """

    def clean_leftovers(self, directory: str) -> list[str]:
        """Remove ``leftovers(directory)``; call only when no write there is in flight.

        Returns:
            The paths removed.

        Raises:
            OSError: The directory could not be listed or a leftover removed.
        """
        removed = []
        for path in self.leftovers(directory):
            try:
                self.delete(path)
            except FileNotFoundError:
                continue
            removed.append(path)
        return removed
