"""Preemptions announced without a signal: a scheduler's end time, a cloud provider's notice.

A preemption signal (``preemption.py``) says "stop now". Other stops are announced otherwise,
and a run that only listens for signals loses what it did since its last checkpoint:

* **SLURM's time limit** (``SlurmTimeLimit``). A job that reaches its end time gets SIGTERM
  and, ``KillWait`` seconds later (30 by default), SIGKILL; a job submitted without
  ``--signal`` is warned no earlier. Its end time is known all along (``squeue -o %e``, polled:
  ``scontrol update TimeLimit=`` may move it), so the run stops ``preemption_grace_secs``
  before it, with that long for its final checkpoint.
* **A cloud provider's notice**, polled from the instance's metadata service: AWS spot's
  ``spot/instance-action`` (two minutes ahead, with the time), GCE's ``instance/preempted``
  (30 seconds ahead), Azure's Scheduled Events (``Preempt``, ``Terminate``, ``Reboot`` or
  ``Redeploy`` of this VM, from its ``NotBefore``; 30 seconds for a spot eviction). The run
  stops at once, with the time left until then for its final checkpoint.

A source only asks; ``PreemptionWatcher`` polls the sources on a thread of its own (never in a
signal handler) and hands the first notice that is due to the ``Preemption`` controller, which
stops the run as a signal does (with replicas, at the step every rank agrees on).

``detect_sources`` picks the sources that apply to this machine without touching the network:
SLURM's time limit in a SLURM job with ``squeue`` on the ``PATH``; a cloud's notice where the
machine's DMI tables name the cloud (``/sys/class/dmi/id``: "Amazon EC2", "Google Compute
Engine", or the asset tag of an Azure VM), or where the environment names its metadata service
(the variables the clouds' own SDKs read, also how tests point a run at a fake one):
``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (``http://host:port``; ``AWS_EC2_METADATA_DISABLED=true``
turns AWS off), ``GCE_METADATA_HOST`` (``host[:port]``), and ours for Azure,
``TORCHSUPERVISOR_AZURE_METADATA_ENDPOINT`` (``http://host:port``). The endpoints default to
these variables too.
"""

from __future__ import annotations

import datetime
import email.utils
import json
import logging
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from torchsupervisor.core.clock import REAL_CLOCK, Clock

__all__ = [
    "AwsSpotNotice",
    "AzureScheduledEvents",
    "GcePreemptedNotice",
    "PreemptionNotice",
    "PreemptionSource",
    "PreemptionWatcher",
    "SlurmTimeLimit",
    "check_sources",
    "detect_sources",
]

logger = logging.getLogger("torchsupervisor")

HTTP_TIMEOUT_SECS = 2.0
"""How long one request to a metadata service may take before it counts as failed."""

_MAX_BODY_BYTES = 1 << 20  # A metadata answer is a few hundred bytes; never read more.
_SQUEUE_TIMEOUT_SECS = 10.0
_DMI_DIR = "/sys/class/dmi/id"
_AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"  # Every Azure VM's chassis asset tag.
_AZURE_STOPS = ("Preempt", "Terminate", "Reboot", "Redeploy")  # Events the process dies of.
AWS_ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
GCE_HOST_ENV = "GCE_METADATA_HOST"
AZURE_ENDPOINT_ENV = "TORCHSUPERVISOR_AZURE_METADATA_ENDPOINT"


def _aws_endpoint(environ: Mapping[str, str]) -> str:
    return environ.get(AWS_ENDPOINT_ENV) or "http://169.254.169.254"


def _gce_endpoint(environ: Mapping[str, str]) -> str:
    host = environ.get(GCE_HOST_ENV) or "metadata.google.internal"
    return host if "://" in host else f"http://{host}"


def _azure_endpoint(environ: Mapping[str, str]) -> str:
    return environ.get(AZURE_ENDPOINT_ENV) or "http://169.254.169.254"


@dataclass(frozen=True)
class PreemptionNotice:
    """An announced stop.

    Attributes:
        source: Who announced it (``"SLURM time limit"``, ``"AWS spot"``, ``"GCE"``,
            ``"Azure"``, or a custom source's name).
        deadline: When the machine goes away, as ``time.time()`` (seconds since the epoch);
            None: not said (the final checkpoint then gets ``preemption_grace_secs``).
        detail: What the source said, for the log line (``"instance-action terminate"``).
        scheduled: The deadline is an end known long in advance (a time limit): the run
            stops ``preemption_grace_secs`` before it. False (a notice): at once.
    """

    source: str
    deadline: float | None
    detail: str = ""
    scheduled: bool = False


class PreemptionSource(Protocol):
    """Something that may announce a stop; ``PreemptionWatcher`` polls it on its thread.

    Attributes:
        name: For log lines (``"AWS spot"``).
        poll_every_secs: Seconds between two polls.
    """

    name: str
    poll_every_secs: float

    def poll(self) -> PreemptionNotice | None:
        """Return what the source announces now; None: nothing.

        Raises:
            OSError, ValueError: It could not be asked, or its answer is not understood (the
                watcher logs it once and asks again at the next poll).
        """
        ...


def _request(
    url: str, headers: Mapping[str, str], method: str = "GET", body: bytes | None = None
) -> tuple[int, bytes]:
    """HTTP status and body of a request to a metadata service (never through a proxy)."""
    request = urllib.request.Request(url, data=body, headers=dict(headers), method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=HTTP_TIMEOUT_SECS) as answer:
            return answer.status, answer.read(_MAX_BODY_BYTES)
    except urllib.error.HTTPError as error:
        with error:
            return error.code, b""


def _unexpected(url: str, status: int) -> OSError:
    return OSError(f"{url} answered HTTP {status}")


def _parse_time(text: str, what: str) -> float:
    """Seconds since the epoch of an ISO 8601 time (``Z`` or an offset; none: local time)."""
    try:
        when = datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a time") from None
    return when.timestamp()


class SlurmTimeLimit:
    """The end time of a SLURM job (its time limit), from ``squeue -h -j JOB -o %e``.

    Args:
        job_id: The job (``launcher.slurm_job_id()``).
        poll_every_secs: Seconds between two ``squeue`` calls (an ``scontrol update`` of the
            time limit is seen within this long).
        squeue: The ``squeue`` command.

    TF name: none.
    """

    name = "SLURM time limit"

    def __init__(self, job_id: str, poll_every_secs: float = 60.0, squeue: str = "squeue") -> None:
        self.job_id = str(job_id)
        self.poll_every_secs = poll_every_secs
        self.squeue = squeue

    def poll(self) -> PreemptionNotice | None:
        """The job's end time (a scheduled notice), or None while it has none (no time limit).

        Raises:
            OSError: ``squeue`` is missing, failed (its message), or took over 10 s.
            ValueError: Its answer is not a time.
        """
        command = [self.squeue, "-h", "-j", self.job_id, "-o", "%e"]
        from torchsupervisor.distributed.launcher import SLURM_TIME_FORMAT_ENV

        env = {**os.environ, SLURM_TIME_FORMAT_ENV: "%s"}  # Seconds since the epoch.
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=_SQUEUE_TIMEOUT_SECS, env=env
            )
        except subprocess.TimeoutExpired:
            shown = " ".join(command)
            raise OSError(f"{shown} did not answer in {_SQUEUE_TIMEOUT_SECS} s") from None
        if done.returncode != 0:
            shown = " ".join(command)
            raise OSError(f"{shown} failed ({done.returncode}): {done.stderr.strip()}")
        text = done.stdout.strip()
        if not text or not text[0].isdigit():  # "N/A", "Unknown", "UNLIMITED", no such job.
            return None
        end = float(text) if text.isdigit() else _parse_time(text, "squeue's end time")
        stamp = datetime.datetime.fromtimestamp(end).isoformat(timespec="seconds")
        return PreemptionNotice(self.name, end, f"job {self.job_id} ends at {stamp}", True)


class AwsSpotNotice:
    """An AWS spot instance's interruption notice (``/latest/meta-data/spot/instance-action``,
    IMDSv2 with a session token, IMDSv1 where tokens are refused).

    Args:
        endpoint: The instance metadata service; None: ``$AWS_EC2_METADATA_SERVICE_ENDPOINT``,
            else ``http://169.254.169.254``.
        poll_every_secs: Seconds between two polls (AWS suggests 5).

    TF name: none.
    """

    name = "AWS spot"
    _TOKEN_TTL_SECS = 21600

    def __init__(self, endpoint: str | None = None, poll_every_secs: float = 5.0) -> None:
        self.endpoint = (endpoint or _aws_endpoint(os.environ)).rstrip("/")
        self.poll_every_secs = poll_every_secs
        self._token: str | None = None
        self._token_until = 0.0

    def _headers(self) -> dict[str, str]:
        now = time.monotonic()
        if self._token is None or now >= self._token_until:
            status, body = _request(
                f"{self.endpoint}/latest/api/token",
                {"X-aws-ec2-metadata-token-ttl-seconds": str(self._TOKEN_TTL_SECS)},
                method="PUT",
            )
            if status == 200:
                self._token = body.decode("ascii", "replace").strip()
                self._token_until = now + self._TOKEN_TTL_SECS / 2
            else:  # IMDSv1 only: ask without a token (and ask for one again later).
                self._token, self._token_until = "", now + 300
        return {"X-aws-ec2-metadata-token": self._token} if self._token else {}

    def poll(self) -> PreemptionNotice | None:
        """The interruption notice, or None (HTTP 404: no interruption scheduled).

        Raises:
            OSError: The service is unreachable or answered another HTTP status.
            ValueError: The answer is not an instance action with a time.
        """
        url = f"{self.endpoint}/latest/meta-data/spot/instance-action"
        status, body = _request(url, self._headers())
        if status == 401:  # The token expired early: a new one at the next poll.
            self._token = None
            return None
        if status == 404:
            return None
        if status != 200:
            raise _unexpected(url, status)
        answer = json.loads(body)
        if not isinstance(answer, dict) or not isinstance(answer.get("time"), str):
            raise ValueError(f"{url}: not an instance action: {body[:200]!r}")
        deadline = _parse_time(answer["time"], url)
        return PreemptionNotice(self.name, deadline, f"instance-action {answer.get('action')}")


class GcePreemptedNotice:
    """A GCE preemptible or spot VM's preemption notice (``instance/preempted`` turns
    ``TRUE`` 30 seconds before the VM stops).

    Args:
        endpoint: The metadata server; None: ``http://$GCE_METADATA_HOST``, else
            ``http://metadata.google.internal``.
        poll_every_secs: Seconds between two polls (the deadline counts one poll interval
            early: the notice may have come just after the poll before).

    TF name: none.
    """

    name = "GCE"
    NOTICE_SECS = 30.0
    """How long before the stop GCE's notice comes."""

    def __init__(self, endpoint: str | None = None, poll_every_secs: float = 1.0) -> None:
        self.endpoint = (endpoint or _gce_endpoint(os.environ)).rstrip("/")
        self.poll_every_secs = poll_every_secs
        self._seen: float | None = None

    def poll(self) -> PreemptionNotice | None:
        """The preemption notice, or None (``FALSE``).

        Raises:
            OSError: The server is unreachable or answered another HTTP status than 200.
        """
        url = f"{self.endpoint}/computeMetadata/v1/instance/preempted"
        status, body = _request(url, {"Metadata-Flavor": "Google"})
        if status != 200:
            raise _unexpected(url, status)
        if body.strip().upper() != b"TRUE":
            return None
        if self._seen is None:
            self._seen = time.time()
        deadline = self._seen - self.poll_every_secs + self.NOTICE_SECS
        return PreemptionNotice(self.name, deadline, "instance/preempted TRUE")


class AzureScheduledEvents:
    """An Azure VM's Scheduled Events (``/metadata/scheduledevents``): a ``Preempt``,
    ``Terminate``, ``Reboot`` or ``Redeploy`` of this VM, the earliest ``NotBefore`` first.

    Args:
        endpoint: The instance metadata service; None:
            ``$TORCHSUPERVISOR_AZURE_METADATA_ENDPOINT``, else ``http://169.254.169.254``.
        poll_every_secs: Seconds between two polls.
        vm_name: This VM's name as events list it in ``Resources``; None: asked of the
            service once (``compute/name``); where it cannot tell, every event counts.

    TF name: none.
    """

    name = "Azure"
    _API = "api-version=2020-07-01"

    def __init__(
        self,
        endpoint: str | None = None,
        poll_every_secs: float = 1.0,
        vm_name: str | None = None,
    ) -> None:
        self.endpoint = (endpoint or _azure_endpoint(os.environ)).rstrip("/")
        self.poll_every_secs = poll_every_secs
        self.vm_name = vm_name

    def _vm(self) -> str | None:
        if self.vm_name is None:
            url = f"{self.endpoint}/metadata/instance/compute/name?api-version=2021-02-01"
            status, body = _request(f"{url}&format=text", {"Metadata": "true"})
            if status == 200 and body.strip():
                self.vm_name = body.decode("utf-8", "replace").strip()
        return self.vm_name

    def poll(self) -> PreemptionNotice | None:
        """The earliest event this VM dies of, or None.

        Raises:
            OSError: The service is unreachable or answered another HTTP status than 200.
            ValueError: The answer has no ``Events`` list, or a ``NotBefore`` is not a time.
        """
        url = f"{self.endpoint}/metadata/scheduledevents?{self._API}"
        status, body = _request(url, {"Metadata": "true"})
        if status != 200:
            raise _unexpected(url, status)
        answer = json.loads(body)
        events = answer.get("Events") if isinstance(answer, dict) else None
        if not isinstance(events, list):
            raise ValueError(f"{url}: no Events list: {body[:200]!r}")
        vm = self._vm()
        found: PreemptionNotice | None = None
        for event in events:
            if not isinstance(event, dict) or event.get("EventType") not in _AZURE_STOPS:
                continue
            resources = event.get("Resources") or []
            if vm is not None and resources and vm not in resources:
                continue
            not_before = event.get("NotBefore") or ""
            try:  # RFC 1123 ("Mon, 19 Sep 2016 18:29:47 GMT"); empty once it has started.
                deadline = (
                    email.utils.parsedate_to_datetime(not_before).timestamp()
                    if not_before
                    else time.time()
                )
            except (TypeError, ValueError):
                raise ValueError(f"{url}: NotBefore {not_before!r} is not a time") from None
            if found is None or deadline < (found.deadline or 0.0):
                detail = f"{event['EventType']} {event.get('EventId', '')}".strip()
                found = PreemptionNotice(self.name, deadline, detail)
        return found


def _dmi(dmi_dir: str, name: str) -> str:
    try:
        with open(os.path.join(dmi_dir, name), encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def detect_sources(
    environ: Mapping[str, str] | None = None, dmi_dir: str = _DMI_DIR
) -> list[PreemptionSource]:
    """The sources that apply to this machine (module docstring), found without the network.

    Args:
        environ: The environment (``os.environ``).
        dmi_dir: Where the DMI tables are (Linux's ``/sys/class/dmi/id``).

    TF name: none.
    """
    from torchsupervisor.distributed.launcher import slurm_job_id

    env = os.environ if environ is None else environ
    sources: list[PreemptionSource] = []
    job = slurm_job_id(env)
    if job and shutil.which("squeue"):
        sources.append(SlurmTimeLimit(job))
    vendor = f"{_dmi(dmi_dir, 'sys_vendor')} {_dmi(dmi_dir, 'board_vendor')}"
    aws_off = env.get("AWS_EC2_METADATA_DISABLED", "").strip().lower() == "true"
    if not aws_off and (AWS_ENDPOINT_ENV in env or "Amazon EC2" in vendor):
        sources.append(AwsSpotNotice(_aws_endpoint(env)))
    if GCE_HOST_ENV in env or "Google" in _dmi(dmi_dir, "product_name"):
        sources.append(GcePreemptedNotice(_gce_endpoint(env)))
    if AZURE_ENDPOINT_ENV in env or _dmi(dmi_dir, "chassis_asset_tag") == _AZURE_ASSET_TAG:
        sources.append(AzureScheduledEvents(_azure_endpoint(env)))
    return sources


def check_sources(name: str, value: object) -> tuple[PreemptionSource, ...]:
    """``value`` (``"auto"``, None, or sources) as a tuple of sources.

    Raises:
        TypeError: Neither ``"auto"``, None nor an iterable of objects with ``poll``,
            ``name`` and ``poll_every_secs``.
        ValueError: A ``poll_every_secs`` that is not positive.
    """
    if value == "auto":
        return tuple(detect_sources())
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be 'auto', None or a list of sources, got {value!r}")
    sources = tuple(value)
    for source in sources:
        if not callable(getattr(source, "poll", None)) or not isinstance(
            getattr(source, "name", None), str
        ):
            raise TypeError(f"{name}: {source!r} is not a preemption source (no poll or name)")
        every = getattr(source, "poll_every_secs", None)
        if isinstance(every, bool) or not isinstance(every, (int, float)) or not every > 0:
            raise ValueError(f"{name}: {source.name}'s poll_every_secs must be > 0, got {every!r}")
    return sources


class PreemptionWatcher:
    """Polls the sources on a thread of its own; calls ``on_notice`` once, with the first
    notice due (a scheduled one ``lead_secs`` before its deadline, any other at once).

    A source whose poll fails is logged once (WARNING) and polled again at its interval.

    Args:
        sources: What to poll.
        lead_secs: How long before a scheduled deadline the notice is due, in seconds.
        on_notice: Called on the watcher's thread with the notice; it must only record it.
        clock: Time for the waits.

    Thread safety: ``start`` and ``stop`` from one thread.
    """

    def __init__(
        self,
        sources: Sequence[PreemptionSource],
        lead_secs: float,
        on_notice: Callable[[PreemptionNotice], None],
        clock: Clock | None = None,
    ) -> None:
        self._sources = tuple(sources)
        self._lead_secs = lead_secs
        self._on_notice = on_notice
        self._clock = clock or REAL_CLOCK
        self._stop = threading.Event()
        self._failed: set[int] = set()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start polling (once)."""
        if self._thread is None and self._sources:
            self._thread = threading.Thread(
                target=self._run, name="torchsupervisor-preemption-watcher", daemon=True
            )
            self._thread.start()

    def stop(self, timeout_secs: float = 2 * HTTP_TIMEOUT_SECS + _SQUEUE_TIMEOUT_SECS) -> None:
        """Stop polling; wait up to ``timeout_secs`` for a poll in progress to end."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_secs)

    def _poll(self, index: int) -> PreemptionNotice | None:
        source = self._sources[index]
        try:
            notice = source.poll()
        except (OSError, ValueError) as error:
            level = logging.DEBUG if index in self._failed else logging.WARNING
            self._failed.add(index)
            logger.log(level, "Cannot poll %s for a preemption notice: %s", source.name, error)
            return None
        if index in self._failed:
            self._failed.discard(index)
            logger.info("Polling %s for a preemption notice works again", source.name)
        return notice

    def _due_in(self, notice: PreemptionNotice) -> float:
        """Seconds until ``notice`` is due (<= 0: now)."""
        if not notice.scheduled or notice.deadline is None:
            return 0.0
        return notice.deadline - self._lead_secs - self._clock.time()

    def _run(self) -> None:
        next_poll = [0.0] * len(self._sources)  # self._clock.monotonic() of each next poll.
        held: dict[int, PreemptionNotice] = {}
        while not self._stop.is_set():
            for index, source in enumerate(self._sources):
                if self._clock.monotonic() >= next_poll[index]:
                    notice = self._poll(index)
                    if notice is None:
                        held.pop(index, None)
                    else:
                        held[index] = notice
                    next_poll[index] = self._clock.monotonic() + source.poll_every_secs
            due = [n for n in held.values() if self._due_in(n) <= 0]
            if due:
                self._on_notice(min(due, key=lambda n: n.deadline or float("inf")))
                return
            now = self._clock.monotonic()
            wake = min([t - now for t in next_poll] + [self._due_in(n) for n in held.values()])
            self._clock.wait(self._stop, max(wake, 0.0))
