"""System metrics: psutil samples of the machine and the process tree (a child's CPU counted),
NVML's GPUs (a fake NVML here), and the Supervisor service and the hook writing them as
``system/*`` scalars that TensorBoard's loader reads."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import time

import pytest
from monitored_helpers import Counter
from supervisor_helpers import accumulator, wait_for_tag

from torchsupervisor import MonitoredTrainingSession, SummaryWriterCache, Supervisor
from torchsupervisor.hooks import SystemMetricsHook
from torchsupervisor.summary import system_metrics
from torchsupervisor.summary.system_metrics import SystemMetrics, metrics_summary

RATES = (
    "system/cpu_percent",
    "system/process_cpu_cores",
    "system/disk_read_bytes_per_sec",
    "system/disk_write_bytes_per_sec",
    "system/network_sent_bytes_per_sec",
    "system/network_recv_bytes_per_sec",
)


def test_a_sample_then_rates_from_the_second(tmp_path):
    metrics = SystemMetrics(gpus=False)
    first = metrics.sample()
    assert first["system/memory_used_bytes"] > 0
    assert 0 < first["system/memory_percent"] <= 100
    assert first["system/process_rss_bytes"] > 10 << 20  # This process imported torch.
    assert not set(RATES) & set(first)  # A rate needs two samples.
    (tmp_path / "f").write_bytes(b"x" * (1 << 20))
    time.sleep(0.05)
    second = metrics.sample()
    assert set(RATES) <= set(second)
    assert all(math.isfinite(v) and v >= 0 for v in second.values())
    assert second["system/cpu_percent"] <= 100


def test_the_cpu_of_a_child_process_counts(tmp_path):
    metrics = SystemMetrics(gpus=False)
    metrics.sample()
    before = time.monotonic()
    # A child (a DataLoader worker, say) that burns 0.5 s of CPU, then is reaped.
    burn = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", burn], check=True, timeout=120)
    values = metrics.sample()
    elapsed = time.monotonic() - before
    assert values["system/process_cpu_cores"] * elapsed >= 0.45


class _FakeNvml:
    """NVML's calls for one GPU whose power reading fails (as on boards without it)."""

    class NVMLError(Exception):
        pass

    NVML_TEMPERATURE_GPU = 0

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("gpu", index)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return type("U", (), {"gpu": 87})()

    def nvmlDeviceGetMemoryInfo(self, handle):
        return type("M", (), {"used": 3 << 30})()

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 64

    def nvmlDeviceGetPowerUsage(self, handle):
        raise self.NVMLError("Not Supported")


def test_gpus_through_nvml(monkeypatch):
    monkeypatch.setattr(system_metrics, "_nvml", _FakeNvml)
    values = SystemMetrics().sample()
    assert values["system/gpu0/utilization_percent"] == 87.0
    assert values["system/gpu0/memory_used_bytes"] == float(3 << 30)
    assert values["system/gpu0/temperature_c"] == 64.0
    assert "system/gpu0/power_watts" not in values  # Not reported: skipped, not an error.


def test_without_nvml_there_are_no_gpu_metrics():
    assert not [tag for tag in SystemMetrics().sample() if "/gpu" in tag]  # No GPU here.


def test_metrics_summary_is_sorted_by_tag():
    summary = metrics_summary({"system/b": 2.0, "system/a": 1.0})
    assert [(v.tag, v.simple_value) for v in summary.value] == [
        ("system/a", 1.0),
        ("system/b", 2.0),
    ]


def test_the_supervisor_writes_them_when_asked(tmp_path):
    counter = Counter()
    sv = Supervisor(
        logdir=str(tmp_path),
        state=counter.state,
        save_model_secs=0,
        save_summaries_secs=0,
        system_metrics_secs=0.05,
    )
    with sv.managed_session() as sess:
        sess.run(counter.step)
        wait_for_tag(sv, "system/process_cpu_cores")
    tags = accumulator(tmp_path).Tags()["scalars"]
    assert {"system/memory_percent", "system/process_rss_bytes", *RATES} <= set(tags)


def test_off_by_default(tmp_path):
    counter = Counter()
    sv = Supervisor(logdir=str(tmp_path), state=counter.state, save_model_secs=0)
    with sv.managed_session() as sess:
        sess.run(counter.step)
    assert not [t for t in accumulator(tmp_path).Tags()["scalars"] if t.startswith("system/")]
    with pytest.raises(ValueError, match="system_metrics_secs"):
        Supervisor(state=counter.state, system_metrics_secs=0)


def test_the_hook_in_a_monitored_training_session(tmp_path):
    counter = Counter()
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path),
        state=counter.state,
        save_checkpoint_secs=None,
        save_summaries_steps=None,
        system_metrics_secs=0.05,
    ) as sess:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            sess.run(counter.step)
            time.sleep(0.01)
            tags = accumulator(tmp_path).Tags()["scalars"]
            if "system/cpu_percent" in tags:
                break
    SummaryWriterCache.clear()  # Closes the writer the hook took from the cache.
    assert "system/cpu_percent" in accumulator(tmp_path).Tags()["scalars"]
    with pytest.raises(ValueError, match="output_dir or a summary_writer"):
        SystemMetricsHook(1.0)


def test_a_failing_sample_is_logged_once_and_training_goes_on(tmp_path, caplog):
    class Broken:
        calls = 0

        def sample(self):
            Broken.calls += 1
            raise OSError("no /proc")

    counter = Counter()
    caplog.set_level(logging.WARNING, logger="torchsupervisor")
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path),
        state=counter.state,
        save_checkpoint_secs=None,
        save_summaries_steps=None,
        hooks=[SystemMetricsHook(0.01, output_dir=str(tmp_path), metrics=Broken())],
    ) as sess:
        deadline = time.monotonic() + 60
        while Broken.calls < 3 and time.monotonic() < deadline:
            sess.run(counter.step)
            time.sleep(0.01)
    SummaryWriterCache.clear()
    assert Broken.calls >= 3
    assert caplog.text.count("Could not sample the system metrics: no /proc") == 1
