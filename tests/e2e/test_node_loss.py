"""A whole node lost: the chief's node (its torchrun agent and worker killed, its memory root
deleted) comes back empty, and the run resumes from the peer copies another node kept, not
from the disk: a replicated (DDP) run from the copy of the chief's snapshot, a sharded (FSDP2)
run from the copy of the lost rank's part (and the survivor's own part, whichever ranks the
nodes get in the next round).

Each "node" is a ``torchrun --nnodes=N --nproc_per_node=1`` agent (N = 2, 3) with its own working
directory and memory root; the rendezvous store is hosted by this test (as an etcd or a login
node would be), so that losing any node does not lose it. The log directory is shared (the
disk tier), and holds only the checkpoint of the start: a resume past it comes from the
memory tier. The final checkpoint is then bitwise the one of the same run without the loss
(``torchrun --standalone``): the copy held every rank's random streams.
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

import pytest
import torch
import torch.distributed as dist
from example_runs import finish, start_example
from free_ports import free_port
from process_tree import children, rank_of
from repo_paths import repo

from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.checkpoint.state_file import latest_checkpoint
from torchsupervisor.tiers.memory_root import memory_root, run_key

ROOT = repo()
MAX_STEPS = 80
_RESUMED = re.compile(r"rank (\d+): resumed at step (\d+) from (\S+)( \(memory tier\))?")


def _agent(
    port: int, logdir: str, workdir, env, n: int, example: str, nproc: int
) -> tuple[subprocess.Popen, object]:
    workdir.mkdir()
    (workdir / "shm").mkdir()
    log = open(workdir / "out.log", "w")  # noqa: SIM115 (closed by the test)
    command = [
        sys.executable,
        *("-m", "torch.distributed.run"),
        *(f"--nnodes={n}", f"--nproc_per_node={nproc}", "--max-restarts=1"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=node-loss"),
        # A lost node leaves the rendezvous when its heartbeats stop: after 2 s, not 15.
        "--rdzv-conf=is_host=false,keep_alive_interval=1,keep_alive_max_attempt=2",
        os.path.join(ROOT, "examples", example.split()[0]),
        *("--logdir", logdir, "--max-steps", str(MAX_STEPS), "--save-model-secs", "3600"),
        *("--memory-every-n-steps", "1", "--log-every", "50", *example.split()[1:]),
    ]
    env = {
        **env,
        "TORCHSUPERVISOR_MEMORY_ROOT": str(workdir / "shm"),
        # A survivor that is not rank 0 of the next round keeps the old round's agent-store
        # address when torchrun shares it (a torch bug; docs/distributed.md).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    process = subprocess.Popen(
        command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, text=True, env=env
    )
    return process, log


def _worker_with_rank(agents, rank: int, deadline: float) -> tuple[int, int]:
    """The pid of the worker with ``rank`` and the index of its node (agent)."""
    while time.monotonic() < deadline:
        for node, agent in enumerate(agents):
            for pid in children(agent.pid):
                if rank_of(pid) == rank:
                    return pid, node
        time.sleep(0.1)
    raise AssertionError(f"no worker with RANK={rank} among the agents' children")


_UNINTERRUPTED: dict[tuple[str, int], str] = {}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final checkpoint of the run without the node loss, by example and world size (one
    ``torchrun --standalone`` of the same training, made once per module)."""

    def final(example: str, world: int) -> CheckpointReader:
        if (example, world) not in _UNINTERRUPTED:
            root = tmp_path_factory.mktemp("uninterrupted")
            logdir = root / "logdir"
            process = start_example(
                example.split()[0],
                logdir,
                root,
                *("--max-steps", str(MAX_STEPS), "--save-model-secs", "3600"),
                *("--memory-every-n-steps", "1", "--log-every", "50", *example.split()[1:]),
                nproc=world,
            )
            finish(process, root)
            _UNINTERRUPTED[(example, world)] = latest_checkpoint(str(logdir))
        return CheckpointReader(_UNINTERRUPTED[(example, world)])

    return final


def _peer_copies(workdir, logdir: str, owner: int = 0) -> list[int]:
    run = os.path.join(memory_root(str(workdir / "shm")), run_key(logdir))
    found = glob.glob(os.path.join(run, f"peer-{owner}", "model.ckpt-*.index"))
    return sorted(int(os.path.basename(p)[len("model.ckpt-") : -len(".index")]) for p in found)


@pytest.mark.parametrize(
    ("example", "n", "nproc", "bitwise"),
    [
        ("ddp_digits.py", 2, 1, True),
        # Three nodes in make test-slow (the ring's wrap-around: test_ring).
        pytest.param("ddp_digits.py", 3, 1, True, marks=pytest.mark.slow),
        # The sharded runs in make test-slow (4 ranks on 2 cores: 45 s, a run without the
        # loss 20 s more for the bitwise comparison; it held at 2 x 2). The suite keeps a
        # sharded restore from peer copies in tests/tiers/test_ring.py (real processes, a
        # damaged copy refused) and the node loss of a replicated run above. At 2 x 2, rank
        # 0's copies are on rank 2, rank 1's on rank 3, and each node has two servers.
        pytest.param("fsdp_digits.py", 2, 1, True, marks=pytest.mark.slow),
        pytest.param("fsdp_digits.py", 2, 2, True, marks=pytest.mark.slow),
        pytest.param("fsdp_digits.py", 3, 1, True, marks=pytest.mark.slow),
        # The example's arguments after its name: under a MonitoredTrainingSession.
        pytest.param("fsdp_digits.py --front-end monitored", 2, 1, True, marks=pytest.mark.slow),
    ],
    ids=[
        "DDP, 2 nodes",
        "DDP, 3 nodes",
        "FSDP2, 2 nodes",
        "FSDP2, 2 nodes x 2 ranks",
        "FSDP2, 3 nodes",
        "FSDP2 MonitoredTrainingSession, 2 nodes",
    ],
)
def test_the_chiefs_node_is_lost_and_the_run_resumes_from_its_peer_copy(
    tmp_path, uninterrupted, example, n, nproc, bitwise
):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    logdir = str(tmp_path / "logdir")
    nodes = {
        i: _agent(port, logdir, tmp_path / f"node{i}", env, n, example, nproc) for i in range(n)
    }
    world = n * nproc
    try:
        deadline = time.monotonic() + 180
        agents = [nodes[i][0] for i in range(n)]
        _, chief_node = _worker_with_rank(agents, 0, deadline)
        # The chief's peer: the first rank of the next node (the same position on it).
        _, peer_node = _worker_with_rank(agents, nproc, deadline)
        while not [s for s in _peer_copies(tmp_path / f"node{peer_node}", logdir) if s >= 20]:
            assert all(p.poll() is None for p, _ in nodes.values()), "a node ended too soon"
            assert time.monotonic() < deadline, "no peer copy past step 20 within 180 s"
            time.sleep(0.05)
        # The node is lost: its agent and workers killed, its memory gone.
        agent = nodes[chief_node][0]
        for pid in (agent.pid, *children(agent.pid)):
            os.kill(pid, signal.SIGKILL)
        agent.wait(30)
        shutil.rmtree(tmp_path / f"node{chief_node}" / "shm")
        # The newest step of which the peer node holds every part of the lost node (its ranks'
        # senders may be snapshots apart; a put committing just now may add a newer one).
        peer_dir = tmp_path / f"node{peer_node}"
        held = [set(_peer_copies(peer_dir, logdir, r)) for r in range(nproc)]
        copied = max(set.intersection(*held), default=-1)
        assert copied < MAX_STEPS, "training ended before the node loss: raise MAX_STEPS"
        # It comes back, empty.
        nodes[n] = _agent(port, logdir, tmp_path / f"node{n}", env, n, example, nproc)
        alive = [i for i in nodes if i != chief_node]
        for i in alive:
            nodes[i][0].wait(300)
    finally:
        for process, log in nodes.values():
            if process.poll() is None:
                process.kill()
                process.wait(30)
            log.close()
        del store
    outputs = [(tmp_path / f"node{i}" / "out.log").read_text() for i in alive]
    assert [nodes[i][0].returncode for i in alive] == [0] * n, "\n\n".join(
        o[-3000:] for o in outputs
    )
    text = "\n".join(outputs)
    resumed = sorted(m.groups() for m in _RESUMED.finditer(text))
    assert len(resumed) == world, resumed
    step = int(resumed[0][1])
    # The chief resumed from the memory tier at a step no older than the copy seen before the
    # loss (the disk held only the checkpoint of the start), and every rank with it.
    assert resumed[0][0] == "0" and resumed[0][3] == " (memory tier)", resumed
    if example.startswith("fsdp_digits.py"):  # Every rank restored its own part from memory.
        assert all(r[3] == " (memory tier)" for r in resumed), resumed
        assert f"Resumed at step {step} from the memory tier, from a peer copy" in text
    assert step >= copied
    assert sorted((int(r[0]), r[1]) for r in resumed) == [
        (rank, str(step)) for rank in range(world)
    ]
    assert "peer copy" in text
    assert len(re.findall(rf"rank \d: done at step {MAX_STEPS}", text)) == world
    assert latest_checkpoint(logdir).endswith(f"model.ckpt-{MAX_STEPS}")
    # A clean end whose final checkpoint holds the last step frees the memory and the copies.
    for i in alive:
        assert os.listdir(memory_root(str(tmp_path / f"node{i}" / "shm"))) == [], i
    if bitwise:
        # Bitwise the run without the loss, every rank's random streams included (but NumPy's
        # generator, which the examples never seed: each process starts it from the OS).
        final, expected = CheckpointReader(latest_checkpoint(logdir)), uninterrupted(example, world)
        names = sorted(expected.get_variable_to_shape_map())
        assert sorted(final.get_variable_to_shape_map()) == names
        differ = [
            name
            for name in names
            if not name.endswith("numpy/keys")
            and not torch.equal(final.get_tensor(name), expected.get_tensor(name))
        ]
        assert differ == [], differ
        # Every rank's streams at the end (the chief saved them with a DDP run's memory tier).
        records = [r.read_specs()["rng"].get("replicas") for r in (final, expected)]
        assert records[0] == records[1]
