"""An Azure Blob emulator for tests: Azurite (``npm install azurite``, which ``make install``
puts in ``.venv/azurite``), on 127.0.0.1 only, a free port, its blobs in memory.

Started once per test session by the ``azure_server`` fixture and stopped at its end;
start-up is bounded (``START_TIMEOUT_SECS``). Azurite checks conditions, Content-MD5 and staged
blocks as the service does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from emulators import launch, stop
from free_ports import free_port

START_TIMEOUT_SECS = 60.0
CONTAINER = "tsv-test"
ACCOUNT = "devstoreaccount1"
# Azurite's well-known development key (public, documented by Microsoft).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@dataclass
class AzureServer:
    """A running Azurite and what a client needs to reach it."""

    endpoint: str
    process: subprocess.Popen

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint={self.endpoint};"
        )

    def options(self) -> dict[str, object]:
        """``torchsupervisor.storage.configure`` options for this server."""
        return {"connection_string": self.connection_string, "read_timeout": 30.0}

    @property
    def env(self) -> dict[str, str]:
        """The variable that points azure-storage-blob (and our CLI) at this server."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}


def binary() -> str | None:
    """Azurite's blob server (in ``.venv/azurite`` beside this Python, or on PATH); None if
    it is not installed."""
    venv = os.path.dirname(os.path.dirname(sys.executable))
    beside = os.path.join(venv, "azurite", "node_modules", ".bin", "azurite-blob")
    return beside if os.path.exists(beside) else shutil.which("azurite-blob")


def start() -> AzureServer:
    """Start Azurite and make the container ``CONTAINER``.

    Raises:
        RuntimeError: It is not installed, or did not serve within ``START_TIMEOUT_SECS``.
    """
    found = binary()
    if found is None:
        raise RuntimeError("Azurite is not installed: make install (npm install azurite)")
    port = free_port()
    args = [
        *(found, "--blobHost", "127.0.0.1", "--blobPort", str(port)),
        *("--inMemoryPersistence", "--silent", "--skipApiVersionCheck", "--loose"),
    ]
    process = launch(args, port, START_TIMEOUT_SECS, "Azurite")
    server = AzureServer(f"http://127.0.0.1:{port}/{ACCOUNT}", process)
    try:
        _make_container(server)
    except BaseException:
        stop(server)
        raise
    return server


def _make_container(server: AzureServer) -> None:
    from azure.storage.blob import BlobServiceClient

    BlobServiceClient.from_connection_string(server.connection_string).create_container(CONTAINER)


@contextlib.contextmanager
def running() -> Iterator[AzureServer]:
    """``start`` and, on leaving, ``stop``."""
    server = start()
    try:
        yield server
    finally:
        stop(server)
