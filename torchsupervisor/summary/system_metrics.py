"""System metrics: what the run uses of the machine, sampled at a low rate into the events file.

Trackers (Weights & Biases, MLflow, Neptune) record a run's CPU, memory, disk and network use
beside its losses; TensorBoard does not. ``SystemMetrics`` samples them with psutil (and NVML,
through the ``nvidia-ml-py`` bindings, where a driver answers) and returns scalars under
``system/``; the Supervisor's ``SVSystemMetricsThread`` (``system_metrics_secs``) and
``SystemMetricsHook`` (a ``MonitoredSession``'s) write them every few seconds at the current
step. Off by default.

The tags, each a scalar at the sample's step:

* ``system/cpu_percent``: the machine's CPU use since the previous sample, 0-100.
* ``system/process_cpu_cores``: cores this process and its children (DataLoader workers) used
  since the previous sample (2.0: two cores busy the whole time).
* ``system/memory_used_bytes``, ``system/memory_percent``: the machine's memory in use.
* ``system/process_rss_bytes``: resident memory of this process and its children.
* ``system/disk_read_bytes_per_sec``, ``system/disk_write_bytes_per_sec``: the machine's
  disks, since the previous sample.
* ``system/network_sent_bytes_per_sec``, ``system/network_recv_bytes_per_sec``: the same for
  its network interfaces.
* ``system/gpu<i>/utilization_percent``, ``.../memory_used_bytes``, ``.../temperature_c``,
  ``.../power_watts``: each GPU NVML sees (what it reports of them).

A rate needs two samples: the first sample has no ``cpu``, disk or network rates.

TF name: none (TF 1 had no system metrics).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from tensorboard.compat.proto.summary_pb2 import Summary

from torchsupervisor.core.coordinator import Coordinator, LooperThread
from torchsupervisor.core.global_step import read_step

if TYPE_CHECKING:
    from torchsupervisor.core.clock import Clock
    from torchsupervisor.core.global_step import GlobalStepLike

__all__ = ["PREFIX", "SVSystemMetricsThread", "SystemMetrics", "metrics_summary"]

logger = logging.getLogger("torchsupervisor")

PREFIX = "system/"
"""The tag prefix of every system metric."""


class SystemMetrics:
    """Samples the machine and this process tree (module docstring).

    Args:
        clock: Time for the rates (``monotonic``).
        gpus: Read GPUs through NVML where it answers; False: never.

    Raises:
        ImportError: psutil is not installed (``pip install psutil``).

    Thread safety: ``sample`` from one thread at a time.

    TF name: none.
    """

    def __init__(self, clock: Clock | None = None, gpus: bool = True) -> None:
        import psutil

        from torchsupervisor.core.clock import REAL_CLOCK

        self._psutil = psutil
        self._clock = clock or REAL_CLOCK
        self._process = psutil.Process(os.getpid())
        self._children: dict[int, Any] = {}
        self._last: tuple[float, float, Any, Any] | None = None
        self._nvml: Any = _nvml() if gpus else None
        psutil.cpu_percent(None)  # The machine's CPU use is then measured from here.

    def _tree_cpu_and_rss(self) -> tuple[float, float]:
        """CPU seconds (user + system) and resident bytes of this process and its children."""
        cpu = self._process.cpu_times()
        seconds = cpu.user + cpu.system + cpu.children_user + cpu.children_system
        rss = float(self._process.memory_info().rss)
        alive: dict[int, Any] = {}
        for child in self._process.children(recursive=True):
            child = self._children.get(child.pid, child)  # The same object keeps its history.
            try:
                times = child.cpu_times()
                seconds += times.user + times.system
                rss += child.memory_info().rss
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                continue
            alive[child.pid] = child
        self._children = alive
        return seconds, rss

    def sample(self) -> dict[str, float]:
        """Return the metrics now, by tag (module docstring).

        Raises:
            OSError: The system could not be read (psutil's errors are ``OSError`` s).
        """
        psutil = self._psutil
        now = self._clock.monotonic()
        values: dict[str, float] = {}
        memory = psutil.virtual_memory()
        values[f"{PREFIX}memory_used_bytes"] = float(memory.total - memory.available)
        values[f"{PREFIX}memory_percent"] = float(memory.percent)
        cpu_seconds, rss = self._tree_cpu_and_rss()
        values[f"{PREFIX}process_rss_bytes"] = rss
        disk = psutil.disk_io_counters()
        net = psutil.net_io_counters()
        machine_cpu = psutil.cpu_percent(None)
        if self._last is not None:
            last_time, last_cpu, last_disk, last_net = self._last
            elapsed = now - last_time
            if elapsed > 0:
                values[f"{PREFIX}cpu_percent"] = float(machine_cpu)
                values[f"{PREFIX}process_cpu_cores"] = max(0.0, cpu_seconds - last_cpu) / elapsed
                if disk is not None and last_disk is not None:
                    values[f"{PREFIX}disk_read_bytes_per_sec"] = (
                        max(0, disk.read_bytes - last_disk.read_bytes) / elapsed
                    )
                    values[f"{PREFIX}disk_write_bytes_per_sec"] = (
                        max(0, disk.write_bytes - last_disk.write_bytes) / elapsed
                    )
                if net is not None and last_net is not None:
                    values[f"{PREFIX}network_sent_bytes_per_sec"] = (
                        max(0, net.bytes_sent - last_net.bytes_sent) / elapsed
                    )
                    values[f"{PREFIX}network_recv_bytes_per_sec"] = (
                        max(0, net.bytes_recv - last_net.bytes_recv) / elapsed
                    )
        self._last = (now, cpu_seconds, disk, net)
        if self._nvml is not None:
            values.update(self._gpus())
        return values

    def _gpus(self) -> dict[str, float]:
        nvml = self._nvml
        values: dict[str, float] = {}
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError:
            return values
        for index in range(count):
            tag = f"{PREFIX}gpu{index}/"
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except nvml.NVMLError:
                continue
            readings = {
                "utilization_percent": lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu,
                "memory_used_bytes": lambda h: nvml.nvmlDeviceGetMemoryInfo(h).used,
                "temperature_c": lambda h: nvml.nvmlDeviceGetTemperature(
                    h, nvml.NVML_TEMPERATURE_GPU
                ),
                "power_watts": lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
            }
            for name, read in readings.items():
                try:  # A device may not report everything (power on some boards).
                    values[tag + name] = float(read(handle))
                except nvml.NVMLError:
                    continue
        return values


def _nvml() -> Any:
    """The NVML bindings, initialized; None where they or a driver are missing."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # pynvml.NVMLError and its library-not-found subclasses.
        return None
    return pynvml


def metrics_summary(values: dict[str, float]) -> Summary:
    """A ``Summary`` proto of ``values`` (one simple value per tag, in tag order)."""
    return Summary(
        value=[Summary.Value(tag=tag, simple_value=value) for tag, value in sorted(values.items())]
    )


class SVSystemMetricsThread(LooperThread):
    """Every ``interval_secs``: sample the system metrics (``summary/system_metrics.py``) and
    write them at the current step.

    A sample that fails is logged once (WARNING) and the next one tried: metrics never stop
    training.

    Args:
        coord: The coordinator the thread belongs to.
        interval_secs: Seconds between two samples.
        global_step: The step the metrics are written at.
        writer: Where they go: anything with ``add_summary(summary, step)``.
        metrics: The sampler; None: a ``SystemMetrics`` (made at the first sample).

    TF name: none (a service beside TF's ``SVStepCounterThread``).
    """

    def __init__(
        self,
        coord: Coordinator,
        interval_secs: float,
        global_step: GlobalStepLike,
        writer: Any,
        metrics: SystemMetrics | None = None,
    ) -> None:
        super().__init__(coord, interval_secs)
        self._global_step = global_step
        self._writer = writer
        self._metrics = metrics
        self._failed = False

    def run_loop(self) -> None:
        try:
            if self._metrics is None:
                self._metrics = SystemMetrics(self._coord.clock)
            values = self._metrics.sample()
        except (OSError, ImportError) as e:
            if not self._failed:
                self._failed = True
                logger.warning("Could not sample the system metrics: %s", e)
            return
        step = None if self._global_step is None else read_step(self._global_step)
        self._writer.add_summary(metrics_summary(values), step)
