"""Progress and ProgressHook: a tqdm line on a terminal, log lines elsewhere, on a fake clock."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from monitored_helpers import Counter

import torchsupervisor as ts
from torchsupervisor.hooks import Progress, ProgressHook
from torchsupervisor.monitored.creators import ChiefSessionCreator
from torchsupervisor.monitored.session import MonitoredSession


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Driver:
    last_commit_time: float | None = None


def test_off_a_terminal_the_facts_are_logged_every_log_every_secs(fake_clock, caplog):
    driver = _Driver()
    progress = Progress(
        1000,
        stream=io.StringIO(),
        log_every_secs=30,
        checkpoint_driver=driver,
        checkpoint_every_secs=10,
        clock=fake_clock,
    )
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        progress.update(0)
        fake_clock.advance(10)
        progress.update(100, loss=torch.tensor(0.5))  # Not yet time: nothing logged.
        driver.last_commit_time = fake_clock.monotonic()
        fake_clock.advance(21)
        progress.update(310)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "step 0/1000",
        "step 310/1000  10.0 steps/s  loss 0.5  ETA 1m09s  checkpoint 21s ago, 11s overdue",
    ]


def test_off_a_terminal_without_logging_set_up_the_line_is_printed(fake_clock, caplog):
    # A batch job logging to a file showed no progress at all: INFO logging is off by default.
    out = io.StringIO()
    progress = Progress(1000, stream=out, log_every_secs=30, clock=fake_clock)
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        progress.update(0)
        fake_clock.advance(30)
        progress.update(300)
    assert out.getvalue() == "step 0/1000\nstep 300/1000  10.0 steps/s  ETA 1m10s\n"


def test_a_loss_that_requires_grad_shows_without_a_torch_warning(recwarn):
    # The quickstart's progress.update(step.value, loss) warned at every redraw.
    loss = (torch.ones(3, requires_grad=True) * 0.5).sum()
    progress = Progress(10, stream=io.StringIO())
    progress.update(1, loss)
    assert "loss 1.5" in progress.describe(1)
    assert [str(w.message) for w in recwarn] == []


def test_on_a_terminal_a_tqdm_bar_is_redrawn_at_most_every_refresh_secs(fake_clock):
    out = _Terminal()
    progress = Progress(10, stream=out, refresh_secs=1.0, clock=fake_clock)
    progress.update(0)
    for step in range(1, 6):
        fake_clock.advance(0.5)
        progress.update(step, loss=lambda: 0.25)
    text = out.getvalue()
    assert "step 4/10  2.0 steps/s  loss 0.25  ETA 3s" in text  # Drawn at t=2.0 (step 4).
    assert "step 5/10" not in text  # t=2.5: within refresh_secs of the last redraw.
    assert "%|" in text  # tqdm's bar.
    progress.close()
    assert "step 5/10" in out.getvalue()  # The last step, drawn at the end.


def test_without_a_total_there_is_no_eta():
    progress = Progress(None, stream=io.StringIO())
    assert progress.describe(7) == "step 7"


def test_bad_intervals_are_refused():
    with pytest.raises(ValueError, match="log_every_secs"):
        Progress(log_every_secs=0)


def test_the_hook_shows_a_monitored_session(fake_clock):
    counter, out = Counter(), _Terminal()
    hook = ProgressHook(20, loss=lambda: counter.w, stream=out, refresh_secs=0.0, clock=fake_clock)
    with MonitoredSession(ChiefSessionCreator(state=counter.state), hooks=[hook]) as sess:
        for _ in range(20):
            fake_clock.advance(0.1)
            sess.run(counter.step)
    text = out.getvalue()
    assert "step 20/20  10.0 steps/s  loss 20" in text


def test_a_supervisor_s_checkpoints_are_shown(tmp_path):
    step = ts.GlobalStep()
    sv = ts.Supervisor(
        logdir=str(tmp_path),
        state={"w": torch.zeros(1), "global_step": step},
        save_model_secs=3600,
        save_summaries_secs=0,
    )
    progress = Progress.for_supervisor(sv, 100, stream=io.StringIO())
    assert progress.describe(0) == "step 0/100"  # Before the session: no driver yet.
    with sv.managed_session():
        sv.checkpoint()  # Commits step 0 and waits for it.
        assert "checkpoint 0s ago, next in 1h00m" in progress.describe(0)


def test_on_a_terminal_no_stray_comma_and_warnings_print_above_the_bar(fake_clock, monkeypatch):
    # The bar read "... 30%|###   | , step 3/10" (tqdm's postfix) and a warning logged while
    # it was drawn was glued to its line (Python's last-resort handler on stderr).
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # Nobody set up logging.
    out = _Terminal()
    progress = Progress(10, stream=out, refresh_secs=0, clock=fake_clock)
    progress.update(3)
    logging.getLogger("torchsupervisor").warning("a warning of the library")
    fake_clock.advance(1.0)
    progress.update(4)
    progress.close()
    lines = out.getvalue().replace("\r", "\n").split("\n")
    assert "a warning of the library" in lines  # A line of its own.
    assert any(line.endswith("| step 4/10  1.0 steps/s  ETA 6s") for line in lines), lines
    assert not any("| ," in line for line in lines)
    assert logging.getLogger("torchsupervisor").handlers == []  # Removed with the bar.
