"""Start the disk writing bytes just written, without waiting: ``sync_file_range(2)``.

A file written through the page cache and then fsynced leaves the disk idle while the pages
fill, then waits for all of them at the fsync. Asking the kernel to start writing each piece
back as soon as it is in the page cache overlaps the disk's work with the next pieces' writes:
a 500 MB export in files of 100 MB, each fsynced, took 0.48-0.50 s instead of 0.57-0.63 s here
(``POSIX_FADV_DONTNEED``, which also starts a writeback, gave nothing). The fsync that follows
still decides durability and reports any error; this is only a hint, and a no-op where the OS
lacks the call (not Linux) or the file system has no writeback (a tmpfs).

TF name: none.
"""

from __future__ import annotations

import ctypes
import functools
import sys

__all__ = ["start_writeback"]

_SYNC_FILE_RANGE_WRITE = 2  # Linux: start writing the range's dirty pages, do not wait.


@functools.cache
def _sync_file_range() -> ctypes._CFuncPtr | None:
    """libc's ``sync_file_range``, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # A libc without it (not glibc or musl).
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` of ``fd`` from ``offset`` (bytes) to disk.

    Returns at once (the request is queued; a full device queue may block briefly). Errors are
    ignored: the caller's fsync reports them.

    Thread safety: any thread.
    """
    function = _sync_file_range()
    if function is not None and nbytes > 0:
        function(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
