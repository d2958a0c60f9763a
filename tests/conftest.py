"""Shared fixtures: a clean default graph per test, no leaked threads, a fake clock, a real S3
server (SeaweedFS, started once per session on loopback) and ``memory://`` buckets."""

from __future__ import annotations

import os

# One compute thread in every process the tests start, the workers included (a user's setting
# wins). The suite runs two workers on two cores and many tests start several processes: at
# torch's default of a thread per core they fought over the cores. Measured on the slowest
# tests (demo, distributed examples, determinism, preemption; -n 2, two runs each): 145-163 s
# and 245-278 s of CPU with one thread, 184-198 s and 326-348 s of CPU without.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import threading
import time
import uuid

import pytest

from torchsupervisor.core.registry import reset_default_graph
from torchsupervisor.summary import SummaryWriterCache
from torchsupervisor.testing import FakeClock, wait_for_quiet


@pytest.fixture(scope="session", autouse=True)
def _events_spool(tmp_path_factory):
    """The local spool of events files for object stores: one of the test session's own
    (inherited by the subprocesses tests start), not the user's ``~/.cache``."""
    import os

    previous = os.environ.get("TORCHSUPERVISOR_SPOOL_DIR")
    os.environ["TORCHSUPERVISOR_SPOOL_DIR"] = str(tmp_path_factory.mktemp("events-spool"))
    yield
    if previous is None:
        os.environ.pop("TORCHSUPERVISOR_SPOOL_DIR", None)
    else:
        os.environ["TORCHSUPERVISOR_SPOOL_DIR"] = previous


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """SeaweedFS serving S3 on 127.0.0.1 for the whole session (see ``s3_server.py``)."""
    import s3_server as server_module

    from torchsupervisor import storage

    with server_module.running(str(tmp_path_factory.mktemp("seaweedfs"))) as server:
        storage.configure(f"s3://{server_module.BUCKET}", **server.options())
        yield server


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real SLURM on this host for the whole session (``slurm_cluster.py``); skipped with
    the reason where it is not installed or the tests do not run as root (slurmd must)."""
    import slurm_cluster

    absent = slurm_cluster.missing()
    if absent:
        pytest.skip(
            f"SLURM is not installed ({', '.join(absent)} missing): `make install` as root "
            "installs Debian's slurm-wlm and munge"
        )
    if os.geteuid() != 0:
        pytest.skip("a SLURM of this host needs root (slurmd runs jobs as their users)")
    with slurm_cluster.running(str(tmp_path_factory.mktemp("slurm"))) as cluster:
        yield cluster


def _fresh_prefix(scheme: str, bucket: str, request) -> str:
    """``<scheme>://<bucket>/<test>-<8 hex>``: a prefix of this test's own in a test bucket."""
    name = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")[:60]
    return f"{scheme}://{bucket}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def gcs_server():
    """fake-gcs-server on 127.0.0.1 for the whole session (see ``gcs_server.py``)."""
    import gcs_server as server_module

    from torchsupervisor import storage

    with server_module.running() as server:
        storage.configure(f"gs://{server_module.BUCKET}", **server.options())
        yield server


@pytest.fixture
def gs_url(gcs_server, request) -> str:
    """A fresh prefix in the GCS test bucket: ``gs://tsv-test/<test>-<8 hex>``."""
    import gcs_server as server_module

    return _fresh_prefix("gs", server_module.BUCKET, request)


@pytest.fixture(scope="session")
def azure_server():
    """Azurite on 127.0.0.1 for the whole session (see ``azure_server.py``); the az:// tests
    are skipped where it is not installed (no npm)."""
    import azure_server as server_module

    from torchsupervisor import storage

    if server_module.binary() is None:
        pytest.skip("Azurite is not installed (make install needs npm for it)")

    with server_module.running() as server:
        storage.configure(f"az://{server_module.CONTAINER}", **server.options())
        yield server


@pytest.fixture
def az_url(azure_server, request) -> str:
    """A fresh prefix in the Azure test container: ``az://tsv-test/<test>-<8 hex>``."""
    import azure_server as server_module

    return _fresh_prefix("az", server_module.CONTAINER, request)


@pytest.fixture
def s3_url(s3_server, request) -> str:
    """A fresh prefix in the test bucket: ``s3://tsv-test/<test>-<8 hex>``."""
    import s3_server as server_module

    return _fresh_prefix("s3", server_module.BUCKET, request)


@pytest.fixture
def memory_url(request) -> str:
    """A fresh ``memory://`` bucket, forgotten after the test."""
    from torchsupervisor.storage import memory

    yield f"memory://test-{uuid.uuid4().hex[:8]}/run"
    memory.clear_buckets()


@pytest.fixture(autouse=True)
def _clean_graph_and_threads():
    """Each test starts with an empty default graph and must not leave threads running."""
    reset_default_graph()
    before = set(threading.enumerate())
    yield
    SummaryWriterCache.clear()
    reset_default_graph()
    wait_for_quiet(10.0)  # Saves in flight, idle writer threads of savers still referenced.
    deadline = time.monotonic() + 10.0
    leaked = []
    for thread in set(threading.enumerate()) - before:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            leaked.append(thread.name)
    assert not leaked, f"threads still running after the test: {leaked}"


def pytest_terminal_summary(terminalreporter):
    """After ``make test-slow``: trials and failures of each adversarial class."""
    import adversarial_record

    lines = adversarial_record.report_lines()
    if lines:
        terminalreporter.section("adversarial trials")
        for line in lines:
            terminalreporter.write_line(line)
