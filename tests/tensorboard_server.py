"""A real TensorBoard server for tests, on 127.0.0.1 and a free port, stopped on exit."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

from free_ports import free_port

STOP_TIMEOUT_SECS = 30


def get_json(url: str):
    """The JSON answer of a GET (10 s timeout)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read().decode("utf-8"))


@dataclass
class Server:
    """A running ``tensorboard``: its base URL, process and log file."""

    base: str
    process: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def scalars(self, tag: str, run: str = ".") -> list[tuple[int, float]]:
        """``(step, value)`` of a scalar tag, from the scalars plugin's HTTP API."""
        query = urllib.parse.urlencode({"run": run, "tag": tag})
        points = get_json(f"{self.base}/data/plugin/scalars/scalars?{query}")
        return [(int(step), float(value)) for _, step, value in points]


@contextlib.contextmanager
def serve(logdir: str, log_dir: str, *extra: str, env=None) -> Iterator[Server]:
    """Run ``tensorboard --logdir LOGDIR`` (reloading every second) until the block ends.

    ``extra``: further flags (``--load_fast=false`` for the legacy loader). The server's
    output goes to ``log_dir/tensorboard.log``.
    """
    port = free_port()
    log_path = os.path.join(log_dir, "tensorboard.log")
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                *("-m", "tensorboard.main", "--logdir", logdir, "--host", "127.0.0.1"),
                *("--port", str(port), "--reload_interval", "1", *extra),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        yield Server(f"http://127.0.0.1:{port}", process, log_path)
    finally:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_SECS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_SECS)
