"""``torchsupervisor events``: tags, points and last values as TensorBoard shows them."""

from __future__ import annotations

import csv
import io
import logging
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from torchsupervisor import GlobalStep, SummaryWriter, Supervisor

from .conftest import cli


def _supervisor(logdir: str):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = GlobalStep()
    step.bind(optimizer)  # every optimizer.step() adds 1
    sv = Supervisor(
        logdir=logdir,
        state={"model": model, "optimizer": optimizer, "global_step": step},
        save_model_secs=3600,
        save_summaries_secs=0,
        summary_op=None,
        goodput_ledger=False,  # Only the loop's scalars (and steps_lost): the series counted.
    )
    return sv, step, model, optimizer


def _train(sv, step, model, optimizer, run_id: int, until: int, checkpoint_at=None):
    """Train up to step ``until``; a point per step, labeled with the step it describes."""

    def train_step():
        optimizer.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()

    writer = sv.summary_writer
    while step.value < until:
        current = step.value
        if checkpoint_at is not None and current == checkpoint_at:
            sv.checkpoint()
        sv.should_stop()
        train_step()
        writer.add_scalar("train/loss", run_id * 100.0 + current, current)
        if current % 2 == 0:
            writer.add_histogram("weights", np.arange(current + 1.0), current)


@pytest.fixture
def restarted(tmp_path) -> str:
    """A run killed at step 8 after a checkpoint at step 5, then resumed up to step 10."""
    live, crashed = str(tmp_path / "live"), str(tmp_path / "run")
    sv, step, model, optimizer = _supervisor(live)
    with sv.managed_session():
        _train(sv, step, model, optimizer, 1, 8, checkpoint_at=5)
        sv.summary_writer.flush()
        shutil.copytree(live, crashed)  # what a crash now leaves: no STOP, points past 5
    sv, step, model, optimizer = _supervisor(crashed)
    with sv.managed_session():
        assert step.value == 5
        _train(sv, step, model, optimizer, 2, 10)
    return crashed


def test_listing_after_a_restart(restarted, capsys, caplog):
    with caplog.at_level(logging.WARNING):
        status, out, err = cli(capsys, "events", restarted)
    assert status == 0
    assert f"Run . ({restarted}): 2 events file(s)" in out
    # The crashed session wrote no STOP: it is not counted as a clean stop.
    assert "sessions: 2 start(s); 1 ended cleanly, 1 without a stop (killed" in out
    # The restart is in our listing, not in TensorBoard's warning: the crash logged up to
    # step 7 (labelled with the step before each step, which the resumed run logs again).
    assert "  restart: resumed at step 5 (2 logged steps lost)\n" in out
    assert "out of order" not in err + caplog.text
    assert "checkpoints:" in out and "the last at step 10" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    loss = lines["train/loss"]
    assert loss[1:6] == ["scalar", "10", "0", "9", "209"]  # stale 5-7 of the crash purged
    weights = lines["weights"]
    assert weights[1:5] == ["histogram", "5", "0", "8"]
    assert weights[5] == "n=9" and weights[6] == "mean=4"


def test_csv_has_one_continuous_series(restarted, capsys):
    status, out, _ = cli(capsys, "events", restarted, "--csv")
    assert status == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    loss = [(int(r["step"]), float(r["value"])) for r in rows if r["tag"] == "train/loss"]
    assert loss == [(s, (100.0 if s < 5 else 200.0) + s) for s in range(10)]
    assert {r["run"] for r in rows} == {"."}
    assert all(float(r["wall_time"]) > 1e9 for r in rows)


def test_plot(restarted, tmp_path, capsys):
    out_png = str(tmp_path / "curves.png")
    status, _, err = cli(capsys, "events", restarted, "--plot", out_png)
    assert status == 0
    assert f"Wrote {out_png} (2 scalar series)" in err  # loss, torchsupervisor/steps_lost
    with Image.open(out_png) as image:
        assert image.format == "PNG" and image.width > 100 and image.height > 100
        pixels = np.asarray(image.convert("L"))
        assert pixels.min() < 128  # something was drawn on the white background


def test_plot_without_scalars_and_tag_filter(restarted, tmp_path, capsys):
    status, out, _ = cli(capsys, "events", restarted, "--tag", "weight*")
    assert status == 0
    assert "weights" in out and "train/loss" not in out
    status, _, err = cli(capsys, "events", restarted, "--tag", "weight*", "--plot", "x.png")
    assert status == 1 and "No scalar series to plot" in err


def test_runs_in_subdirectories_and_all_kinds(tmp_path, capsys):
    for name in ("a", "b/c"):
        with SummaryWriter(tmp_path / name) as w:
            for step in range(3):
                w.add_scalar("acc", 0.5 + step, step)
            w.add_image("img", torch.zeros(3, 4, 5), 2)
            w.add_text("note", "hello", 1)
            w.add_audio("snd", torch.zeros(10), 1, sample_rate=8000)
    status, out, _ = cli(capsys, "events", str(tmp_path))
    assert status == 0
    assert "Run a (" in out and "Run b/c (" in out
    lines = [line.split() for line in out.splitlines() if line.strip()]
    kinds = {(row[0], row[1]) for row in lines if row[0] in ("acc", "img", "note", "snd")}
    assert kinds == {("acc", "scalar"), ("img", "image"), ("note", "text"), ("snd", "audio")}
    img = next(row for row in lines if row[0] == "img")
    assert img[5] == "5x4"
    status, out, _ = cli(capsys, "events", str(tmp_path), "--csv")
    runs = {(r["run"], r["tag"]) for r in csv.DictReader(io.StringIO(out))}
    assert runs == {("a", "acc"), (os.path.join("b", "c"), "acc")}


def test_truncated_file_and_missing_events(tmp_path, capsys):
    with SummaryWriter(tmp_path / "run") as w:
        for step in (1, 2, 3):
            w.add_scalar("x", float(step), step)
    (path,) = [os.path.join(tmp_path, "run", n) for n in os.listdir(tmp_path / "run")]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)  # the last record is cut
    status, out, _ = cli(capsys, "events", str(tmp_path / "run"))
    assert status == 0
    assert "truncated record at byte offset" in out and "; read up to there" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["x"][2:5] == ["2", "1", "2"]  # TensorBoard too reads what precedes the cut
    os.makedirs(tmp_path / "empty")
    status, _, err = cli(capsys, "events", str(tmp_path / "empty"))
    assert status == 1 and "No events files in" in err


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_an_events_file_that_is_not_a_regular_file_is_an_error_not_a_hang(tmp_path, capsys, kind):
    from torchsupervisor.storage import NotRegularFileError
    from torchsupervisor.summary import summary_iterator

    path = tmp_path / "events.out.tfevents.1700000000.host"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(kind, path)
    status, _, err = cli(capsys, "events", str(tmp_path))
    assert status == 1
    assert err.startswith("torchsupervisor events: error: Events file ")
    assert "is not a regular file" in err
    with pytest.raises(NotRegularFileError):
        list(summary_iterator(str(path)))


def _crafted_file(logdir, last: bytes | None = None, claim: int | None = None) -> tuple[str, int]:
    """An events file with points at steps 1-3, then a crafted record: ``last`` (a payload
    with valid framing), or a header claiming ``claim`` bytes (valid length checksum) in a
    file made 1 GiB long (sparse)."""
    from tensorboard.compat.proto import event_pb2

    from torchsupervisor.summary.records import encode_record, masked_crc32c

    os.makedirs(logdir, exist_ok=True)
    path = os.path.join(logdir, "events.out.tfevents.1700000000.crafted")
    with open(path, "wb") as f:
        f.write(encode_record(event_pb2.Event(file_version="brain.Event:2").SerializeToString()))
        for step in (1, 2, 3):
            event = event_pb2.Event(step=step, wall_time=1.0)
            event.summary.value.add(tag="x", simple_value=float(step))
            f.write(encode_record(event.SerializeToString()))
        good = f.tell()
        if last is not None:
            f.write(encode_record(last))
        else:
            header = claim.to_bytes(8, "little")
            f.write(header + masked_crc32c(header).to_bytes(4, "little"))
            f.truncate(1 << 30)
    return path, good


def _garbage_meta_graph() -> bytes:
    from tensorboard.compat.proto import event_pb2

    return event_pb2.Event(step=4, meta_graph_def=b"\xff\x00not a MetaGraphDef").SerializeToString()


@pytest.mark.parametrize(
    "crafted",
    [b"\xff\xff\xff\xff not an Event", _garbage_meta_graph()],
    ids=["not-an-event", "bad-meta-graph"],
)
def test_a_record_tensorboards_loader_cannot_take_is_named_and_skipped(tmp_path, capsys, crafted):
    # Both records crashed the command inside TensorBoard's loader (DecodeError).
    path, offset = _crafted_file(str(tmp_path / "run"), last=crafted)
    status, out, _ = cli(capsys, "events", str(tmp_path / "run"))
    assert status == 0
    assert f"at byte offset {offset} in {path} is not a valid Event" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["x"][1:5] == ["scalar", "3", "1", "3"]  # What precedes it, as TensorBoard.


def test_a_crafted_record_length_costs_neither_memory_nor_time(tmp_path, capsys):
    # A 1 GiB file whose record claims 900 MiB: 3.9 GB and 300 s for the command before.
    import time
    import tracemalloc

    path, offset = _crafted_file(str(tmp_path / "run"), claim=900 << 20)
    tracemalloc.start()
    start = time.monotonic()
    try:
        status, out, _ = cli(capsys, "events", str(tmp_path / "run"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 0 and f"corrupted record at byte offset {offset} in {path}" in out
    assert peak < 64 << 20 and time.monotonic() - start < 60


def test_sessions_are_listed_by_how_they_ended(tmp_path, capsys):
    # A chief stopped by torchrun's SIGTERM after another rank crashed was a "clean stop".
    from tensorboard.compat.proto.event_pb2 import SessionLog

    logdir = str(tmp_path / "run")
    for msg in ("end", "preemption: SIGTERM", "error: ValueError: diverged", None):
        with SummaryWriter(logdir) as w:
            w.add_session_log(SessionLog(status=SessionLog.START), 1)
            w.add_scalar("loss", 1.0, 1)
            if msg is not None:
                w.add_session_log(SessionLog(status=SessionLog.STOP, msg=msg))
    status, out, _ = cli(capsys, "events", logdir)
    assert status == 0
    assert (
        "sessions: 4 start(s); 1 ended cleanly, 1 stopped by SIGTERM, 1 failed, "
        "1 without a stop (killed, or still running)"
    ) in out
