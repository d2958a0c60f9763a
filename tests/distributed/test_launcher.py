"""The launcher seam: torchrun's and SLURM's variables, and ranks that meet through SLURM's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from free_ports import free_port

from torchsupervisor.distributed import env as dist_env
from torchsupervisor.distributed import launcher as launcher_module
from torchsupervisor.distributed.launcher import (
    SlurmLauncher,
    TorchrunLauncher,
    current_launcher,
    first_host,
)
from torchsupervisor.errors import InvalidArgumentError, UnavailableError

SLURM = {
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_RESTART_COUNT": "3",
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1",
}
TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "1",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_RUN_ID": "run-7",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


def test_slurm_variables_give_the_place_of_this_task():
    launcher = current_launcher(SLURM)
    assert isinstance(launcher, SlurmLauncher) and launcher.name == "slurm"
    assert (launcher.rank, launcher.world_size, launcher.local_rank, launcher.node_id) == (
        5,
        8,
        1,
        2,
    )
    assert launcher.restart_count == 3 and launcher.job_id == "123456" and launcher.launched
    # No MASTER_ADDR/PORT: the first host of the node list, a port from the job id.
    assert (launcher.master_addr, launcher.master_port) == ("gpu07", 20000 + 123456 % 10000)
    assert launcher.rendezvous(5.0) == {
        "init_method": "tcp://gpu07:23456",
        "rank": 5,
        "world_size": 8,
    }
    assert launcher.store_outlives_attempts(object()) is False


def test_master_addr_and_port_win_over_the_node_list():
    launcher = current_launcher({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert (launcher.master_addr, launcher.master_port) == ("head", 4000)


def test_torchrun_variables_give_the_place_of_this_worker():
    launcher = current_launcher(TORCHRUN)
    assert isinstance(launcher, TorchrunLauncher) and launcher.name == "torchrun"
    assert (launcher.rank, launcher.world_size, launcher.local_rank, launcher.node_id) == (
        3,
        4,
        1,
        1,
    )
    assert (launcher.restart_count, launcher.job_id, launcher.launched) == (2, "run-7", True)
    assert launcher.rendezvous(5.0) == {"init_method": "env://"}
    assert launcher.store_outlives_attempts(object()) is False  # No shared agent store.
    shared = current_launcher({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert shared.store_outlives_attempts(object()) is True  # A group connect did not make.


def test_an_agent_store_that_is_gone_is_a_clear_error_not_a_hang(monkeypatch):
    # What a node that survived a lost rank-0 node gets from torchrun: the old store's address.
    monkeypatch.setattr(launcher_module, "AGENT_STORE_WAIT_SECS", 0.5)
    gone = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    launcher = current_launcher({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True", **gone})
    with pytest.raises(UnavailableError, match=r"refused .* TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        launcher.rendezvous(30.0)


def test_torchrun_under_srun_is_torchrun_and_the_override_wins():
    assert current_launcher({**SLURM, **TORCHRUN}).name == "torchrun"  # srun torchrun ...
    forced = current_launcher({**SLURM, **TORCHRUN, "TORCHSUPERVISOR_LAUNCHER": "slurm"})
    assert forced.name == "slurm" and forced.rank == 5
    assert current_launcher({**SLURM, "TORCHSUPERVISOR_LAUNCHER": "torchrun"}).rank == 0


def test_a_program_run_straight_from_a_batch_script_is_one_process():
    # A batch script sees the job's SLURM_PROCID=0 and SLURM_NTASKS, but no job step.
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    launcher = current_launcher({**batch, "SLURM_PROCID": "0"})
    assert (launcher.name, launcher.rank, launcher.world_size) == ("torchrun", 0, 1)


def test_a_step_of_fewer_tasks_than_the_job_counts_its_own():
    step = {**SLURM, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "cpu[3-4]"}
    launcher = current_launcher(step)
    assert (launcher.world_size, launcher.master_addr) == (2, "cpu3")


def test_a_plain_process_is_rank_0_of_1():
    launcher = current_launcher({})
    assert (launcher.name, launcher.rank, launcher.world_size, launcher.launched) == (
        "torchrun",
        0,
        1,
        False,
    )


@pytest.mark.parametrize(
    "environ, named",
    [
        ({"TORCHSUPERVISOR_LAUNCHER": "mpirun"}, "TORCHSUPERVISOR_LAUNCHER"),
        ({**SLURM, "SLURM_NTASKS": "eight"}, "SLURM_NTASKS"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
        ({**SLURM, "SLURM_JOB_NODELIST": "gpu[07-09"}, "SLURM_JOB_NODELIST"),
    ],
)
def test_bad_variables_are_refused_naming_them(environ, named):
    with pytest.raises(InvalidArgumentError, match=named):
        current_launcher(environ)


def test_a_slurm_job_with_nowhere_to_meet_says_so():
    bare = {k: v for k, v in SLURM.items() if k not in ("SLURM_JOB_NODELIST", "SLURM_JOB_ID")}
    with pytest.raises(InvalidArgumentError, match="MASTER_ADDR"):
        current_launcher(bare).rendezvous(5.0)


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node1", "node1"),
        ("node1,node2", "node1"),
        ("gpu[07-09,12]", "gpu07"),
        ("gpu[3],cpu[1-2]", "gpu3"),
        ("a1,gpu[07-09]", "a1"),
        ("rack2-n[001-100]", "rack2-n001"),
    ],
)
def test_the_first_host_of_a_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_rank_and_world_size_come_from_slurm_without_a_group(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "TORCHSUPERVISOR_LAUNCHER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert (dist_env.rank(), dist_env.world_size()) == (5, 8)


_TASK = textwrap.dedent(
    """
    import json, torch, torch.distributed as dist, torchsupervisor as ts
    from torchsupervisor.distributed.launcher import current_launcher
    sess = ts.Session(master="env://")
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    launcher = current_launcher()
    print(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(),
                      "sum": int(total.item()), "local": launcher.local_rank,
                      "node": launcher.node_id, "restart": launcher.restart_count}))
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_tasks_with_only_slurm_variables_form_a_group():
    port = _free_port()
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    tasks = []
    for rank in range(2):
        environ = {
            **base,
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_RESTART_COUNT": "1",
            "SLURM_JOB_ID": "77",
            "SLURM_JOB_NODELIST": "127.0.0.1",  # Where task 0 runs: the meeting host.
            "MASTER_PORT": str(port),
        }
        tasks.append(
            subprocess.Popen(
                [sys.executable, "-c", _TASK],
                env=environ,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = []
    try:
        for task in tasks:
            out, err = task.communicate(timeout=120)
            assert task.returncode == 0, err
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for task in tasks:
            task.kill()
    assert outputs == [
        {"rank": r, "world": 2, "sum": 3, "local": r, "node": 0, "restart": 1} for r in range(2)
    ]


def test_nothing_but_the_launcher_reads_the_launchers_variables():
    # The seam's promise: rank, world size and the rest come from ``current_launcher()``.
    import ast
    from pathlib import Path

    from tests.repo_paths import ROOT

    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
    found = []
    for path in (Path(ROOT) / "torchsupervisor").rglob("*.py"):
        if path.name == "launcher.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            value = node.value if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and (
                value in names or value.startswith(("SLURM_", "TORCHELASTIC_"))
            ):
                found.append(f"{path.name}:{node.lineno} {value}")
    assert found == []
