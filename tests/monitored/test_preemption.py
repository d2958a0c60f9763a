"""MonitoredTrainingSession under preemption: signals stop training cleanly with a final
checkpoint, handlers are restored, the RNG state is saved so that a resumed run is exact."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

import pytest
import repo_paths
import torch
from monitored_helpers import JOIN_SECS, Counter, RecordingHook, gated_storage, slow_storage
from supervisor_helpers import checkpoint_steps, read_checkpoint

from torchsupervisor import GlobalStep, Saver, latest_checkpoint
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.core.rng import RNGState
from torchsupervisor.hooks import CheckpointSaverHook, SessionRunHook, StopAtStepHook
from torchsupervisor.monitored.scaffold import Scaffold
from torchsupervisor.monitored.session import SingularMonitoredSession
from torchsupervisor.monitored.training_session import MonitoredTrainingSession
from torchsupervisor.storage import is_temporary_name
from torchsupervisor.testing import FakeClock, hooks_of, raw_session_of

WORKER = repo_paths.worker("monitored_preemption_worker.py")
STEPS = 60
DEADLINE_SECS = 120

# ------------------------------------------------------------------------- in-process signals


def test_handlers_are_installed_and_restored():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    sess = MonitoredTrainingSession(state=Counter().state)
    assert signal.getsignal(signal.SIGTERM) not in (before[0], signal.SIG_DFL)
    assert signal.getsignal(signal.SIGUSR1) not in (before[1], signal.SIG_DFL)
    sess.close()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before
    with MonitoredTrainingSession(state=Counter().state, preemption_signals=()):
        assert signal.getsignal(signal.SIGTERM) == before[0]


class FailingBegin(SessionRunHook):
    def begin(self):
        raise KeyError("hook misconfigured")


def test_handlers_are_restored_when_construction_fails():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyError, match="hook misconfigured"):
        MonitoredTrainingSession(state=Counter().state, hooks=[FailingBegin()])
    assert signal.getsignal(signal.SIGTERM) == before


def test_handlers_are_installed_only_from_the_main_thread(caplog):
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def train():
        with MonitoredTrainingSession(state=Counter().state):
            seen.append(signal.getsignal(signal.SIGTERM))

    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        thread = threading.Thread(target=train)
        thread.start()
        thread.join(JOIN_SECS)
    assert seen == [before]
    assert "not started on the main thread" in caplog.text


def test_a_signal_stops_training_with_a_final_checkpoint(tmp_path, caplog):
    counter = Counter()
    hook = RecordingHook()
    with (
        caplog.at_level(logging.WARNING, logger="torchsupervisor"),
        MonitoredTrainingSession(
            checkpoint_dir=str(tmp_path), state=counter.state, hooks=[hook]
        ) as sess,
    ):
        for _ in range(3):
            sess.run(counter.step)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # A second signal changes nothing.
        assert sess.should_stop()
        assert sess.preempted == "SIGUSR1"
        sess.run(counter.step)  # The session stays usable until the block is left.
    assert "Received SIGUSR1: stopping at step 3" in caplog.text
    assert hook.names()[-1] == "end"
    assert checkpoint_steps(tmp_path) == [0, 4]  # The final checkpoint, at the current step.
    assert float(read_checkpoint(tmp_path / "model.ckpt-4")["w"]) == 4.0


@pytest.mark.parametrize("session_type", ["training", "singular"])
def test_the_requeue_exit_code_comes_after_everything_is_saved(tmp_path, session_type):
    before = signal.getsignal(signal.SIGTERM)
    counter = Counter()
    if session_type == "training":
        sess = MonitoredTrainingSession(
            checkpoint_dir=str(tmp_path), state=counter.state, preemption_exit_code=75
        )
    else:
        hook = CheckpointSaverHook(str(tmp_path), save_secs=3600, saver=Saver())
        sess = SingularMonitoredSession(hooks=[hook], state=counter.state, preemption_exit_code=75)
    with pytest.raises(SystemExit) as leaving, sess:
        sess.run(counter.step)
        os.kill(os.getpid(), signal.SIGTERM)
        while not sess.should_stop():
            sess.run(counter.step)
    assert leaving.value.code == 75
    assert sess.graph is None  # Closed before SystemExit was raised.
    assert checkpoint_steps(tmp_path) == [0, 1]
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_final_checkpoint_that_cannot_finish_in_the_grace_period_is_abandoned(tmp_path, caplog):
    counter = Counter()
    # The final save (step 1) is held at its first file until the test opens the gate; the
    # grace period passes on a fake clock, in no real time.
    storage, gate = gated_storage("open", path_contains="model.ckpt-1.")
    saver = Saver(storage=storage)
    try:
        with (
            caplog.at_level(logging.WARNING, logger="torchsupervisor"),
            pytest.raises(SystemExit) as leaving,  # Work was lost: never a clean exit.
            MonitoredTrainingSession(
                checkpoint_dir=str(tmp_path),
                scaffold=Scaffold(saver=saver),
                state=counter.state,
                preemption_grace_secs=30,
                clock=FakeClock(),
            ) as sess,
        ):
            hooks_of(sess)[-1].wait_for_save()  # Step 0 is committed.
            sess.run(counter.step)
            os.kill(os.getpid(), signal.SIGTERM)
            assert sess.should_stop()
        assert not gate.opened.is_set()  # Abandoned while it could not finish.
    finally:
        gate.open()
    assert leaving.value.code == 1
    assert (
        "The final checkpoint at step 1 could not be written within the 30 s left of the grace "
        "period: abandoned" in caplog.text
    )
    assert (
        "Stopped by SIGTERM at step 1 but the final checkpoint failed (not written within the "
        f"grace period: 30 s were left); the last committed checkpoint is step 0 "
        f"({tmp_path / 'model.ckpt-0'}); 1 step will be redone"
    ) in caplog.text
    assert saver.wait(JOIN_SECS)  # The cancelled write ends at its next stage...
    assert valid_checkpoints(tmp_path) == [0]  # ... committing nothing, leaving no file.
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "model.ckpt-0")


def test_ctrl_c_stops_gracefully_and_a_second_one_aborts(tmp_path, caplog):
    counter = Counter()
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        with MonitoredTrainingSession(checkpoint_dir=str(tmp_path), state=counter.state) as sess:
            sess.run(counter.step)
            os.kill(os.getpid(), signal.SIGINT)  # Default preemption signals: Ctrl-C too.
            assert sess.should_stop()
        assert checkpoint_steps(tmp_path) == [0, 1]
        assert "Received SIGINT: stopping at step 1" in caplog.text
        assert "(press Ctrl-C again to abort at once)" in caplog.text
        other = Counter()
        with (
            pytest.raises(KeyboardInterrupt),
            MonitoredTrainingSession(
                checkpoint_dir=str(tmp_path / "abort"), state=other.state
            ) as sess,
        ):
            hooks_of(sess)[-1].wait_for_save()  # Step 0 is committed.
            sess.run(other.step)
            os.kill(os.getpid(), signal.SIGINT)
            assert sess.should_stop()
            os.kill(os.getpid(), signal.SIGINT)  # Raises KeyboardInterrupt here.
            sess.run(other.step)
    assert checkpoint_steps(tmp_path / "abort") == [0]  # No final checkpoint: aborted.


def test_the_grace_period_applies_only_after_a_signal(tmp_path):
    counter = Counter()
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path),
        scaffold=Scaffold(saver=Saver(storage=slow_storage(0.1))),
        state=counter.state,
        preemption_grace_secs=0.01,
    ) as sess:
        sess.run(counter.step)
    assert valid_checkpoints(tmp_path) == [0, 1]  # The final save took what it needed.


def test_no_exit_code_without_a_signal_nor_when_the_block_raised(tmp_path):
    counter = Counter()
    with MonitoredTrainingSession(state=counter.state, preemption_exit_code=75) as sess:
        sess.run(counter.step)
    with (
        pytest.raises(ValueError, match="body"),
        MonitoredTrainingSession(state=counter.state, preemption_exit_code=75) as sess,
    ):
        os.kill(os.getpid(), signal.SIGTERM)
        assert sess.should_stop()
        raise ValueError("body")


# ----------------------------------------------------------------------------------- RNG state


class DropoutTrainer:
    """An MLP with dropout trained on fixed batches chosen by the global step."""

    def __init__(self) -> None:
        data = torch.Generator().manual_seed(1234)
        self.x = torch.randn(64, 8, generator=data)
        self.y = torch.randn(64, 1, generator=data)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.global_step = GlobalStep()
        self.global_step.bind(self.optimizer)
        self.losses: dict[int, float] = {}

    @property
    def state(self) -> dict:
        return {"model": self.model, "optimizer": self.optimizer, "global_step": self.global_step}

    def step(self) -> dict:
        start = self.global_step.value % 8 * 8
        self.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(
            self.model(self.x[start : start + 8]), self.y[start : start + 8]
        )
        loss.backward()
        self.losses[self.global_step.value] = loss.item()
        self.optimizer.step()
        return {"loss": loss}


def train(logdir, last_step, **kwargs) -> DropoutTrainer:
    trainer = DropoutTrainer()
    with MonitoredTrainingSession(
        checkpoint_dir=str(logdir),
        state=trainer.state,
        hooks=[StopAtStepHook(last_step=last_step)],
        save_checkpoint_steps=4,
        save_summaries_steps=0,
        log_step_count_steps=0,
        **kwargs,
    ) as sess:
        while not sess.should_stop():
            sess.run(trainer.step)
    return trainer


@pytest.mark.parametrize("save_rng_state", [True, False])
def test_a_resumed_run_continues_bitwise_with_the_rng_state(tmp_path, save_rng_state):
    torch.manual_seed(0)
    reference = train(tmp_path / "reference", 12, save_rng_state=save_rng_state)
    torch.manual_seed(0)
    first = train(tmp_path / "run", 5, save_rng_state=save_rng_state)
    torch.manual_seed(999)  # Whatever the process drew since: the checkpoint decides.
    resumed = train(tmp_path / "run", 12, save_rng_state=save_rng_state)
    assert resumed.global_step.value == 12
    losses = {**first.losses, **resumed.losses}
    same = all(
        torch.equal(a, b)
        for a, b in zip(reference.model.state_dict().values(), resumed.model.state_dict().values())
    )
    if save_rng_state:
        assert losses == reference.losses  # Every loss, bitwise.
        assert same
        assert "rng" in read_checkpoint(tmp_path / "run" / "model.ckpt-5")
    else:
        assert losses != reference.losses  # Other dropout masks after the resume.
        assert not same
        assert "rng" not in read_checkpoint(tmp_path / "run" / "model.ckpt-5")


def test_rng_state_goes_into_the_given_or_the_scaffold_state(tmp_path):
    state = Counter().state
    with MonitoredTrainingSession(state=state) as sess:
        assert isinstance(raw_session_of(sess).state["rng"], RNGState)
    assert "rng" not in state  # The caller's mapping is not changed.
    scaffold = Scaffold(state=Counter().state)
    with MonitoredTrainingSession(scaffold=scaffold) as sess:
        assert raw_session_of(sess).state["rng"] is scaffold.state["rng"]
    own = RNGState()
    with MonitoredTrainingSession(state={**Counter().state, "rng": own}) as sess:
        assert raw_session_of(sess).state["rng"] is own


def test_a_checkpoint_without_rng_state_still_restores(tmp_path, caplog):
    counter = Counter()
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path), state=counter.state, save_rng_state=False
    ) as sess:
        sess.run(counter.step)
    resumed = Counter()
    with (
        caplog.at_level(logging.WARNING, logger="torchsupervisor"),
        MonitoredTrainingSession(checkpoint_dir=str(tmp_path), state=resumed.state) as sess,
    ):
        assert resumed.global_step.value == 1
        sess.run(resumed.step)
    assert "has no 'rng' entry" in caplog.text
    assert "rng" in read_checkpoint(tmp_path / "model.ckpt-2")


def test_an_explicit_saver_is_also_told_the_rng_entry_is_optional(tmp_path):
    counter = Counter()
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path), state=counter.state, save_rng_state=False
    ) as sess:
        sess.run(counter.step)
    resumed = Counter()
    scaffold = Scaffold(saver=Saver())
    with MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path), scaffold=scaffold, state=resumed.state
    ):
        assert resumed.global_step.value == 1


# ------------------------------------------------------------------------ subprocess signals

# Each scenario's worker: (log directory name, options). The workers are started together
# when the first test needs one, and wait for "go" on stdin before they create their session:
# the seconds spent importing torch overlap instead of adding up.
SCENARIOS = {
    # A save every 2 steps, each fsync 30 ms: a save is almost always being written.
    "interrupted": ("run", ("--save-steps", "2", "--slow-fsync", "0.03", "--step-delay", "0.005")),
    "resumed": ("run", ()),
    "startup": ("startup", ("--slow-start", "1.0")),
    "requeue": ("requeue", ("--exit-code", "75", "--step-delay", "0.01")),
}


class Worker:
    def __init__(self, logdir, args):
        self.logdir = logdir
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, str(logdir), str(STEPS), "--wait-go", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []

    def go(self):
        self.read_until("LOADED")
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def read_until(self, prefix):
        while True:
            line = self.proc.stdout.readline()
            assert line, f"worker ended before {prefix!r}: {self.lines} {self.proc.stderr.read()}"
            self.lines.append(line.rstrip("\n"))
            if line.startswith(prefix):
                return

    def finish(self):
        """Wait for the end; return (stdout lines, stderr, exit status)."""
        out, err = self.proc.communicate(timeout=DEADLINE_SECS)
        self.lines += out.splitlines()
        return self.lines, err, self.proc.returncode


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    root = tmp_path_factory.mktemp("monitored_preemption")
    started = {name: Worker(root / logdir, args) for name, (logdir, args) in SCENARIOS.items()}
    yield started
    for worker in started.values():
        if worker.proc.poll() is None:
            worker.proc.kill()
        worker.proc.communicate(timeout=DEADLINE_SECS)


def losses(lines):
    return {int(x.split()[1]): x.split()[2] for x in lines if x.startswith("LOSS")}


def done(lines):
    (line,) = [x for x in lines if x.startswith("DONE")]
    return int(line.split()[1]), line.split()[2]


def valid_checkpoints(logdir):
    steps = []
    for name in os.listdir(logdir):
        if name.endswith(".index") and not is_temporary_name(name):
            reader = CheckpointReader(os.path.join(logdir, name[: -len(".index")]))
            reader.verify()
            steps.append(reader.global_step)
    assert not [n for n in os.listdir(logdir) if is_temporary_name(n)]
    return sorted(steps)


def test_sigterm_twice_mid_training_saves_the_stop_step_and_resumes_from_it(workers):
    # (That the resumed run is bitwise the uninterrupted one is tested in-process above.)
    run, resume = workers["interrupted"], workers["resumed"]
    run.go()
    run.read_until("LOSS 10 ")
    run.proc.send_signal(signal.SIGTERM)  # Two in a row, during a background save.
    run.proc.send_signal(signal.SIGTERM)
    lines, err, code = run.finish()
    assert code == 0, err
    stopped, _ = done(lines)
    assert 10 < stopped < STEPS
    assert err.count("Received SIGTERM") == 1
    assert f"Received SIGTERM: stopping at step {stopped}" in err
    assert max(losses(lines)) == stopped - 1
    # The final checkpoint is at exactly the step where training stopped.
    assert valid_checkpoints(run.logdir)[-1] == stopped
    assert CheckpointReader(latest_checkpoint(str(run.logdir))).global_step == stopped
    resume.go()
    resumed, err, code = resume.finish()
    assert code == 0, err
    assert f"READY {stopped}" in resumed
    assert sorted(losses(resumed)) == list(range(stopped, STEPS))
    assert done(resumed)[0] == STEPS


def test_sigterm_during_startup(workers):
    worker = workers["startup"]
    worker.go()
    worker.read_until("STARTING")
    worker.proc.send_signal(signal.SIGTERM)
    lines, err, code = worker.finish()
    assert code == 0, err
    assert "READY 0" in lines and not losses(lines)
    assert "Received SIGTERM: stopping at step 0" in err
    assert done(lines)[0] == 0
    assert valid_checkpoints(worker.logdir) == [0]


def test_requeue_exit_code(workers):
    worker = workers["requeue"]
    worker.go()
    worker.read_until("LOSS 5 ")
    worker.proc.send_signal(signal.SIGUSR1)
    lines, err, code = worker.finish()
    assert code == 75, err
    assert not [x for x in lines if x.startswith("DONE")]
    assert "Received SIGUSR1" in err
    assert valid_checkpoints(worker.logdir)[-1] == max(losses(lines)) + 1
