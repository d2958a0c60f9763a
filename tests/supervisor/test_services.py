"""Supervisor services: checkpoints, summaries, global_step/sec, and what lands on disk.

Real models, real files, TensorBoard's own reader. Services run on short or long real intervals;
the tests rely on the immediate first run of each service and on explicit stops, and poll
observable conditions with a deadline instead of sleeping.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import threading
import time

import pytest
import torch
from supervisor_helpers import (
    CHECKPOINT,
    START,
    STOP,
    Counter,
    Trainer,
    accumulator,
    all_events,
    checkpoint_steps,
    event_files,
    read_checkpoint,
    read_events,
    scalars,
    session_logs,
    temporary_files,
    wait_for_checkpoint,
    wait_for_tag,
    wait_until,
)
from tensorboard.compat.proto.event_pb2 import LogMessage
from tensorboard.compat.proto.summary_pb2 import Summary

from torchsupervisor import (
    GlobalStep,
    Graph,
    Saver,
    Supervisor,
    get_checkpoint_state,
    latest_checkpoint,
    summary,
)
from torchsupervisor.core.coordinator import Coordinator
from torchsupervisor.errors import CheckpointSaveError, OutOfRangeError
from torchsupervisor.supervisor.services import SVStepCounterThread
from torchsupervisor.testing import FakeClock, FaultyStorage, GatedStorage, events_worker_of


def _only_events(logdir):
    (path,) = event_files(logdir)
    return read_events(path)


# --------------------------------------------------------------------- scenario 1: on disk


def test_very_simple_loop_leaves_checkpoints_and_a_tensorboard_log(tmp_path):
    logdir = str(tmp_path)
    t = Trainer()
    sv = Supervisor(logdir=logdir, state=t.state, save_summaries_secs=3600, save_model_secs=3600)
    with sv.managed_session() as sess:
        # The first run of each service is immediate: before any training step.
        wait_for_checkpoint(sv, 0)
        for _ in range(7):
            if sv.should_stop():
                break
            sess.run(t.train_step)
    assert sv.should_stop()

    # Checkpoints: TF's prefix naming and the text state file.
    assert checkpoint_steps(logdir) == [0, 7]
    state = get_checkpoint_state(logdir)
    assert state.model_checkpoint_path == os.path.join(logdir, "model.ckpt-7")
    assert list(state.all_model_checkpoint_paths) == [
        os.path.join(logdir, "model.ckpt-0"),
        os.path.join(logdir, "model.ckpt-7"),
    ]
    tree = read_checkpoint(os.path.join(logdir, "model.ckpt-7"))
    assert tree["global_step"] == {"value": 7}
    for name, value in t.weights().items():
        assert torch.equal(tree["model"][name], value)

    # The events file: START at the first step the session produces, CHECKPOINT with the
    # prefix without its step, STOP without a step, last; no global_step/sec, since no
    # interval of it ended (TF wrote a 0.0 at the start).
    events = _only_events(logdir)
    logs = session_logs(events)
    assert logs[0] == (1, START, "")
    assert [log for log in logs if log[1] == CHECKPOINT] == [
        (0, CHECKPOINT, os.path.join(logdir, "model.ckpt")),
        (7, CHECKPOINT, os.path.join(logdir, "model.ckpt")),
    ]
    assert logs[-1] == (0, STOP, "")
    assert events[-1].HasField("session_log")  # nothing after STOP
    assert scalars(events, "global_step/sec") == []

    acc = accumulator(logdir)
    assert "global_step/sec" not in acc.Tags()["scalars"]
    # No graph in eager PyTorch: no graph.pbtxt, no graph or meta-graph event.
    assert not os.path.exists(os.path.join(logdir, "graph.pbtxt"))
    assert not any(e.graph_def or e.meta_graph_def for e in events)
    assert acc.Tags()["graph"] is False and acc.Tags()["meta_graph"] is False


def test_without_global_step_checkpoints_have_no_suffix_and_no_start_is_written(tmp_path):
    logdir = str(tmp_path)
    c = Counter()
    sv = Supervisor(
        logdir=logdir,
        state=c.state,
        global_step=None,
        save_summaries_secs=3600,
        summary_op=lambda: Summary(value=[Summary.Value(tag="w", simple_value=float(c.w))]),
    )
    with sv.managed_session() as sess:
        wait_until(lambda: os.path.exists(sv.save_path + ".index"), poll=sv.should_stop)
        wait_for_tag(sv, "w")
        sess.run(c.step)
        assert sorted(t.name for t in threading.enumerate() if t.name.startswith("SV")) == [
            "SVSummaryThread",
            "SVTimerCheckpointThread",
        ]
    assert latest_checkpoint(logdir) == os.path.join(logdir, "model.ckpt")
    assert read_checkpoint(sv.save_path)["w"] == 1.0  # the final save overwrote it
    events = _only_events(logdir)
    assert [status for _, status, _ in session_logs(events)] == [STOP]
    assert scalars(events, "w") == [(0, 0.0)]  # no step field
    assert scalars(events, "global_step/sec") == []


def test_integer_tensor_global_step_counts_as_global_step_per_sec(tmp_path):
    step = torch.zeros((), dtype=torch.int64)
    sv = Supervisor(
        logdir=str(tmp_path),
        state={"global_step": step, "w": torch.zeros(1)},
        save_model_secs=0,
        save_summaries_secs=0.05,
    )
    with sv.managed_session() as sess:

        def written() -> bool:
            sv.summary_writer.flush()
            return bool(scalars(all_events(str(tmp_path)), "global_step/sec"))

        wait_until(written, poll=lambda: sess.run(lambda: step.add_(1)), what="a rate")
    tags = {v.tag for e in _only_events(tmp_path) for v in e.summary.value}
    assert {t for t in tags if not t.startswith(("goodput/", "badput/"))} == {"global_step/sec"}
    rates = scalars(_only_events(tmp_path), "global_step/sec")
    assert all(at > 0 for at, _ in rates)  # No 0.0 written at the start.


class _Rates:
    def __init__(self) -> None:
        self.written: list[tuple[int, float]] = []

    def add_summary(self, summary, step) -> None:
        self.written.append((step, summary.value[0].simple_value))


def test_no_step_rate_is_written_before_training_steps_then_a_stall_shows_as_zero():
    clock = FakeClock()
    step, rates = GlobalStep(), _Rates()
    step.assign(40)  # A resumed run.
    thread = SVStepCounterThread(Coordinator(clock=clock), 10.0, step, rates)
    thread.start_loop()
    thread.run_loop()  # The run at the start: nothing measured, nothing written.
    clock.advance(10.0)
    thread.run_loop()  # Restoring, evaluating: no step yet, and not a stall.
    assert rates.written == []
    step.assign(60)
    clock.advance(10.0)
    thread.run_loop()
    step.assign(60)
    clock.advance(10.0)
    thread.run_loop()  # No step in this interval: a stall, written as 0.0.
    assert rates.written == [(60, 2.0), (60, 0.0)]


def test_services_follow_the_intervals_and_summary_op(tmp_path):
    sv = Supervisor(logdir=str(tmp_path), state=Trainer().state, save_summaries_secs=3600)
    with sv.managed_session(start_standard_services=False) as sess:
        assert not any(t.name.startswith("SV") for t in threading.enumerate())
        threads = sv.start_standard_services(sess)
        # No summary op (nothing in SUMMARIES): only the step counter and the checkpoints.
        assert [t.name for t in threads] == ["SVStepCounterThread", "SVTimerCheckpointThread"]
        assert all(t.is_alive() for t in threads)
    assert not any(t.is_alive() for t in threads)

    for secs, expected in [
        ((0, 600), ["SVTimerCheckpointThread"]),
        ((120, 0), ["SVSummaryThread", "SVStepCounterThread"]),
        ((0, 0), []),
    ]:
        graph = Graph()
        sv = Supervisor(
            graph=graph,
            logdir=str(tmp_path / f"run{secs}"),
            state=Trainer().state,
            summary_op=lambda: Summary(),
            save_summaries_secs=secs[0],
            save_model_secs=secs[1],
        )
        with sv.managed_session(start_standard_services=False) as sess:
            assert [t.name for t in sv.start_standard_services(sess)] == expected


def test_summary_service_writes_the_default_merged_summaries_at_the_current_step(tmp_path):
    t = Trainer()
    t.global_step.assign(40)
    summary.scalar("bias", lambda: t.model.bias.detach())
    sv = Supervisor(
        logdir=str(tmp_path), state=t.state, save_summaries_secs=3600, save_model_secs=0
    )
    with sv.managed_session():
        wait_for_tag(sv, "bias")  # the summary service's first run is immediate
    assert scalars(_only_events(tmp_path), "bias") == [(40, pytest.approx(t.model.bias.item()))]


# --------------------------------------------------------------- final and skipped checkpoints


@pytest.mark.parametrize("ending", ["normal", "OutOfRangeError", "StopIteration"])
def test_a_clean_exit_saves_a_final_checkpoint_at_the_current_step(tmp_path, ending):
    logdir = str(tmp_path)
    t = Trainer()
    sv = Supervisor(logdir=logdir, state=t.state, save_summaries_secs=0, save_model_secs=3600)
    data = iter(range(3))
    with sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        for _ in range(3):
            next(data)
            sess.run(t.train_step)
        if ending == "OutOfRangeError":
            raise OutOfRangeError(None, None, "End of sequence")
        if ending == "StopIteration":
            next(data)
    assert checkpoint_steps(logdir) == [0, 3]
    assert latest_checkpoint(logdir) == os.path.join(logdir, "model.ckpt-3")
    tree = read_checkpoint(latest_checkpoint(logdir))
    for name, value in t.weights().items():
        assert torch.equal(tree["model"][name], value)
    checkpoints = [(s, st) for s, st, _ in session_logs(_only_events(logdir)) if st == CHECKPOINT]
    assert checkpoints == [(0, CHECKPOINT), (3, CHECKPOINT)]


def test_no_final_checkpoint_after_an_error_exit(tmp_path):
    logdir = str(tmp_path)
    c = Counter()
    sv = Supervisor(logdir=logdir, state=c.state, save_summaries_secs=0, save_model_secs=3600)
    with pytest.raises(RuntimeError, match="diverged"), sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        for _ in range(3):
            sess.run(c.step)
        raise RuntimeError("diverged")
    assert checkpoint_steps(logdir) == [0]
    logs = session_logs(_only_events(logdir))
    assert [(s, st) for s, st, _ in logs] == [(1, START), (0, CHECKPOINT), (0, STOP)]


def test_keyboard_interrupt_mid_step_does_not_save_a_torn_final_checkpoint(tmp_path):
    logdir = str(tmp_path)
    c = Counter()
    sv = Supervisor(logdir=logdir, state=c.state, save_summaries_secs=0, save_model_secs=3600)
    with pytest.raises(KeyboardInterrupt), sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        for _ in range(3):
            sess.run(c.step)
        c.half_step()
        raise KeyboardInterrupt
    tree = read_checkpoint(latest_checkpoint(logdir))
    assert tree["w"] == tree["global_step"]["value"]


def test_swallowed_body_error_does_not_save_a_torn_final_checkpoint(tmp_path):
    logdir = str(tmp_path)
    c = Counter()
    sv = Supervisor(logdir=logdir, state=c.state, save_summaries_secs=0, save_model_secs=3600)
    with sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        for _ in range(3):
            sess.run(c.step)
        sv.request_stop()
        c.half_step()
        raise RuntimeError("failed in the middle of a step")
    tree = read_checkpoint(latest_checkpoint(logdir))
    assert tree["w"] == tree["global_step"]["value"]


def test_a_step_already_saved_is_not_saved_again(tmp_path):
    logdir = str(tmp_path)
    c = Counter()
    sv = Supervisor(logdir=logdir, state=c.state, save_summaries_secs=0, save_model_secs=3600)
    with sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        sess.run(c.step)
        assert sv.checkpoint() == os.path.join(logdir, "model.ckpt-1")
        assert sv.checkpoint() is None  # the step did not move
    # Nor at exit: one checkpoint per step, one CHECKPOINT event per checkpoint.
    assert checkpoint_steps(logdir) == [0, 1]
    logs = [(s, st) for s, st, _ in session_logs(_only_events(logdir)) if st == CHECKPOINT]
    assert logs == [(0, CHECKPOINT), (1, CHECKPOINT)]


def test_checkpoint_method_saves_now_and_needs_a_checkpoint_service(tmp_path):
    logdir = str(tmp_path)
    c = Counter()
    sv = Supervisor(logdir=logdir, state=c.state, save_summaries_secs=0, save_model_secs=3600)
    with pytest.raises(RuntimeError, match="checkpoint\\(\\) needs a running checkpoint service"):
        sv.checkpoint()
    with sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        sess.run(c.step)
        sess.run(c.step)
        prefix = sv.checkpoint()
        assert prefix == os.path.join(logdir, "model.ckpt-2")
        # Committed when it returns.
        assert latest_checkpoint(logdir) == prefix
        saved = read_checkpoint(prefix)
        assert set(saved) == {"w", "global_step", "rng"}  # The RNG state is saved by default.
        assert saved["w"] == torch.tensor(2.0) and saved["global_step"] == {"value": 2}
    with pytest.raises(RuntimeError, match="needs a running checkpoint service"):
        sv.checkpoint()

    no_saves = Supervisor(
        graph=Graph(), logdir=str(tmp_path / "x"), state=Counter().state, save_model_secs=0
    )
    with no_saves.managed_session(), pytest.raises(RuntimeError, match="checkpoint service"):
        no_saves.checkpoint()
    assert checkpoint_steps(tmp_path / "x") == []


def test_each_checkpoint_flushes_the_events_file(tmp_path):
    """The summaries of the steps up to a checkpoint reach the disk before it (fsync)."""
    logdir = str(tmp_path)
    c = Counter()
    sv = Supervisor(logdir=logdir, state=c.state, save_summaries_secs=0, save_model_secs=3600)
    with sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        sv.checkpoint_driver.wait()  # The step-0 commit and its CHECKPOINT event are done.
        writer = sv.summary_writer
        requests = []
        request_flush = writer.request_flush
        writer.request_flush = lambda: (requests.append(c.global_step.value), request_flush())
        sess.run(c.step)
        writer.add_scalar("loss", 0.5, 1)
        sv.checkpoint()  # flush_secs is 120 s: only the checkpoint asks for a flush now.
        assert requests == [1]  # Asked at the snapshot (the writer's tests cover the fsync).
        (path,) = event_files(logdir)
        wait_until(lambda: 1 in [step for step, _ in scalars(read_events(path), "loss")])
        # The Supervisor's writer queues thousands of events, not TF's 10, before blocking.
        assert events_worker_of(writer).max_queue >= 4096


# ------------------------------------------------------------------------ consistency


def test_every_checkpoint_is_a_snapshot_of_one_step(tmp_path):
    logdir = str(tmp_path)
    c = Counter(pause_secs=0.001)
    sv = Supervisor(
        logdir=logdir,
        state=c.state,
        saver=Saver(max_to_keep=0),  # keep every checkpoint to check them all
        save_summaries_secs=0,
        save_model_secs=0.02,
    )
    with sv.managed_session() as sess:
        wait_until(
            lambda: len(checkpoint_steps(logdir)) >= 6 or c.global_step.value >= 5000,
            poll=lambda: sess.run(c.step),
            what="six checkpoints",
        )
        sess.run(c.step)
    steps = checkpoint_steps(logdir)
    assert len(steps) >= 6
    assert steps[-1] == c.global_step.value  # the final one
    for step in steps:
        tree = read_checkpoint(os.path.join(logdir, f"model.ckpt-{step}"))
        assert tree["global_step"] == {"value": step}
        assert float(tree["w"]) == step, f"checkpoint {step} has w={float(tree['w'])}"
    logged = [s for s, st, _ in session_logs(_only_events(logdir)) if st == CHECKPOINT]
    assert logged == steps


# ----------------------------------------------------------------- scenarios 3 and 6: writing


def test_summary_computed_writes_protos_and_bytes_at_the_current_step(tmp_path):
    c = Counter()
    sv = Supervisor(logdir=str(tmp_path), state=c.state, summary_op=None, save_model_secs=0)
    with sv.managed_session() as sess:
        assert not any(t.name == "SVSummaryThread" for t in threading.enumerate())
        for step in range(4):
            sess.run(c.step)
            if step % 2 == 0:
                proto = summary.scalar_pb("loss", 10.0 - step)
                sv.summary_computed(sess, proto if step == 0 else proto.SerializeToString())
        sv.summary_computed(sess, summary.scalar_pb("loss", 0.5), global_step=100)
        with pytest.raises(TypeError):
            sv.summary_computed(sess, "not a summary")
        with pytest.raises(TypeError):
            sv.summary_computed(sess, 3.5)
    assert scalars(_only_events(tmp_path), "loss") == [(1, 10.0), (3, 8.0), (100, 0.5)]


def test_all_events_of_a_run_go_to_its_one_events_file(tmp_path):
    t = Trainer()
    sv = Supervisor(logdir=str(tmp_path), state=t.state, save_summaries_secs=3600)
    with sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        for _ in range(5):
            loss = sess.run(t.train_step)
            sv.summary_writer.add_scalar("train/loss", loss, global_step=t.global_step)
            sv.summary_computed(sess, summary.scalar_pb("computed", 1.0))
            sv.summary_writer.add_histogram("weights", t.model.weight, global_step=t.global_step)
    (path,) = event_files(tmp_path)  # one file for everything
    events = read_events(path)
    assert [s for s, _ in scalars(events, "train/loss")] == [1, 2, 3, 4, 5]
    assert [s for s, _ in scalars(events, "computed")] == [1, 2, 3, 4, 5]
    statuses = [st for _, st, _ in session_logs(events)]
    assert statuses[0] == START and statuses[-1] == STOP and statuses.count(CHECKPOINT) == 2
    acc = accumulator(tmp_path)
    assert [s.step for s in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5]
    assert [h.step for h in acc.Histograms("weights")] == [1, 2, 3, 4, 5]


# --------------------------------------------------------------------- failed checkpoints


def test_a_failed_background_checkpoint_is_reported_and_training_goes_on(tmp_path, caplog):
    logdir = str(tmp_path)
    storage = FaultyStorage()
    c = Counter()
    sv = Supervisor(
        logdir=logdir,
        state=c.state,
        saver=Saver(storage=storage),
        save_summaries_secs=0,
        save_model_secs=0.02,
    )
    caplog.set_level(logging.INFO, logger="torchsupervisor")
    with sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        fault = storage.fail("rename", errno=errno.ENOSPC)
        wait_until(lambda: fault.raised > 0, poll=lambda: sess.run(c.step), what="the failed save")
        wait_until(
            lambda: any("failed; training continues" in m for m in caplog.messages),
            what="the error log",
        )
        assert not sv.should_stop()
        for _ in range(3):
            sess.run(c.step)
    # The failed save left no file behind and did not touch the older checkpoint.
    assert temporary_files(logdir) == []
    assert read_checkpoint(os.path.join(logdir, "model.ckpt-0"))["w"] == 0.0
    # Training went on to the end, and the final checkpoint was written.
    assert latest_checkpoint(logdir) == os.path.join(logdir, f"model.ckpt-{c.global_step.value}")
    assert len([m for m in caplog.messages if "failed; training continues" in m]) == 1
    messages = [e for e in _only_events(logdir) if e.HasField("log_message")]
    assert len(messages) == 1
    assert messages[0].log_message.level == LogMessage.ERROR
    step = messages[0].step
    assert 0 < step < c.global_step.value
    assert messages[0].log_message.message.startswith(f"Checkpoint at step {step} failed: ")
    assert step not in checkpoint_steps(logdir)


def test_a_vanished_checkpoint_directory_is_reported_and_training_goes_on(tmp_path, caplog):
    logdir = str(tmp_path / "run")
    c = Counter()
    sv = Supervisor(logdir=logdir, state=c.state, save_summaries_secs=0, save_model_secs=0.02)
    caplog.set_level(logging.INFO, logger="torchsupervisor")
    with sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        shutil.rmtree(logdir)
        # The periodic save finds no directory: reported, not raised from sess.run.
        wait_until(
            lambda: any("doesn't exist, can't save" in m for m in caplog.messages),
            poll=lambda: sess.run(c.step),
            what="the reported failure",
        )
        assert not sv.should_stop()
        os.makedirs(logdir)
        for _ in range(3):
            sess.run(c.step)
    # Once the directory is back, the final checkpoint is written there.
    assert latest_checkpoint(logdir) == os.path.join(logdir, f"model.ckpt-{c.global_step.value}")


def test_a_preemption_save_into_a_vanished_directory_is_reported_not_raised(tmp_path, caplog):
    logdir = str(tmp_path / "run")
    c = Counter()
    sv = Supervisor(logdir=logdir, state=c.state, save_summaries_secs=0, save_model_secs=3600)
    caplog.set_level(logging.INFO, logger="torchsupervisor")
    with pytest.raises(SystemExit) as leaving, sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        sess.run(c.step)
        shutil.rmtree(logdir)
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_until(sv.should_stop, what="the stop after the signal")
    # The final checkpoint within the grace budget failed: reported on one line, and the
    # session ends with a non-zero exit (work was lost), not with an exception's traceback.
    assert leaving.value.code == 1
    assert any("doesn't exist, can't save" in m for m in caplog.messages), caplog.messages
    (line,) = [m for m in caplog.messages if "the final checkpoint failed" in m]
    assert line.startswith("Stopped by SIGUSR1 at step 1 but the final checkpoint failed")
    assert "the last committed checkpoint is step 0" in line
    assert not os.path.exists(logdir)


def test_a_failed_explicit_checkpoint_raises_and_training_can_go_on(tmp_path):
    logdir = str(tmp_path)
    storage = FaultyStorage()
    c = Counter()
    sv = Supervisor(
        logdir=logdir,
        state=c.state,
        saver=Saver(storage=storage),
        save_model_secs=3600,
        save_summaries_secs=0,
    )
    with sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        sess.run(c.step)
        storage.fail("open", errno=errno.ENOSPC)
        with pytest.raises(CheckpointSaveError):
            sv.checkpoint()
        assert not sv.should_stop()
        sess.run(c.step)
    assert checkpoint_steps(logdir) == [0, 2]
    assert temporary_files(logdir) == []


def test_a_failed_final_checkpoint_is_raised_after_the_services_stopped(tmp_path):
    logdir = str(tmp_path)
    storage = FaultyStorage()
    c = Counter()
    sv = Supervisor(
        logdir=logdir,
        state=c.state,
        saver=Saver(storage=storage),
        save_model_secs=3600,
        save_summaries_secs=0,
    )
    with pytest.raises(CheckpointSaveError), sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        sess.run(c.step)
        storage.fail("open", errno=errno.ENOSPC)
    assert checkpoint_steps(logdir) == [0]
    assert session_logs(_only_events(logdir))[-1][1] == STOP
    assert not any(t.name.startswith("SV") for t in threading.enumerate())


class _RecordingSaver(Saver):
    """Records the step of every background save; the first save's done-callbacks start with
    a slow one (as when the CHECKPOINT event waits for room in a full summary queue)."""

    def __init__(self):
        # Each commit takes a little time, so a save is surely still in flight afterwards.
        storage = FaultyStorage()
        storage.delay("fsync_dir", 0.05)
        super().__init__(storage=storage)
        self.steps = []
        self.second = threading.Event()

    def save_async(self, sess, save_path, global_step=None, **kwargs):
        self.steps.append(int(global_step))
        if len(self.steps) == 2:
            self.second.set()
        future = super().save_async(sess, save_path, global_step, **kwargs)
        if len(self.steps) == 1:
            future.add_done_callback(lambda f: self.second.wait(4))
        return future


def test_a_request_while_the_previous_save_finishes_does_not_save_the_same_step_again(tmp_path):
    saver = _RecordingSaver()
    sv = Supervisor(
        logdir=str(tmp_path),
        state=Counter().state,
        saver=saver,
        save_summaries_secs=0,
        save_model_secs=0.01,
    )
    with sv.managed_session():
        wait_until(lambda: saver.steps, poll=sv.should_stop, what="the first save")
        deadline = time.monotonic() + 4.5
        while time.monotonic() < deadline and len(saver.steps) < 2:
            sv.should_stop()  # step boundaries at the same step, while the timer requests
            time.sleep(0.002)
    assert saver.steps == [0]


def test_stop_on_checkpoint_error_stops_training_and_reraises(tmp_path):
    logdir = str(tmp_path)
    storage = FaultyStorage()
    c = Counter()
    sv = Supervisor(
        logdir=logdir,
        state=c.state,
        saver=Saver(storage=storage),
        save_summaries_secs=0,
        save_model_secs=0.02,
        stop_on_checkpoint_error=True,
    )
    with (
        pytest.raises(CheckpointSaveError, match="No space left on device"),
        sv.managed_session() as sess,
    ):
        wait_for_checkpoint(sv, 0)
        storage.fail("rename", errno=errno.ENOSPC)
        wait_until(sv.should_stop, poll=lambda: sess.run(c.step), what="the stop")
    # No final checkpoint after the failure; the older checkpoint is untouched.
    assert checkpoint_steps(logdir) == [0]
    assert temporary_files(logdir) == []


# ------------------------------------------------------- a request while a save is in flight


def test_a_request_while_a_save_is_in_flight_is_served_after_it_without_blocking(tmp_path):
    """The training thread never waits for the save being written, and the request that
    came during it is not lost: it is served at the first step boundary after the commit."""
    storage = GatedStorage()
    c = Counter()
    sv = Supervisor(
        logdir=str(tmp_path),
        state=c.state,
        saver=Saver(storage=storage),
        save_summaries_secs=0,
        save_model_secs=3600,  # Only the immediate first save comes from the timer.
    )
    with sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        driver = sv.checkpoint_driver  # What the timer thread calls on schedule.
        gate = storage.hold("fsync")  # The next save is held in its first fsync.
        watchdog = threading.Timer(30, gate.open)  # Fails the test below, never hangs.
        watchdog.start()
        try:
            sess.run(c.step)
            driver.request(sess)
            sess.run(c.step)  # Its boundary, at step 1: the save starts and is held.
            assert gate.reached.wait(30)
            assert sv.saver.in_flight
            driver.request(sess)  # Arrives while the save of step 1 is being written.
            for _ in range(5):
                sess.run(c.step)  # Not blocked by the held save...
            assert not gate.opened.is_set()  # ...(the watchdog did not have to free it).
            assert c.global_step.value == 7 and sv.saver.in_flight
            assert checkpoint_steps(str(tmp_path)) == [0]
            gate.open()
            # Served at the first boundary after step 1 commits, at the step reached then.
            wait_for_checkpoint(sv, 7)
        finally:
            watchdog.cancel()
            gate.open()
    assert checkpoint_steps(str(tmp_path)) == [0, 1, 7]
    assert read_checkpoint(str(tmp_path / "model.ckpt-7"))["w"] == 7.0
    assert read_checkpoint(str(tmp_path / "model.ckpt-1"))["w"] == 1.0
