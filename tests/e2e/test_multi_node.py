"""Two nodes without a shared file system, checkpointing to S3 (SeaweedFS).

Each "node" is its own ``torchrun --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d`` agent
with its own working directory; the only things they share are the rendezvous endpoint and
the bucket. The chief's worker is killed with SIGKILL in the middle of training: torchrun
(``--max-restarts=1``) restarts the whole group, and every rank must resume from the one
checkpoint that was committed when the chief died, then train to the end. The FSDP2
checkpoint written by two ranks is then restored by one (resharding), straight from S3.
(Two nodes of a replicated (DDP) run, one of them lost, are ``test_node_loss.py``'s.)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from free_ports import free_port
from process_tree import children, rank_of
from repo_paths import repo

from torchsupervisor.checkpoint.state_file import latest_checkpoint
from torchsupervisor.storage import storage_for

ROOT = repo()
MAX_STEPS = 140  # The kill comes at the first checkpoint past step 0 (step 4-62 here).
_RESUMED = re.compile(r"rank (\d+): resumed at step (\d+) from (\S+)")


def _committed_steps(url: str) -> list[int]:
    return sorted(
        int(name[len("model.ckpt-") : -len(".index")])
        for name in storage_for(url).list(url)
        if name.startswith("model.ckpt-") and name.endswith(".index")
    )


def _node(example, url, port, workdir, env):
    """One node: a torchrun agent with one worker, its output in ``workdir/out.log``."""
    workdir.mkdir()
    log = open(workdir / "out.log", "w")  # noqa: SIM115 (closed by the test)
    command = [
        sys.executable,
        *("-m", "torch.distributed.run"),
        *("--nnodes=2", "--nproc_per_node=1", "--max-restarts=1"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=multi-node"),
        os.path.join(ROOT, "examples", example),
        *("--logdir", url, "--max-steps", str(MAX_STEPS), "--save-model-secs", "0.5"),
    ]
    process = subprocess.Popen(
        command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, text=True, env=env
    )
    return process, log


def _worker_with_rank(agents, rank: int, deadline: float) -> int:
    while time.monotonic() < deadline:
        for agent in agents:
            for pid in children(agent.pid):
                if rank_of(pid) == rank:
                    return pid
        time.sleep(0.1)
    raise AssertionError(f"no worker with RANK={rank} among the agents' children")


@pytest.mark.parametrize("example", ["fsdp_digits.py"])
def test_two_nodes_resume_from_s3_after_the_chief_is_killed(s3_server, s3_url, tmp_path, example):
    # The agents log their rendezvous rounds (INFO), shown in full if the test fails: a
    # restart round that did not form was seen once (node0 waited for the role infos of a
    # round node1 had not finished joining) and is not understood yet.
    env = {**os.environ, **s3_server.env, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO"}
    port = free_port()
    nodes = [_node(example, s3_url, port, tmp_path / f"node{i}", env) for i in (0, 1)]
    agents = [process for process, _ in nodes]
    try:
        deadline = time.monotonic() + 120
        while not [step for step in _committed_steps(s3_url) if step > 0]:
            assert all(a.poll() is None for a in agents), "a node ended before the kill"
            assert time.monotonic() < deadline, "no checkpoint past step 0 within 120 s"
            time.sleep(0.1)
        chief = _worker_with_rank(agents, 0, deadline)
        os.kill(chief, signal.SIGKILL)
        # Only the chief commits (the manifest and the state file): nothing commits after it.
        killed_at = max(_committed_steps(s3_url))
        assert killed_at < MAX_STEPS, "training ended before the kill: raise MAX_STEPS"
        for agent in agents:
            agent.wait(300)
    finally:
        for process, log in nodes:
            if process.poll() is None:
                process.kill()
                process.wait(30)
            log.close()
    outputs = [(tmp_path / f"node{i}" / "out.log").read_text() for i in (0, 1)]
    # torchrun saw the killed worker (and then restarted the group: the resumes below).
    assert any("exitcode: -9" in output for output in outputs), outputs
    assert [a.returncode for a in agents] == [0, 0], "\n\n".join(outputs)

    # Each rank printed its resume once, after the restart, from the checkpoint committed
    # when the chief died; then each trained to the end.
    resumed = sorted(m.groups() for o in outputs for m in _RESUMED.finditer(o))
    expected = f"{s3_url}/model.ckpt-{killed_at}"
    assert resumed == [("0", str(killed_at), expected), ("1", str(killed_at), expected)]
    text = "\n".join(outputs)
    for rank in (0, 1):
        assert f"rank {rank}: done at step {MAX_STEPS}" in text
    assert latest_checkpoint(s3_url) == f"{s3_url}/model.ckpt-{MAX_STEPS}"
    assert storage_for(s3_url).leftovers(s3_url) == []

    if example == "fsdp_digits.py":
        _restores_on_one_rank(s3_url, env, tmp_path / "single")


def _restores_on_one_rank(url, env, workdir):
    """The two ranks' FSDP2 checkpoint, resharded onto one rank, read straight from S3."""
    workdir.mkdir()
    single = subprocess.run(
        [
            sys.executable,
            *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"),
            os.path.join(ROOT, "examples", "fsdp_digits.py"),
            *("--logdir", url, "--max-steps", str(MAX_STEPS + 10)),
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert single.returncode == 0, single.stdout[-2000:] + single.stderr[-3000:]
    assert f"rank 0: resumed at step {MAX_STEPS} from {url}/model.ckpt-{MAX_STEPS}" in (
        single.stdout
    )
    assert f"rank 0: done at step {MAX_STEPS + 10}" in single.stdout
    assert os.listdir(workdir) == []  # Nothing was copied to the local disk.
