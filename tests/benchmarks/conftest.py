"""Run a script of ``benchmarks/`` as a user would, and read its JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from repo_paths import repo


@pytest.fixture
def run_benchmark(tmp_path) -> Callable[..., tuple[str, Any]]:
    """``run_benchmark(name, *args)``: run ``benchmarks/<name>.py ARGS --json FILE`` (one
    thread per process, at most 300 s) and return its standard output and its report."""

    def run(name: str, *args: object) -> tuple[str, Any]:
        out = tmp_path / f"{name}.json"
        proc = subprocess.run(
            [sys.executable, repo("benchmarks", f"{name}.py"), *map(str, args), "--json", out],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout, json.loads(out.read_text())

    return run
