"""Starting an emulator process (fake-gcs-server, Azurite) for a test session: in its own
session, killed with the test process, waited for (bounded) until it accepts connections."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Sequence

from s3_server import _die_with_parent, stop

__all__ = ["launch", "stop"]


def launch(args: Sequence[str], port: int, timeout_secs: float, name: str) -> subprocess.Popen:
    """Start ``args`` and return once 127.0.0.1:``port`` accepts connections.

    Raises:
        RuntimeError: It exited, or did not listen within ``timeout_secs`` (it is stopped).
    """
    process = subprocess.Popen(
        list(args),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    deadline = time.monotonic() + timeout_secs
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return process
        time.sleep(0.1)
    if process.poll() is None:
        process.kill()
        process.wait(10)
    raise RuntimeError(f"{name} did not start within {timeout_secs:g} s")
