"""A real SLURM for one host: munged, slurmctld and slurmd (Debian's ``slurm-wlm``, ``munge``),
everything under one directory (configuration, state, spool, logs, munge's key and socket), on
ports of its own, so that each test session (each xdist worker) runs its own cluster.

Commands reach it through ``$SLURM_CONF`` (``env()``), which the jobs inherit (their ``squeue``
and ``scontrol`` then ask this cluster too). ``KillWait`` is 5 s (a job is SIGKILLed 5 s after
its SIGTERM); a requeued job waits for its ``BeginTime`` (SLURM holds it 2 minutes), which
``release`` moves to now.

Usage::

    with running(directory) as cluster:
        job = cluster.sbatch(script_path, "--requeue", "--time=1")
        cluster.wait_state(job, {"COMPLETED"}, 120)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

from free_ports import free_ports

NEEDED = (
    *("munged", "mungekey", "slurmctld", "slurmd"),
    *("sbatch", "squeue", "scontrol", "scancel", "sinfo"),
)
START_SECS = 60.0  # The longest the daemons may take to come up on a busy machine.
RELEASE_AFTER_SECS = 3.0  # See ``SlurmCluster.release``.


def missing() -> list[str]:
    """The programs this needs that are not installed (``make install`` adds them as root)."""
    return [name for name in NEEDED if _program(name) == name]


def _program(name: str) -> str:
    """The path of ``name`` (daemons are in ``/usr/sbin``, often off a user's ``PATH``)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin") or name


_CONF = """\
ClusterName={cluster}
SlurmctldHost={host}(127.0.0.1)
SlurmUser={user}
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket.2
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=3600
InactiveLimit=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class SlurmCluster:
    def __init__(self, root: str) -> None:
        self.root = root
        self.conf = os.path.join(root, "slurm.conf")
        self.socket = os.path.join(root, "munge", "munge.socket.2")

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a SLURM command (and of the jobs it submits)."""
        return {**os.environ, "SLURM_CONF": self.conf, **extra}

    def run(self, *command: str, check: bool = True, timeout: float = 30.0) -> str:
        done = subprocess.run(
            [_program(command[0]), *command[1:]],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}{self.logs()}")
        return done.stdout

    def sbatch(self, *arguments: str) -> str:
        """Submit; return the job id."""
        return self.run("sbatch", "--parsable", *arguments).strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``Restarts``, ``Reason``, ...)."""
        text = self.run("scontrol", "-o", "show", "job", job_id)
        fields = {}
        for item in text.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def release(self, job_id: str) -> None:
        """Start a requeued job now instead of after SLURM's 2-minute hold.

        Call it ``RELEASE_AFTER_SECS`` after the requeue at the earliest: a job started again
        within the second of its requeue is killed ("Job credential revoked": slurmd revokes
        the job's credentials at the requeue, by the second).
        """
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            with contextlib.suppress(OSError), open(os.path.join(self.root, name)) as f:
                out.append(f"\n--- {name} (end) ---\n" + "".join(f.readlines()[-30:]))
        return "".join(out)

    def start(self) -> None:
        for sub in ("munge", "state", "spool"):
            os.makedirs(os.path.join(self.root, sub), mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o755)  # munged needs its socket's directories searchable.
        os.chmod(os.path.join(self.root, "munge"), 0o755)
        key = os.path.join(self.root, "munge", "munge.key")
        subprocess.run([_program("mungekey"), "--create", f"--keyfile={key}"], check=True)
        munge = os.path.join(self.root, "munge")
        subprocess.run(
            [
                _program("munged"),
                "--force",
                f"--socket={self.socket}",
                f"--key-file={key}",
                f"--log-file={munge}/munged.log",
                f"--pid-file={munge}/munged.pid",
                f"--seed-file={munge}/munged.seed",
            ],
            check=True,
        )
        ctld_port, d_port = free_ports(2)
        import pwd

        with open(self.conf, "w") as f:
            f.write(
                _CONF.format(
                    cluster=f"ts{os.getpid()}",
                    host=socket.gethostname().split(".")[0],
                    user=pwd.getpwuid(os.getuid()).pw_name,
                    ctld_port=ctld_port,
                    d_port=d_port,
                    root=self.root,
                    cpus=os.cpu_count() or 1,
                )
            )
        subprocess.run([_program("slurmctld"), "-i"], env=self.env(), check=True)
        subprocess.run([_program("slurmd")], env=self.env(), check=True)
        deadline = time.monotonic() + START_SECS
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-o", "%T", check=False).strip()
            if state in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the SLURM node did not come up (state {state!r}){self.logs()}")

    def stop(self) -> None:
        """Cancel the jobs left, then end the daemons (SIGTERM, SIGKILL after 5 s)."""
        jobs = self.run("squeue", "-h", "-o", "%i", check=False).split()
        if jobs:
            self.run("scancel", *jobs, check=False)
            _wait_until(lambda: not self.run("squeue", "-h", "-o", "%i", check=False).split(), 15)
        self.run("scontrol", "shutdown", check=False)
        for name, graceful_secs in (
            ("slurmctld.pid", 5),
            ("slurmd.pid", 5),
            ("munge/munged.pid", 0),
        ):
            try:
                with open(os.path.join(self.root, name)) as f:
                    pid = int(f.read().strip())
            except (OSError, ValueError):
                continue
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if _wait_until(lambda pid=pid: not _alive(pid), graceful_secs):
                    break
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                graceful_secs = 5


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_until(predicate, secs: float) -> bool:
    deadline = time.monotonic() + secs
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


@contextlib.contextmanager
def running(root: str) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
