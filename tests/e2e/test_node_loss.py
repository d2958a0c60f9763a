"""A whole node lost: the chief's node (its torchrun agent and worker killed, its memory root
deleted) comes back empty, and the replicated (DDP) run resumes from the peer copy of the
chief's memory-tier snapshot that the other node kept, not from the disk.

Each "node" is a ``torchrun --nnodes=2 --nproc_per_node=1`` agent with its own working
directory and memory root; the rendezvous store is hosted by this test (as an etcd or a
login node would be), so that losing either node does not lose it. The log directory is
shared (the disk tier), and holds only the checkpoint of the start: a resume past it comes
from the memory tier.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import torch.distributed as dist
from free_ports import free_port
from repo_paths import repo

from torchsupervisor.checkpoint.state_file import latest_checkpoint
from torchsupervisor.tiers.memory_root import memory_root, run_key

from .test_multi_node import _worker_with_rank

ROOT = repo()
MAX_STEPS = 400
_RESUMED = re.compile(r"rank (\d+): resumed at step (\d+) from (\S+)( \(memory tier\))?")


def _agent(port: int, logdir: str, workdir, env) -> tuple[subprocess.Popen, object]:
    workdir.mkdir()
    (workdir / "shm").mkdir()
    log = open(workdir / "out.log", "w")  # noqa: SIM115 (closed by the test)
    command = [
        sys.executable,
        *("-m", "torch.distributed.run"),
        *("--nnodes=2", "--nproc_per_node=1", "--max-restarts=1"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=node-loss"),
        "--rdzv-conf=is_host=false",
        os.path.join(ROOT, "examples", "ddp_digits.py"),
        *("--logdir", logdir, "--max-steps", str(MAX_STEPS), "--save-model-secs", "3600"),
        *("--memory-every-n-steps", "1", "--log-every", "50"),
    ]
    env = {**env, "TORCHSUPERVISOR_MEMORY_ROOT": str(workdir / "shm")}
    process = subprocess.Popen(
        command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, text=True, env=env
    )
    return process, log


def _peer_copies(workdir, logdir: str) -> list[int]:
    run = os.path.join(memory_root(str(workdir / "shm")), run_key(logdir))
    found = glob.glob(os.path.join(run, "peer-0", "model.ckpt-*.index"))
    return sorted(int(os.path.basename(p)[len("model.ckpt-") : -len(".index")]) for p in found)


def test_the_chiefs_node_is_lost_and_the_run_resumes_from_its_peer_copy(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    logdir = str(tmp_path / "logdir")
    nodes = {i: _agent(port, logdir, tmp_path / f"node{i}", env) for i in (0, 1)}
    try:
        deadline = time.monotonic() + 180
        chief, chief_node = _worker_with_rank([nodes[0][0], nodes[1][0]], 0, deadline)
        peer_node = 1 - chief_node
        while not [s for s in _peer_copies(tmp_path / f"node{peer_node}", logdir) if s >= 20]:
            assert all(p.poll() is None for p, _ in nodes.values()), "a node ended too soon"
            assert time.monotonic() < deadline, "no peer copy past step 20 within 180 s"
            time.sleep(0.05)
        # The node is lost: its agent and worker killed, its memory gone.
        agent = nodes[chief_node][0]
        for pid in (agent.pid, chief):
            os.kill(pid, signal.SIGKILL)
        agent.wait(30)
        shutil.rmtree(tmp_path / f"node{chief_node}" / "shm")
        copied = max(_peer_copies(tmp_path / f"node{peer_node}", logdir))
        assert copied < MAX_STEPS, "training ended before the node loss: raise MAX_STEPS"
        # It comes back, empty.
        nodes[2] = _agent(port, logdir, tmp_path / "node2", env)
        for process in (nodes[peer_node][0], nodes[2][0]):
            process.wait(300)
    finally:
        for process, log in nodes.values():
            if process.poll() is None:
                process.kill()
                process.wait(30)
            log.close()
        del store
    survivor = (tmp_path / f"node{peer_node}" / "out.log").read_text()
    back = (tmp_path / "node2" / "out.log").read_text()
    assert [nodes[peer_node][0].returncode, nodes[2][0].returncode] == [0, 0], (
        survivor[-3000:] + "\n\n" + back[-3000:]
    )
    resumed = sorted(m.groups() for o in (survivor, back) for m in _RESUMED.finditer(o))
    (rank0, rank1) = resumed
    step = int(rank0[1])
    # The chief resumed from the memory tier at a step no older than the copy seen before the
    # loss; the disk held only the checkpoint of the start.
    assert rank0[0] == "0" and rank0[3] == " (memory tier)", resumed
    assert step >= copied and rank1[:2] == ("1", str(step))
    assert "peer copy" in survivor + back
    for output in (survivor, back):
        assert re.search(rf"rank \d: done at step {MAX_STEPS}", output)
    assert latest_checkpoint(logdir).endswith(f"model.ckpt-{MAX_STEPS}")
    # A clean end whose final checkpoint holds the last step frees the memory and the copies.
    for node in (peer_node, 2):
        assert os.listdir(memory_root(str(tmp_path / f"node{node}" / "shm"))) == []
