"""``ClusterSpec`` and ``Server``: TF's cluster description, mapped onto a process group.

In TF 1 each task of a cluster ran a ``Server`` and sessions connected to ``server.target``.
Here a ``Server`` joins the ``torch.distributed`` process group of the cluster: the tasks of
the ``chief`` job (at most one) and of the ``worker`` job are the replicas, ranked chief first,
then workers by index; the first of them hosts the rendezvous. ``server.target`` is a master
string (``tcp://...``) for ``Session``, ``Supervisor.managed_session`` and friends.

Parameter-server jobs (``ps``) are not emulated: replicas average gradients with all-reduce
(``DistributedDataParallel``, FSDP). A cluster with a ``ps`` job is refused with an error that
says so.

TF names: ``tf.train.ClusterSpec``, ``tf.distribute.Server`` (``tf.train.Server``).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch.distributed as dist

from torchsupervisor.distributed.env import connect, default_backend
from torchsupervisor.errors import UnimplementedError

__all__ = ["ClusterSpec", "Server"]

_REPLICA_JOBS = ("chief", "worker")


def _is_cluster_def(cluster: Mapping[str, Any]) -> bool:
    """Whether ``cluster`` is ``as_cluster_def``'s form (``{"job": [{"name": ...}]}``)."""
    jobs = cluster.get("job")
    return (
        len(cluster) == 1
        and isinstance(jobs, list)
        and all(isinstance(job, Mapping) and "name" in job for job in jobs)
    )


class ClusterSpec:
    """A cluster: job names mapped to task addresses (``"host:port"``).

    Args:
        cluster: ``{job: [address, ...]}`` or ``{job: {task_index: address}}``, the dict
            form of TF's ``ClusterDef`` that ``as_cluster_def`` returns, or another
            ``ClusterSpec``.

    Raises:
        TypeError: For another kind of ``cluster``.

    TF name: ``tf.train.ClusterSpec``.
    """

    def __init__(self, cluster: Mapping[str, Any] | ClusterSpec) -> None:
        if isinstance(cluster, ClusterSpec):
            self._jobs = {job: dict(tasks) for job, tasks in cluster._jobs.items()}
            return
        if not isinstance(cluster, Mapping):
            raise TypeError(
                "cluster must be a dict of job names to task addresses or a ClusterSpec, got "
                f"{type(cluster).__name__}"
            )
        self._jobs: dict[str, dict[int, str]] = {}
        if _is_cluster_def(cluster):
            cluster = {job["name"]: job.get("tasks", {}) for job in cluster["job"]}
        for job, tasks in cluster.items():
            if isinstance(tasks, Mapping):
                self._jobs[str(job)] = {int(i): str(a) for i, a in tasks.items()}
            elif isinstance(tasks, Iterable) and not isinstance(tasks, str):
                self._jobs[str(job)] = {i: str(a) for i, a in enumerate(tasks)}
            else:
                raise TypeError(f"tasks of job {job!r} must be a list or a dict, got {tasks!r}")

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted.

        TF name: ``tf.train.ClusterSpec.jobs``.
        """
        return sorted(self._jobs)

    def num_tasks(self, job_name: str) -> int:
        """Return the number of tasks of ``job_name``.

        Raises:
            ValueError: If there is no such job.

        TF name: ``tf.train.ClusterSpec.num_tasks``.
        """
        return len(self._tasks(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """Return the task indices of ``job_name``, sorted.

        TF name: ``tf.train.ClusterSpec.task_indices``.
        """
        return sorted(self._tasks(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """Return the address of one task.

        Raises:
            ValueError: If the job or the task does not exist.

        TF name: ``tf.train.ClusterSpec.task_address``.
        """
        tasks = self._tasks(job_name)
        if task_index not in tasks:
            raise ValueError(f"No task with index {task_index!r} in job {job_name!r}")
        return tasks[task_index]

    def job_tasks(self, job_name: str) -> list[str | None]:
        """Return the addresses of ``job_name`` by index (None for missing indices).

        TF name: ``tf.train.ClusterSpec.job_tasks``.
        """
        tasks = self._tasks(job_name)
        return [tasks.get(i) for i in range(max(tasks) + 1)] if tasks else []

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """Return the cluster as a dict (lists when the indices are dense).

        TF name: ``tf.train.ClusterSpec.as_dict``.
        """
        out: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            dense = sorted(tasks) == list(range(len(tasks)))
            out[job] = [tasks[i] for i in range(len(tasks))] if dense else dict(tasks)
        return out

    def as_cluster_def(self) -> dict[str, list[dict[str, Any]]]:
        """Return TF's ``ClusterDef`` as plain data, with the proto's field names.

        Returns:
            ``{"job": [{"name": job, "tasks": {task_index: address}}, ...]}``, the jobs
            sorted by name, as TF's ``ClusterDef`` lists them; ``ClusterSpec`` accepts it.

        TF name: ``tf.train.ClusterSpec.as_cluster_def`` (which returns the protocol buffer).
        """
        return {
            "job": [
                {"name": job, "tasks": dict(sorted(self._jobs[job].items()))}
                for job in sorted(self._jobs)
            ]
        }

    def replicas(self) -> list[tuple[str, int, str]]:
        """Return ``(job, task_index, address)`` of the replicas in rank order.

        Raises:
            UnimplementedError: If the cluster has a ``ps`` job or another job than chief and
                worker.
            ValueError: If there are no replicas or more than one chief.

        TF name: none (the rank order of the replicas in the process group).
        """
        others = [job for job in self._jobs if job not in _REPLICA_JOBS]
        if others:
            raise UnimplementedError(
                f"jobs {others} are not supported: parameter servers are not emulated; "
                "replicas ('chief' and 'worker' jobs) average gradients with all-reduce "
                "(DistributedDataParallel, FSDP)"
            )
        if len(self._jobs.get("chief", {})) > 1:
            raise ValueError("A cluster has at most one chief task")
        out = [
            (job, i, self._jobs[job][i])
            for job in _REPLICA_JOBS
            for i in sorted(self._jobs.get(job, {}))
        ]
        if not out:
            raise ValueError("The cluster has no 'chief' or 'worker' task")
        return out

    def _tasks(self, job_name: str) -> dict[int, str]:
        try:
            return self._jobs[job_name]
        except KeyError:
            raise ValueError(f"No such job in cluster: {job_name!r}") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


class Server:
    """One task of a cluster, as a member of the replicas' process group.

    Args:
        server_or_cluster_def: A ``ClusterSpec``, a dict accepted by ``ClusterSpec``, or a
            server definition (``{"cluster": ..., "job_name": ..., "task_index": ...}``).
        job_name: ``"chief"`` or ``"worker"`` (default: the only replica job).
        task_index: The task's index in its job (default 0).
        protocol: Accepted for TF compatibility; the backend is gloo (CPU) or NCCL (CUDA).
        config: Accepted for TF compatibility (ignored).
        start: Join the process group now (it blocks until every replica joined).

    Raises:
        UnimplementedError: For a cluster with parameter servers.
        ValueError: For an unknown job or task.

    TF name: ``tf.distribute.Server`` (``tf.compat.v1.train.Server``).
    """

    def __init__(
        self,
        server_or_cluster_def: Any,
        job_name: str | None = None,
        task_index: int | None = None,
        protocol: str | None = None,
        config: object = None,
        start: bool = True,
    ) -> None:
        del protocol, config
        if isinstance(server_or_cluster_def, Mapping) and "cluster" in server_or_cluster_def:
            definition = server_or_cluster_def
            cluster = ClusterSpec(definition["cluster"])
            job_name = job_name or definition.get("job_name")
            task_index = definition.get("task_index") if task_index is None else task_index
        else:
            cluster = ClusterSpec(server_or_cluster_def)
        replicas = cluster.replicas()
        if job_name is None:
            jobs = {job for job, _, _ in replicas}
            if len(jobs) > 1:
                raise ValueError(f"job_name must be given for a cluster with jobs {sorted(jobs)}")
            job_name = jobs.pop()
        task_index = 0 if task_index is None else int(task_index)
        cluster.task_address(job_name, task_index)  # Raises for an unknown task.
        self._cluster = cluster
        self._job_name = job_name
        self._task_index = task_index
        self._rank = replicas.index(next(r for r in replicas if r[:2] == (job_name, task_index)))
        self._world_size = len(replicas)
        self._rendezvous = replicas[0][2]
        self._stopped = threading.Event()
        if start:
            self.start()

    @staticmethod
    def create_local_server(config: object = None, start: bool = True) -> Server:
        """Return a one-replica server on a free local port.

        TF name: ``tf.distribute.Server.create_local_server``.
        """
        del config
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        return Server({"worker": [f"127.0.0.1:{port}"]}, "worker", 0, start=start)

    @property
    def target(self) -> str:
        """The master string of this task: ``tcp://<rendezvous>?rank=R&world_size=W``.

        TF name: ``tf.distribute.Server.target``.
        """
        return f"tcp://{self._rendezvous}?rank={self._rank}&world_size={self._world_size}"

    @property
    def server_def(self) -> dict[str, Any]:
        """A description: cluster, job name, task index, rank, world size, backend.

        TF name: ``tf.distribute.Server.server_def``.
        """
        return {
            "cluster": self._cluster.as_dict(),
            "job_name": self._job_name,
            "task_index": self._task_index,
            "rank": self._rank,
            "world_size": self._world_size,
            "protocol": default_backend(),
        }

    @property
    def rank(self) -> int:
        """This task's rank in the process group (the chief is 0).

        TF name: none (TF tasks had no rank).
        """
        return self._rank

    def start(self) -> None:
        """Join the process group (blocks until every replica joined); idempotent.

        TF name: ``Server.start``.
        """
        connect(self.target)

    def join(self, timeout_secs: float | None = None) -> bool:
        """Block until ``stop()`` is called (TF: until the server shuts down).

        Returns:
            True if stopped, False if ``timeout_secs`` expired.

        TF name: ``Server.join``.
        """
        return self._stopped.wait(timeout_secs)

    def stop(self) -> None:
        """Leave the process group and release ``join()``.

        TF name: none (a TF server lived until its process ended).
        """
        if dist.is_initialized():
            dist.destroy_process_group()
        self._stopped.set()
