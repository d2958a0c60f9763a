"""SessionManager: TF's prepare / recover / wait semantics and texts."""

from __future__ import annotations

import logging

import pytest
import torch

from torchsupervisor import GlobalStep, Saver, Session, SessionManager
from torchsupervisor.errors import DeadlineExceededError, FailedPreconditionError


class Flags:
    """A state whose readiness the test controls: ready_op lists the names not yet set."""

    def __init__(self, *names):
        self.names = set(names)
        self.done = set()

    def ready_op(self):
        return sorted(self.names - self.done)


def test_nothing_to_initialize_with():
    sm = SessionManager(state={"w": torch.zeros(1)})
    with pytest.raises(
        RuntimeError, match="Model is not initialized and no init_op or init_fn or local_init_op"
    ):
        sm.prepare_session()


def test_init_op_then_init_fn_then_local_init_then_ready(tmp_path):
    order = []
    flags = Flags("w")

    def local_init(sess):
        order.append(("local", isinstance(sess, Session)))

    def init_op():
        order.append("init_op")

    def init_fn(sess):
        order.append("init_fn")
        flags.done.add("w")

    sm = SessionManager(local_init_op=local_init, ready_op=flags.ready_op, state={})
    sess = sm.prepare_session(init_op=init_op, init_fn=init_fn)
    assert order == ["init_op", "init_fn", ("local", True)]
    assert sess.restored_checkpoint is None


def test_not_ready_after_init_uses_tf_text():
    flags = Flags("a", "b")
    sm = SessionManager(ready_op=flags.ready_op)

    def my_init():
        pass

    with pytest.raises(
        RuntimeError,
        match=r"Init operations did not make model ready\.  Init op: my_init, init fn: None, "
        r"local_init_op: None, error: Variables not initialized: a, b",
    ):
        sm.prepare_session(init_op=my_init)


def test_not_ready_for_local_init():
    flags = Flags("x")
    sm = SessionManager(local_init_op=lambda: None, ready_for_local_init_op=flags.ready_op)
    with pytest.raises(
        RuntimeError,
        match=r"did not make model ready for local_init\.  Init op: None, init fn: .*"
        r"error: Variables not initialized: x",
    ):
        sm.prepare_session(init_fn=lambda sess: None)


def test_ready_for_local_init_needs_local_init():
    with pytest.raises(ValueError, match="you must also pass a local_init_op , ready_for_local"):
        SessionManager(ready_for_local_init_op=lambda: [])


def test_failed_precondition_from_ready_op():
    def uninitialized():
        raise FailedPreconditionError("Attempting to use uninitialized value w")

    def other():
        raise FailedPreconditionError("disk on fire")

    sm = SessionManager(ready_op=uninitialized)
    with pytest.raises(RuntimeError, match="Attempting to use uninitialized value w"):
        sm.prepare_session(init_op=lambda: None)
    with pytest.raises(FailedPreconditionError, match="disk on fire"):
        SessionManager(ready_op=other).prepare_session(init_op=lambda: None)


def test_restore_skips_init(tmp_path):
    gs = GlobalStep(42)
    Saver().save(Session({"global_step": gs}), str(tmp_path / "model.ckpt"), global_step=gs)
    calls = []
    state = {"global_step": GlobalStep()}
    sm = SessionManager(state=state)
    sess = sm.prepare_session(
        init_op=lambda: calls.append("init"),
        init_fn=lambda s: calls.append("fn"),
        saver=Saver(),
        checkpoint_dir=str(tmp_path),
    )
    assert calls == [] and state["global_step"].value == 42
    assert sess.restored_checkpoint == str(tmp_path / "model.ckpt-42")
    with pytest.raises(ValueError, match="Can not provide both checkpoint_dir and checkpoint_file"):
        sm.prepare_session(saver=Saver(), checkpoint_dir="x", checkpoint_filename_with_path="y")
    sess = sm.prepare_session(
        saver=Saver(), checkpoint_filename_with_path=str(tmp_path / "model.ckpt-42")
    )
    assert sess.restored_checkpoint == str(tmp_path / "model.ckpt-42")


def test_restore_teaches_the_saver_existing_checkpoints(tmp_path):
    saver = Saver(max_to_keep=2)
    sess = Session({"w": torch.zeros(1)})
    paths = [saver.save(sess, str(tmp_path / "model.ckpt"), global_step=i) for i in range(2)]
    fresh = Saver(max_to_keep=2)
    SessionManager(state={"w": torch.zeros(1)}).prepare_session(
        saver=fresh, checkpoint_dir=str(tmp_path)
    )
    assert fresh.last_checkpoints == paths


def test_wait_for_checkpoint_polls(tmp_path, fake_clock):
    sm = SessionManager(state={"w": torch.zeros(1)}, recovery_wait_secs=5, clock=fake_clock)
    sess = sm.prepare_session(
        init_op=lambda: None,
        saver=Saver(),
        checkpoint_dir=str(tmp_path),
        wait_for_checkpoint=True,
        max_wait_secs=12,
    )
    assert sess.restored_checkpoint is None and fake_clock.sleeps == [5, 5, 5]


def test_recover_session(tmp_path, caplog):
    sm = SessionManager(state={"w": torch.zeros(1)}, local_init_op=lambda: None)
    sess, initialized = sm.recover_session(saver=Saver(), checkpoint_dir=str(tmp_path))
    assert not initialized and sess.restored_checkpoint is None
    Saver().save(Session({"w": torch.ones(1)}), str(tmp_path / "m"))
    with caplog.at_level(logging.INFO, "torchsupervisor"):
        sess, initialized = sm.recover_session(saver=Saver(), checkpoint_dir=str(tmp_path))
    assert initialized and "Restored model from" in caplog.text
    assert sess.restored_checkpoint == str(tmp_path / "m")
    flags = Flags("z")
    sm = SessionManager(state={"w": torch.zeros(1)}, ready_op=flags.ready_op)
    with caplog.at_level(logging.INFO, "torchsupervisor"):
        _, initialized = sm.recover_session(saver=Saver(), checkpoint_dir=str(tmp_path))
    assert (
        not initialized and "did not make model ready: Variables not initialized: z" in caplog.text
    )


def test_wait_for_session_until_ready(fake_clock):
    flags = Flags("w")
    attempts = []

    def ready_op():
        attempts.append(fake_clock.monotonic())
        if len(attempts) == 3:
            flags.done.add("w")
        return flags.ready_op()

    sm = SessionManager(ready_op=ready_op, recovery_wait_secs=1, clock=fake_clock)
    sess = sm.wait_for_session(max_wait_secs=10)
    assert not sess.closed and attempts == [1000.0, 1001.0, 1002.0]


def test_wait_for_session_deadline(fake_clock):
    sm = SessionManager(ready_op=Flags("w").ready_op, recovery_wait_secs=1, clock=fake_clock)
    with pytest.raises(
        DeadlineExceededError, match=r"Session was not ready after waiting 3 secs\."
    ):
        sm.wait_for_session(max_wait_secs=3)
    assert fake_clock.sleeps == [1, 1, 1]
