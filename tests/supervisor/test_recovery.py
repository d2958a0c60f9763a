"""Supervisor restarts: restore, TensorBoard's purge on START, init_fn, custom init ops,
basic_train_loop, and reusing a supervisor (its writer reopens in a new events file)."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from supervisor_helpers import (
    CHECKPOINT,
    START,
    STOP,
    Counter,
    Trainer,
    accumulator,
    checkpoint_steps,
    event_files,
    read_events,
    scalars,
    session_logs,
    wait_for_checkpoint,
    wait_until,
)

from torchsupervisor import (
    CheckpointReader,
    GlobalStep,
    Graph,
    Saver,
    Session,
    Supervisor,
    basic_train_loop,
    get_checkpoint_mtimes,
)
from torchsupervisor.checkpoint.recovery import scan_checkpoints
from torchsupervisor.errors import AbortedError


def _supervisor(logdir, state, **kwargs):
    """A Supervisor on its own graph, as a restarted program would have."""
    kwargs.setdefault("save_summaries_secs", 3600)
    kwargs.setdefault("save_model_secs", 3600)
    return Supervisor(graph=Graph(), logdir=str(logdir), state=state, **kwargs)


def _starts(events):
    return [step for step, status, _ in session_logs(events) if status == START]


def test_restart_restores_weights_and_step_and_starts_at_that_step(tmp_path):
    first = Trainer(seed=1)
    sv = _supervisor(tmp_path, first.state)
    with sv.managed_session() as sess:
        for _ in range(4):
            sess.run(first.train_step)
    trained = first.weights()
    trained_optimizer = first.optimizer.state_dict()
    mtimes = get_checkpoint_mtimes([os.path.join(tmp_path, "model.ckpt-4")])

    second = Trainer(seed=2)
    assert not torch.equal(second.model.weight, trained["weight"])
    sv2 = _supervisor(tmp_path, second.state)
    with sv2.managed_session() as sess:
        assert sess.restored_checkpoint == os.path.join(tmp_path, "model.ckpt-4")
        assert second.global_step.value == 4
        for name, value in second.weights().items():
            assert torch.equal(value, trained[name])
        assert second.optimizer.state_dict() == trained_optimizer
        # The checkpoint service's immediate request, served at a step boundary, is skipped.
        wait_until(lambda: sess.boundary.pending, what="the checkpoint request")
        sv2.should_stop()
        assert not sess.boundary.pending
    # Nothing trained after the restore: the checkpoint at step 4 was neither rewritten nor
    # announced again.
    assert get_checkpoint_mtimes([os.path.join(tmp_path, "model.ckpt-4")]) == mtimes
    first_file, second_file = event_files(tmp_path)
    # START is written at the first step a session produces: a restart at step 4 at step 5.
    assert _starts(read_events(first_file)) == [1]
    second_logs = session_logs(read_events(second_file))
    assert [(s, st) for s, st, _ in second_logs] == [(5, START), (0, STOP)]


def test_after_a_crash_tensorboard_shows_one_continuous_series(tmp_path):
    logdir, crashed = tmp_path / "run", tmp_path / "crashed"
    first = Trainer(seed=1)
    sv = _supervisor(logdir, first.state)
    with sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        for step in range(8):
            if step == 5:
                assert sv.checkpoint() == os.path.join(logdir, "model.ckpt-5")
                at_checkpoint = first.weights()
            sv.summary_writer.add_scalar("loss", 100.0 + step, global_step=step)
            sess.run(first.train_step)
        sv.summary_writer.flush()
        # A crash now leaves exactly this on disk: the checkpoints of steps 0 and 5, and an
        # events file with points up to step 7 and no STOP. (A process crash keeps what was
        # handed to the OS; flush() makes the writer hand over what it holds.)
        shutil.copytree(logdir, crashed)
    assert checkpoint_steps(crashed) == [0, 5]
    (crashed_file,) = event_files(crashed)
    assert STOP not in [st for _, st, _ in session_logs(read_events(crashed_file))]

    second = Trainer(seed=2)
    sv2 = _supervisor(crashed, second.state)
    with sv2.managed_session() as sess:
        assert second.global_step.value == 5
        for name, value in second.weights().items():
            assert torch.equal(value, at_checkpoint[name])
        for step in range(5, 10):
            sv2.summary_writer.add_scalar("loss", 200.0 + step, global_step=step)
            sess.run(second.train_step)

    files = event_files(crashed)
    assert len(files) == 2 and files[0] == crashed_file  # name order = creation order
    assert _starts(read_events(files[1])) == [6]
    # Read raw, the stale points of steps 5-7 are gone from the first file (the restart
    # removed them: TensorBoard's default loader ignores START) ...
    raw = [s for path in files for s, _ in scalars(read_events(path), "loss")]
    assert raw == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert scalars(read_events(files[1]), "torchsupervisor/steps_lost") == [(5, 2.0)]
    # ... and TensorBoard shows the run continuing at step 5.
    series = [(s.step, s.value) for s in accumulator(crashed).Scalars("loss")]
    assert series == [(s, 100.0 + s) for s in range(5)] + [(s, 200.0 + s) for s in range(5, 10)]


class Backbone(torch.nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.backbone = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, classes)

    def forward(self, x):
        return self.head(torch.relu(self.backbone(x)))


def test_init_fn_loads_a_pretrained_subset_only_when_nothing_can_be_restored(tmp_path):
    pretrained = Backbone(classes=10)
    (tmp_path / "pre").mkdir()
    pre_path = Saver().save(Session({"model": pretrained}), str(tmp_path / "pre" / "model.ckpt"))

    def run(seed):
        torch.manual_seed(seed)
        net = Backbone(classes=3)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        step = GlobalStep()
        step.bind(opt)
        # Restores only the backbone, from a checkpoint of a model with another head.
        pre_saver = Saver({"model/backbone": net.backbone})
        calls = []

        def load_pretrained(sess):
            calls.append(sess)
            pre_saver.restore(sess, pre_path)

        sv = _supervisor(
            tmp_path / "logs",
            {"model": net, "optimizer": opt, "global_step": step},
            init_fn=load_pretrained,
        )
        return net, opt, sv, calls

    net, opt, sv, calls = run(seed=1)
    head_before = net.head.weight.detach().clone()
    with sv.managed_session() as sess:
        assert calls == [sess]
        for name, value in pretrained.backbone.state_dict().items():
            assert torch.equal(net.backbone.state_dict()[name], value)
        assert torch.equal(net.head.weight, head_before)  # not in the pre-trained subset
        for _ in range(3):
            opt.zero_grad()
            net(torch.ones(2, 4)).sum().backward()
            opt.step()
    trained = {k: v.clone() for k, v in net.state_dict().items()}

    net2, _, sv2, calls2 = run(seed=2)
    with sv2.managed_session():
        assert calls2 == []  # restored from logdir: init_fn is not called
        for name, value in trained.items():
            assert torch.equal(net2.state_dict()[name], value)


def test_custom_init_local_init_and_ready_ops(tmp_path):
    def run():
        order = []
        model = torch.nn.Linear(2, 2)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))  # "uninitialized" until init_op or a restore
        step = GlobalStep()
        local = {"ran": False}

        def not_initialized():
            return [n for n, p in model.named_parameters() if torch.isnan(p).any()]

        def init_op(sess, scale):
            order.append(("init_op", scale))
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(scale)

        def init_fn(sess):
            order.append("init_fn")

        def ready_for_local_init_op():
            order.append("ready_for_local_init")
            return not_initialized()

        def local_init_op(sess):
            order.append("local_init")
            local["ran"] = True

        def ready_op():
            order.append("ready")
            return not_initialized() + ([] if local["ran"] else ["local"])

        sv = _supervisor(
            tmp_path,
            {"model": model, "global_step": step},
            init_op=init_op,
            init_feed_dict={"scale": 0.5},
            init_fn=init_fn,
            local_init_op=local_init_op,
            ready_op=ready_op,
            ready_for_local_init_op=ready_for_local_init_op,
        )
        return sv, model, step, order

    sv, model, step, order = run()
    with sv.managed_session():
        assert order == [("init_op", 0.5), "init_fn", "ready_for_local_init", "local_init", "ready"]
        assert torch.equal(model.weight, torch.full((2, 2), 0.5))
        with torch.no_grad():
            model.weight.add_(1.0)
        step.increment()

    sv2, model2, _, order2 = run()
    with sv2.managed_session():
        # Restored: no init_op, no init_fn; the local init still runs in the new session.
        assert order2 == ["ready_for_local_init", "local_init", "ready"]
        assert torch.equal(model2.weight, torch.full((2, 2), 1.5))


def test_basic_train_loop_runs_until_should_stop(tmp_path):
    c = Counter()
    sv = _supervisor(tmp_path, c.state)
    calls = []

    def train_step(sess, tag, scale=1):
        calls.append((tag, scale))
        sess.run(c.step)
        if c.global_step.value == 5:
            sv.request_stop()

    basic_train_loop(sv, train_step, args=("t",), kwargs={"scale": 2})
    assert calls == [("t", 2)] * 5
    assert checkpoint_steps(tmp_path)[-1] == 5


def test_basic_train_loop_restarts_from_the_last_checkpoint_after_an_abort(tmp_path):
    c = Counter()
    sv = _supervisor(tmp_path, c.state)
    seen = []
    aborted = []

    def train_step(sess):
        step = c.global_step.value
        seen.append(step)
        if step == 0 and not aborted:
            wait_for_checkpoint(sv, 0)
        if step == 3 and not aborted:
            sv.checkpoint()
        if step == 5 and not aborted:
            aborted.append(step)
            raise AbortedError(None, None, "preempted")
        sess.run(c.step)
        if c.global_step.value == 8:
            sv.request_stop()

    basic_train_loop(sv, train_step)
    assert seen == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]
    assert float(c.w) == 8.0  # restored to the step-3 checkpoint, then trained to 8
    assert checkpoint_steps(tmp_path) == [0, 3, 8]
    files = event_files(tmp_path)
    assert [_starts(read_events(path)) for path in files] == [[1], [4]]


def test_basic_train_loop_propagates_other_errors(tmp_path):
    sv = _supervisor(tmp_path, Counter().state)

    def train_step(sess):
        raise ValueError("not retried")

    with pytest.raises(ValueError, match="not retried"):
        basic_train_loop(sv, train_step)


def test_a_reused_supervisor_clears_its_stop_and_reopens_its_writer_in_a_new_file(tmp_path):
    c = Counter()
    sv = _supervisor(tmp_path, c.state)
    for _ in range(2):
        with sv.managed_session() as sess:
            assert not sv.should_stop()
            sess.run(c.step)
            sess.run(c.step)
        assert sv.should_stop()
    files = event_files(tmp_path)
    assert len(files) == 2  # distinct names even when both sessions ran within one second
    first, second = (session_logs(read_events(path)) for path in files)
    assert [(s, st) for s, st, _ in first if st != CHECKPOINT] == [(1, START), (0, STOP)]
    assert [(s, st) for s, st, _ in second if st != CHECKPOINT] == [(3, START), (0, STOP)]
    assert checkpoint_steps(tmp_path)[-1] == 4


def test_without_closing_the_writer_sessions_share_one_events_file(tmp_path):
    c = Counter()
    sv = _supervisor(tmp_path, c.state)
    try:
        for _ in range(2):
            with sv.managed_session(close_summary_writer=False) as sess:
                sess.run(c.step)
        sv.summary_writer.add_scalar("after", 1.0, global_step=2)
    finally:
        sv.summary_writer.close()
    (path,) = event_files(tmp_path)
    events = read_events(path)
    assert _starts(events) == [1, 2]
    assert STOP not in [st for _, st, _ in session_logs(events)]
    assert scalars(events, "after") == [(2, 1.0)]


def test_restart_skips_a_corrupt_newest_checkpoint_for_the_newest_valid_one(tmp_path, caplog):
    first = Counter()
    sv = _supervisor(tmp_path, first.state)
    with sv.managed_session() as sess:
        for _ in range(2):
            sess.run(first.step)
        sv.checkpoint()
        for _ in range(2):
            sess.run(first.step)
    newest = os.path.join(tmp_path, "model.ckpt-4")
    data = newest + ".data-00000-of-00001"
    with open(data, "r+b") as f:  # flip one bit of the payload
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte ^ 0x01]))

    second = Counter()
    sv2 = _supervisor(tmp_path, second.state)
    caplog.set_level(logging.WARNING, logger="torchsupervisor")
    with sv2.managed_session() as sess:
        assert sess.restored_checkpoint == os.path.join(tmp_path, "model.ckpt-2")
        assert second.global_step.value == 2 and float(second.w) == 2.0
    assert any(newest in m for m in caplog.messages), caplog.messages
    assert _starts(read_events(event_files(tmp_path)[-1])) == [3]


def test_restart_removes_what_an_interrupted_save_left(tmp_path):
    first = Counter()
    sv = _supervisor(tmp_path, first.state)
    with sv.managed_session() as sess:
        sess.run(first.step)
    leftovers = [
        "model.ckpt-7.data-00000-of-00001",  # shards written, index never committed
        "model.ckpt-8.index.tmp" + "0123456789abcdef" * 2,
        "checkpoint.tmp" + "f" * 32,
    ]
    for name in leftovers:
        (tmp_path / name).write_bytes(b"partial")

    second = Counter()
    with _supervisor(tmp_path, second.state).managed_session():
        assert second.global_step.value == 1
        for name in leftovers:
            assert not (tmp_path / name).exists(), name
    assert 7 not in checkpoint_steps(tmp_path)


def test_a_damaged_file_that_incremental_checkpoints_share_costs_one_chain(tmp_path, caplog):
    """A frozen backbone is written once per chain of incremental checkpoints; flipping a
    byte of that copy breaks the chain, and the restart resumes from an older chain."""

    def make_state(seed):
        torch.manual_seed(seed)
        backbone = torch.nn.Linear(64, 256).requires_grad_(False)
        head = torch.nn.Linear(256, 1)
        optimizer = torch.optim.SGD(head.parameters(), lr=0.01)
        step = GlobalStep()
        step.bind(optimizer)
        return {"backbone": backbone, "head": head, "optimizer": optimizer, "global_step": step}

    state = make_state(0)
    x = torch.randn(8, 64)

    def train():
        state["optimizer"].zero_grad()
        state["head"](state["backbone"](x)).pow(2).mean().backward()
        state["optimizer"].step()

    sv = _supervisor(tmp_path, state)
    with sv.managed_session() as sess:
        for _ in range(4):
            for _ in range(10):
                sess.run(train)
            sv.checkpoint()
    kept = scan_checkpoints(str(tmp_path))  # Newest first.
    reads = {p: {s.file for s in CheckpointReader(p).manifest.shards} for p in kept}
    newest = CheckpointReader(kept[0]).manifest
    entry = newest.tensors["backbone/weight"]
    shard = newest.shards[entry.shard]
    assert shard.file not in os.path.basename(kept[0])  # Referenced: an incremental save.
    with open(os.path.join(tmp_path, shard.file), "r+b") as f:
        f.seek(shard.data_offset + entry.begin + 5)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x04]))
    expected = next(p for p in kept if shard.file not in reads[p])

    fresh = make_state(1)
    caplog.set_level(logging.WARNING, logger="torchsupervisor")
    with _supervisor(tmp_path, fresh).managed_session() as sess:
        assert sess.restored_checkpoint == expected
        step = fresh["global_step"].value
    assert step == CheckpointReader(expected).global_step
    assert torch.equal(fresh["backbone"].weight, state["backbone"].weight)
    assert any(shard.file in m and "corrupt" in m for m in caplog.messages), caplog.messages


def _noisy_run(logdir, until: int, request_at: int | None = None):
    """The issue's loop: a random draw between should_stop() and sess.run(fn); with
    ``request_at``, the timer's checkpoint request arrives just then at that step (between
    the two calls). Returns the final weight and the logdir copied once a checkpoint after
    the request committed (what a SIGKILL then leaves)."""
    torch.manual_seed(0)
    w = torch.zeros(3)
    step = GlobalStep()
    sv = _supervisor(logdir, {"w": w, "global_step": step})
    copied = None
    with sv.managed_session() as sess:
        wait_for_checkpoint(sv, 0)
        while not sv.should_stop() and step.value < until:
            noise = torch.randn(3)  # A batch drawn between the two calls.
            if step.value == request_at:
                sv.checkpoint_driver.request(sess)
            sess.run(lambda noise=noise: (w.add_(noise), step.increment()))
            if request_at is not None and copied is None and step.value > request_at + 1:
                sv.checkpoint_driver.wait()
                copied = str(logdir) + "-killed"
                shutil.copytree(logdir, copied)
    return w.clone(), copied


def test_a_draw_between_should_stop_and_run_replays_exactly_after_a_kill(tmp_path):
    # The snapshot is taken where the loop asks should_stop(), not at the entry of the run
    # that follows: a checkpoint never holds a draw without the step that used it (5 of 5
    # resumes diverged).
    uninterrupted, _ = _noisy_run(tmp_path / "a", 10)
    _, killed = _noisy_run(tmp_path / "b", 10, request_at=5)
    resumed, _ = _noisy_run(killed, 10)
    assert torch.equal(resumed, uninterrupted)
