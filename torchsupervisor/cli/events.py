"""``torchsupervisor events LOGDIR``: the summaries of a log directory, as TensorBoard shows them.

Every directory under LOGDIR holding events files is a run (LOGDIR itself is the run ``.``),
read with TensorBoard's own ``EventAccumulator``: points that a restart made stale (written
after the checkpoint the run resumed from) are purged at its ``START`` event exactly as in
TensorBoard. For each run: its events files, its sessions (``START``/``STOP`` events: one per
start or restart, with the step it started at) and checkpoints, then one line per tag: kind,
number of points, first and last step, last value (scalars) and when it was written.

``--csv`` prints every scalar point instead (``run,tag,step,wall_time,value``);
``--plot FILE.png`` draws the scalar series, one panel per tag (needs matplotlib:
``pip install 'torchsupervisor[plot]'``). ``--tag PATTERN`` (repeatable, shell-style
wildcards) keeps the matching tags only.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fnmatch
import io
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError
from tensorboard.compat.proto.event_pb2 import Event, SessionLog

from torchsupervisor.cli._format import local_time, print_table, short_value
from torchsupervisor.errors import DataLossError, NotFoundError
from torchsupervisor.storage import BY_PATH, NotRegularFileError
from torchsupervisor.storage import paths as url_paths
from torchsupervisor.summary.records import HEADER_BYTES, iter_records_with_offsets
from torchsupervisor.summary.restarts import STEPS_LOST_TAG

_COPY_BYTES = 8 << 20
_FOOTER_BYTES = 4  # A record's payload checksum, after the payload.

__all__ = ["HELP", "add_arguments", "read_runs", "run"]

HELP = "list the summaries of a logdir (tags, last values, steps); --csv, --plot out.png"

EPILOG = """examples:
  torchsupervisor events runs/exp
  torchsupervisor events runs/exp --csv > scalars.csv
  torchsupervisor events runs/exp --tag 'train/*' --plot curves.png
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``events`` to ``parser``."""
    parser.add_argument("logdir", metavar="LOGDIR", help="the log directory (may hold runs)")
    parser.add_argument(
        "--csv", action="store_true", help="print every scalar point as CSV on stdout"
    )
    parser.add_argument(
        "--plot", metavar="FILE", help="draw the scalar series into this PNG (needs matplotlib)"
    )
    parser.add_argument(
        "--tag",
        metavar="PATTERN",
        action="append",
        help="only tags matching this shell-style pattern (repeatable)",
    )


@dataclass
class Series:
    """One tag of one run, after TensorBoard's purge of stale points."""

    tag: str
    kind: str
    steps: list[int] = field(default_factory=list)
    wall_times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)  # scalars only
    last: str = "-"  # the last value, for the listing


@dataclass
class Run:
    """The summaries of one run directory."""

    name: str
    path: str
    files: list[str]
    series: list[Series]
    sessions: list[tuple[int, int, float]]  # (status, step, wall time) of START/STOP events
    checkpoints: list[int]  # steps of the CHECKPOINT events
    damaged: list[str]  # "<file>: <what is wrong, and where>" of each damaged file
    restarts: list[tuple[int, float]] = field(default_factory=list)  # (step, steps lost)
    stops: list[str] = field(default_factory=list)  # STOP messages: how each session ended


def _check_regular(path: str) -> None:
    """Raise ``DataLossError`` if the events file ``path`` is not a regular file."""
    try:
        BY_PATH.open_read(path).close()
    except NotRegularFileError as e:
        kind = e.kind
    except FileNotFoundError:
        kind = "dangling"
    except OSError:
        return  # Unreadable: reported as damaged when it is read.
    else:
        return
    raise DataLossError(f"Events file {path} is not a regular file ({kind})")


def _run_dirs(logdir: str) -> list[str]:
    """The directories below ``logdir`` (itself included) that hold events files, sorted."""
    found = {os.path.dirname(p) for p in BY_PATH.list_tree(logdir) if "tfevents" in p}
    return [os.path.join(logdir, d) if d else logdir for d in sorted(found)]


@dataclass
class _Scan:
    """What one pass of our own bounded reader found in a run's events files."""

    sessions: list[tuple[int, int, float]] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    restarts: list[tuple[int, float]] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)  # "<file>: <what>" of each damaged file
    valid_bytes: dict[str, int] = field(default_factory=dict)  # damaged file -> its intact prefix


def _scan(paths: list[str]) -> _Scan:
    """Read every record once, bounded (``records.MAX_RECORD_BYTES``, the rest of the file):
    the START/STOP events, the CHECKPOINT steps, the restarts recorded (their
    ``torchsupervisor/steps_lost`` points), and where each file is damaged.

    A record is damage if its framing is (a truncated or corrupt record, a length beyond the
    file or the cap), if it is not an ``Event``, or if it holds a part TensorBoard's loader
    parses and cannot (a ``meta_graph_def``). TensorBoard is then given the file's intact
    prefix only, as its loader stops at a damaged record itself: it never sees a record that
    would make it crash or allocate what a crafted length claims.
    """
    found = _Scan()
    for path in paths:
        intact = 0  # The end of the last sound record.
        try:
            readable = BY_PATH.open_read(path)
            with io.BufferedReader(readable.stream()) as f:
                for offset, payload in iter_records_with_offsets(f, path, readable.size):
                    _note(found, _event(payload, path, offset))
                    intact = offset + HEADER_BYTES + len(payload) + _FOOTER_BYTES
            continue
        except DataLossError as e:
            found.damaged.append(e.message)  # It names the file and the offset.
        except OSError as e:
            found.damaged.append(f"{path} cannot be read: {e}")
        found.valid_bytes[path] = intact
    return found


def _event(payload: bytes, path: str, offset: int) -> Any:
    """Parse a record as an ``Event``, and the parts TensorBoard's loader parses at once."""
    from tensorboard.compat.proto import meta_graph_pb2

    try:
        event = Event.FromString(payload)
        if event.HasField("meta_graph_def"):
            meta_graph_pb2.MetaGraphDef.FromString(event.meta_graph_def)
    except DecodeError as e:
        raise DataLossError(
            f"record at byte offset {offset} in {path} is not a valid Event: {e}"
        ) from None
    return event


def _note(found: _Scan, event: object) -> None:
    if event.HasField("summary"):
        found.restarts.extend(
            (event.step, v.simple_value) for v in event.summary.value if v.tag == STEPS_LOST_TAG
        )
    if not event.HasField("session_log"):
        return
    status = event.session_log.status
    if status in (SessionLog.START, SessionLog.STOP):
        found.sessions.append((status, event.step, event.wall_time))
    if status == SessionLog.STOP:
        found.stops.append(event.session_log.msg)
    elif status == SessionLog.CHECKPOINT:
        found.checkpoints.append(event.step)


def _keep(tag: str, patterns: list[str] | None) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(tag, p) for p in patterns)


def _scalar_tensor(event: object) -> float | None:
    from tensorboard.util import tensor_util

    try:
        array = tensor_util.make_ndarray(event.tensor_proto)
    except Exception:
        return None
    if array.size != 1 or array.dtype.kind not in "biuf":
        return None
    return float(array.reshape(()))


class _RestartWarnings(logging.Filter):
    """Drops TensorBoard's "Detected out of order event.step" warning: a restart, which the
    listing reports itself (``restarts:``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Detected out of order event.step" not in record.getMessage()


@contextlib.contextmanager
def _readable_by_tensorboard(path: str, files: list[str], scan: _Scan) -> Iterator[str]:
    """A directory TensorBoard's loader may read: ``path`` itself if local and intact; else a
    temporary directory holding a copy of each events file (read through our storage, so any
    store we reach, with its ``configure`` options: TensorBoard's own file layer knows only
    some schemes and the standard environment), of a damaged file its intact prefix only."""
    if not url_paths.is_url(path) and not scan.valid_bytes:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="torchsupervisor-events-") as local:
        for source in files:
            size = scan.valid_bytes.get(source)
            with BY_PATH.open_read(source) as f:
                end = f.size if size is None else size
                with open(os.path.join(local, os.path.basename(source)), "wb") as out:
                    offset = 0
                    while offset < end:
                        view = memoryview(bytearray(min(_COPY_BYTES, end - offset)))
                        n = f.readinto(view, offset)
                        if n <= 0:
                            break
                        out.write(view[:n])
                        offset += n
        yield local


def read_run(path: str, name: str, patterns: list[str] | None = None) -> Run:
    """Read one run directory with TensorBoard's ``EventAccumulator``.

    Damaged files are reported (``Run.damaged``: the file and what is wrong, with the byte
    offset) and read up to their damage, as TensorBoard reads them. Should TensorBoard's
    loader still fail, the run is reported with that error and no series.
    """
    files = sorted(os.path.join(path, n) for n in BY_PATH.list(path) if "tfevents" in n)
    scan = _scan(files)
    with _readable_by_tensorboard(path, files, scan) as local:
        try:
            series = _read_series(local, patterns)
        except Exception as e:  # A record we found sound that TensorBoard cannot take.
            scan.damaged.append(f"TensorBoard's loader failed: {type(e).__name__}: {e}")
            series = []
    return Run(
        name,
        path,
        files,
        series,
        scan.sessions,
        scan.checkpoints,
        scan.damaged,
        scan.restarts,
        scan.stops,
    )


def _read_series(local: str, patterns: list[str] | None) -> list[Series]:
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(
        local,
        size_guidance={
            ea.SCALARS: 0,
            ea.HISTOGRAMS: 0,
            ea.COMPRESSED_HISTOGRAMS: 1,
            ea.IMAGES: 0,
            ea.AUDIO: 0,
            ea.TENSORS: 0,
        },
    )
    quiet = _RestartWarnings()
    tensorboard_logger = logging.getLogger("tensorboard")
    tensorboard_logger.addFilter(quiet)
    try:
        acc.Reload()
    finally:
        tensorboard_logger.removeFilter(quiet)
    tags = acc.Tags()
    series: list[Series] = []
    for tag in tags.get(ea.SCALARS, []):
        if _keep(tag, patterns):
            points = acc.Scalars(tag)
            s = Series(tag, "scalar")
            s.steps = [p.step for p in points]
            s.wall_times = [p.wall_time for p in points]
            s.values = [p.value for p in points]
            series.append(s)
    for tag in tags.get(ea.TENSORS, []):
        if not _keep(tag, patterns):
            continue
        points = acc.Tensors(tag)
        plugin = acc.SummaryMetadata(tag).plugin_data.plugin_name or "tensor"
        values = [_scalar_tensor(p) for p in points]
        if plugin == "scalars" and all(v is not None for v in values):
            s = Series(tag, "scalar", values=[float(v) for v in values])
        else:
            s = Series(tag, plugin)
        s.steps = [p.step for p in points]
        s.wall_times = [p.wall_time for p in points]
        series.append(s)
    for key, kind, read in (
        (ea.HISTOGRAMS, "histogram", acc.Histograms),
        (ea.IMAGES, "image", acc.Images),
        (ea.AUDIO, "audio", acc.Audio),
    ):
        for tag in tags.get(key, []):
            if not _keep(tag, patterns):
                continue
            points = read(tag)
            s = Series(tag, kind, [p.step for p in points], [p.wall_time for p in points])
            if points and kind == "histogram":
                h = points[-1].histogram_value
                mean = h.sum / h.num if h.num else 0.0
                s.last = f"n={h.num:g} mean={mean:.4g}"
            elif points and kind == "image":
                s.last = f"{points[-1].width}x{points[-1].height}"
            series.append(s)
    for s in series:
        if s.kind == "scalar" and s.values:
            s.last = short_value(s.values[-1])
    series.sort(key=lambda s: s.tag)
    return series


def read_runs(logdir: str, patterns: list[str] | None = None) -> list[Run]:
    """Read every run under ``logdir``.

    Raises:
        NotFoundError: ``logdir`` is not a directory or holds no events file.
        DataLossError: An events file is not a regular file (a FIFO, a device, a directory).
    """
    if not BY_PATH.is_dir(logdir):
        if BY_PATH.exists(logdir):
            raise NotFoundError(f"{logdir} is not a directory")
        raise NotFoundError(f"no such file or directory: {logdir}")
    dirs = _run_dirs(logdir)
    if not dirs:
        raise NotFoundError(f"No events files in {logdir}")
    for directory in dirs:  # TensorBoard's loader would block on a FIFO, or read /dev/zero.
        for name in sorted(BY_PATH.list(directory)):
            path = os.path.join(directory, name)
            if "tfevents" in name:
                _check_regular(path)
    return [read_run(d, url_paths.relpath(d, logdir), patterns) for d in dirs]


def print_runs(runs: list[Run]) -> None:
    """Print the listing of ``torchsupervisor events``."""
    for i, run_ in enumerate(runs):
        if i:
            print()
        starts = [step for status, step, _ in run_.sessions if status == SessionLog.START]
        print(f"Run {run_.name} ({run_.path}): {len(run_.files)} events file(s)")
        if starts:
            print(f"  sessions: {len(starts)} start(s); {_endings(len(starts), run_.stops)}")
        for step, lost in run_.restarts:
            lost_text = "no logged step lost" if not lost else f"{lost:g} logged steps lost"
            print(f"  restart: resumed at step {step} ({lost_text})")
        if run_.checkpoints:
            print(
                f"  checkpoints: {len(run_.checkpoints)}, the last at step {run_.checkpoints[-1]}"
            )
        for what in run_.damaged:
            print(f"  {what}; read up to there")
        rows = [
            [
                s.tag,
                s.kind,
                str(len(s.steps)),
                str(s.steps[0]) if s.steps else "-",
                str(s.steps[-1]) if s.steps else "-",
                s.last,
                local_time(s.wall_times[-1]) if s.wall_times else "-",
            ]
            for s in run_.series
        ]
        if rows:
            print_table(
                ["TAG", "KIND", "POINTS", "FIRST STEP", "LAST STEP", "LAST VALUE", "WRITTEN"],
                rows,
                (2, 3, 4),
            )
        else:
            print("  (no summaries)")


def _endings(starts: int, stops: list[str]) -> str:
    """How the sessions ended, from their STOP events' messages (``supervisor/lifecycle.py``:
    ``end``, ``preemption: SIGTERM``, ``error: ...``; none before they existed)."""
    ended = sum(1 for m in stops if m in ("", "end"))
    signals: dict[str, int] = {}
    for m in stops:
        if m.startswith("preemption"):
            name = m.partition(": ")[2] or "a signal"
            signals[name] = signals.get(name, 0) + 1
    failed = sum(1 for m in stops if m.startswith("error"))
    parts = [f"{ended} ended cleanly"]
    parts += [f"{n} stopped by {name}" for name, n in sorted(signals.items())]
    if failed:
        parts.append(f"{failed} failed")
    missing = starts - len(stops)
    if missing > 0:
        parts.append(f"{missing} without a stop (killed, or still running)")
    return ", ".join(parts)


def write_csv(runs: list[Run], out: object) -> int:
    """Write every scalar point as ``run,tag,step,wall_time,value``; return the row count."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["run", "tag", "step", "wall_time", "value"])
    rows = 0
    for run_ in runs:
        for s in run_.series:
            if s.kind != "scalar":
                continue
            for step, wall, value in zip(s.steps, s.wall_times, s.values):
                writer.writerow([run_.name, s.tag, step, repr(wall), repr(value)])
                rows += 1
    return rows


def plot(runs: list[Run], path: str) -> int:
    """Draw every scalar tag in its own panel (one line per run); return the panel count.

    Raises:
        ImportError: matplotlib is not installed (with how to install it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "--plot needs matplotlib: pip install 'torchsupervisor[plot]' (or matplotlib)"
        ) from e
    tags = sorted({s.tag for r in runs for s in r.series if s.kind == "scalar" and s.steps})
    if not tags:
        raise NotFoundError("No scalar series to plot")
    columns = min(3, len(tags))
    rows = (len(tags) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.2 * rows), squeeze=False)
    for ax, tag in zip(axes.flat, tags):
        for run_ in runs:
            for s in run_.series:
                if s.tag == tag and s.kind == "scalar":
                    ax.plot(s.steps, s.values, label=run_.name, linewidth=1.2)
        ax.set_title(tag)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(tags) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return len(tags)


def run(args: argparse.Namespace) -> int:
    """Run ``torchsupervisor events``; returns the exit status."""
    runs = read_runs(args.logdir, args.tag)
    if args.csv:
        write_csv(runs, sys.stdout)
    if args.plot:
        panels = plot(runs, args.plot)
        print(f"Wrote {args.plot} ({panels} scalar series)", file=sys.stderr)
    if not args.csv and not args.plot:
        print_runs(runs)
    return 0
