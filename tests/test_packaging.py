"""What pip users get: the sdist and the wheel built from this tree, and their metadata."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser

import pytest
from repo_paths import repo


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), repo()],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def _wheel(dist) -> zipfile.ZipFile:
    return zipfile.ZipFile(next(dist.glob("*.whl")))


def test_the_wheel_carries_the_license_the_typing_marker_and_metadata(dist):
    wheel = _wheel(dist)
    names = wheel.namelist()
    assert "torchsupervisor/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(wheel.read(meta_name).decode())
    assert meta["License-Expression"] == "Apache-2.0"  # SPDX, not the deprecated table
    assert not [c for c in meta.get_all("Classifier") if c.startswith("License ::")]
    assert "Typing :: Typed" in meta.get_all("Classifier")
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(urls)
    # The long description is written for pip users: pip commands, not make targets.
    body = meta.get_payload()
    assert "pip install torchsupervisor" in body and 'pip install "torchsupervisor[demo]"' in body
    assert "make demo" not in body and "make test" not in body
    assert meta["Description-Content-Type"] == "text/markdown"


def test_the_sdist_has_no_tests_that_could_not_run(dist):
    with tarfile.open(next(dist.glob("*.tar.gz"))) as sdist:
        names = [n.split("/", 1)[1] for n in sdist.getnames() if "/" in n]
    assert "LICENSE" in names and "pyproject.toml" in names
    assert any(n.startswith("torchsupervisor/") for n in names)
    # The tests need the repository (fixtures, workers, a SeaweedFS server): left out whole.
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", ".ci/"))]


@pytest.mark.slow
def test_a_clean_virtual_environment_gets_a_working_cli_and_a_clear_demo_message(
    dist, tmp_path, monkeypatch
):
    """``pip install torchsupervisor`` (no extras) in a fresh venv: the CLI works, and the
    demo names the extra it needs instead of failing with ``ModuleNotFoundError``."""
    import torch

    venv = tmp_path / "venv"
    # Nothing of the repository on the path: with a PYTHONPATH to it, pip found the package
    # "installed" (its egg-info) and skipped the wheel; from its root (on the path of
    # `python -c`), the checks below would run the repository's code, not the wheel's.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    monkeypatch.chdir(tmp_path)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, env=env)
    python, cli = str(venv / "bin" / "python"), str(venv / "bin" / "torchsupervisor")
    # torch pinned to this environment's release first (as the Makefile does), not PyPI's
    # newest (a multi-GB CUDA build); then the wheel, with its own dependencies only.
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    wheel = str(next(dist.glob("*.whl")))
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", torch_pin, wheel],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    where = "import torchsupervisor; print(torchsupervisor.__file__)"
    found = subprocess.run(
        [python, "-c", where], capture_output=True, text=True, timeout=300, env=env
    )
    assert found.stdout.startswith(str(venv)), found.stdout + found.stderr  # The wheel's.
    probe = subprocess.run(
        [python, "-c", "import sklearn"], capture_output=True, timeout=300, env=env
    )
    assert probe.returncode != 0, "scikit-learn came without the [demo] extra"

    logdir = str(tmp_path / "run")
    demo = subprocess.run(
        [cli, "demo", "--logdir", logdir, "--max-steps", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert demo.returncode == 1
    assert demo.stderr.startswith("torchsupervisor demo: error: "), demo.stderr
    assert 'pip install "torchsupervisor[demo]"' in demo.stderr
    assert "Traceback" not in demo.stderr

    missing = str(tmp_path / "nowhere")
    ls = subprocess.run([cli, "ls", missing], capture_output=True, text=True, timeout=300, env=env)
    assert ls.returncode != 0
    assert ls.stderr.startswith(
        "torchsupervisor ls: "
    ) and f"no such file or directory: {missing}" in (ls.stderr)
    # A checkpoint written with the installed package lists and verifies with its CLI.
    save = (
        "import os, torch, torchsupervisor as ts\n"
        f"os.makedirs({logdir!r})\n"
        f"ts.Saver({{'w': torch.ones(3)}}).save(None, {logdir + '/model.ckpt'!r}, global_step=7)\n"
    )
    subprocess.run([python, "-c", save], check=True, timeout=300, env=env)
    verify = subprocess.run(
        [cli, "verify", logdir], capture_output=True, text=True, timeout=300, env=env
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "ok" in verify.stdout and "model.ckpt-7" in verify.stdout
