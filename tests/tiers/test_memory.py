"""The memory tier in one process: snapshots every step, restore from the newest valid tier,
fall back past damaged, stale and foreign snapshots, free the memory at a clean end."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time

import pytest
import torch

import torchsupervisor as ts
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.cli import main as cli_main
from torchsupervisor.core.session import Session
from torchsupervisor.errors import MemoryTierFullError
from torchsupervisor.storage.slots import STAGE_PREFIX
from torchsupervisor.tiers.memory import MemoryTier, held_in_memory
from torchsupervisor.tiers.memory_root import memory_root, rank_directory


class Run:
    """A small model trained under a Supervisor with the memory tier (every step).

    No checkpoint service unless ``save_model_secs`` is given: its timer's first request is
    immediate, served at whichever step boundary follows it, and on a busy machine that may be
    the last one, whose checkpoint then frees the memory tier at the end (a clean end's rule)
    and takes the snapshots a test looks for. ``checkpoint_at`` saves on the training thread.
    """

    def __init__(self, logdir: str, base: str, **kwargs) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 4)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.step = ts.GlobalStep()
        memory = kwargs.pop("memory_tier", ts.MemoryTierConfig(root=base))
        self.sv = ts.Supervisor(
            logdir=logdir,
            state={"model": self.model, "optimizer": self.optimizer, "global_step": self.step},
            save_model_secs=kwargs.pop("save_model_secs", 0),
            save_summaries_secs=0,
            memory_tier=memory,
            **kwargs,
        )

    def train_step(self) -> None:
        loss = self.model(torch.randn(4, 8)).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.step.increment()

    def train(self, steps: int, *, fail: bool = False, checkpoint_at: int | None = None) -> dict:
        """Train ``steps`` steps; with ``fail``, end the session with an error after the
        last step's boundary (no final checkpoint). Returns the restored tier and step, and
        the weights at the end."""
        try:
            with self.sv.managed_session() as sess:
                out = {"tier": sess.restored_tier, "restored": self.step.value}
                for _ in range(steps):
                    if self.sv.should_stop():
                        break
                    sess.run(self.train_step)
                    if self.step.value == checkpoint_at:
                        self.sv.saver.save(sess, self.sv.save_path, global_step=self.step)
                self.sv.should_stop()  # The boundary after the last step: its snapshot.
                out["weight"] = self.model.weight.detach().clone()
                if fail:
                    raise RuntimeError("the run fails")
        except RuntimeError as e:
            assert str(e) == "the run fails"
        out["step"] = self.step.value
        return out


@pytest.fixture
def dirs(tmp_path):
    base = tmp_path / "shm"
    base.mkdir()
    return str(tmp_path / "logdir"), str(base)


def rank_dir(logdir: str, base: str) -> str:
    return rank_directory(memory_root(base), logdir, 0)


def snapshot_files(logdir: str, base: str) -> list[str]:
    return sorted(n for n in os.listdir(rank_dir(logdir, base)) if "model.ckpt" in n)


def test_config_checks_its_arguments():
    with pytest.raises(ValueError, match="every_n_steps"):
        ts.MemoryTierConfig(every_n_steps=0)
    with pytest.raises(ValueError, match="slots"):
        ts.MemoryTierConfig(slots=1)
    with pytest.raises(TypeError, match="slots"):
        ts.MemoryTierConfig(slots=2.5)
    with pytest.raises(ValueError, match="peer_every_secs"):
        ts.MemoryTierConfig(peer_every_secs=-1)
    with pytest.raises(TypeError, match="peer_every_secs"):
        ts.MemoryTierConfig(peer_every_secs="5")
    with pytest.raises(TypeError, match="memory_tier"):
        ts.Supervisor(state={"x": torch.zeros(1)}, memory_tier=3)


def test_a_failed_run_resumes_from_the_memory_tier_at_its_last_step(dirs):
    logdir, base = dirs
    first = Run(logdir, base).train(7, fail=True)
    assert first["step"] == 7
    # slots=2: the newest committed snapshot (and room for the one being written).
    assert snapshot_files(logdir, base) == [
        "model.ckpt-7.data-00000-of-00001",
        "model.ckpt-7.index",
    ]
    directory = rank_dir(logdir, base)
    for path in (memory_root(base), os.path.dirname(directory), directory):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    for name in os.listdir(directory):
        assert stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode) == 0o600, name
    second = Run(logdir, base).train(0)
    assert (second["tier"], second["restored"]) == ("memory", 7)
    assert torch.equal(second["weight"], first["weight"])


def test_each_snapshot_is_staged_into_its_file_and_the_slots_take_turns(dirs):
    """Two files hold the snapshots (slots=2): each step's is copied into the free one, which
    then becomes its data file by a rename; a slot file a kill left is deleted at the next
    start, never restored."""
    logdir, base = dirs
    tier = MemoryTier(ts.MemoryTierConfig(root=base), logdir, "a" * 32)
    state = {"w": torch.zeros(100_000), "global_step": ts.GlobalStep()}
    inodes = []
    for step in range(1, 6):
        state["w"].fill_(step)
        state["global_step"].assign(step)
        prefix = tier.saver.save(Session(state), tier.save_path, global_step=step)
        names = os.listdir(tier.directory)
        held = [n for n in names if ".data-" in n or n.startswith(STAGE_PREFIX)]
        assert len(held) == min(step, 2), names  # The first save makes the first slot.
        inodes.append(os.stat(prefix + ".data-00000-of-00001").st_ino)
    assert len(set(inodes)) == 2 and inodes[0::2] == [inodes[0]] * 3  # In turn, no copy.
    CheckpointReader(prefix).verify()
    tier.close()  # Without ``free``: the newest snapshot stays, the free slot goes.
    names = os.listdir(tier.directory)
    assert not [n for n in names if n.startswith(STAGE_PREFIX)]
    with open(os.path.join(tier.directory, f"{STAGE_PREFIX}killed"), "wb") as f:
        f.write(b"\x00" * 64)  # What a kill while copying leaves.
    again = MemoryTier(ts.MemoryTierConfig(root=base), logdir, "a" * 32)
    try:
        assert not [n for n in os.listdir(again.directory) if n.startswith(STAGE_PREFIX)]
        assert [s.step for s in again.snapshots()] == [5]
        restored = {"w": torch.zeros(100_000), "global_step": ts.GlobalStep()}
        again.restore(Session(restored), again.snapshots()[0].prefix)
        assert restored["w"].eq(5).all() and restored["global_step"].value == 5
    finally:
        again.close(free=True)


def test_snapshots_follow_every_n_steps_and_resume_bitwise(dirs, tmp_path):
    logdir, base = dirs
    config = ts.MemoryTierConfig(every_n_steps=3, slots=3, root=base)
    Run(logdir, base, memory_tier=config).train(8, fail=True)
    # Steps 0, 3 and 6 were taken; slots=3 keeps the two newest.
    assert [s for s in (0, 3, 6) if f"model.ckpt-{s}.index" in snapshot_files(logdir, base)] == [
        3,
        6,
    ]
    resumed = Run(logdir, base, memory_tier=config)
    out = resumed.train(4)
    assert (out["tier"], out["restored"], out["step"]) == ("memory", 6, 10)
    other = str(tmp_path / "straight")
    straight = Run(other, base, memory_tier=config).train(10)
    assert torch.equal(out["weight"], straight["weight"])


def test_a_clean_end_with_a_final_checkpoint_frees_the_memory(dirs):
    logdir, base = dirs
    Run(logdir, base, save_model_secs=3600).train(5)
    assert held_in_memory(logdir, base) == []
    assert not os.path.exists(os.path.dirname(rank_dir(logdir, base)))
    assert ts.latest_checkpoint(logdir).endswith("model.ckpt-5")


def test_without_a_final_checkpoint_the_memory_is_kept_and_nothing_is_lost(dirs, caplog):
    logdir, base = dirs
    Run(logdir, base, save_model_secs=0).train(5)  # No checkpoint on disk at all.
    assert "model.ckpt-5.index" in snapshot_files(logdir, base)
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        out = Run(logdir, base, save_model_secs=0).train(0)
    assert (out["tier"], out["restored"]) == ("memory", 5)
    assert "0 steps lost (the last run stopped at step 5)" in caplog.text


def damage(prefix: str, how: str) -> None:
    data = prefix + ".data-00000-of-00001"
    if how == "bit flip":
        with open(data, "r+b") as f:
            f.seek(os.path.getsize(data) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    elif how == "truncation":
        os.truncate(data, os.path.getsize(data) - 7)
    elif how == "missing data":
        os.unlink(data)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["bit flip", "truncation", "missing data"])
def test_a_damaged_snapshot_falls_back_to_disk_with_a_warning(dirs, caplog, how):
    logdir, base = dirs
    first = Run(logdir, base).train(7, fail=True, checkpoint_at=3)
    snapshot = os.path.join(rank_dir(logdir, base), "model.ckpt-7")
    damage(snapshot, how)
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        out = Run(logdir, base).train(1, fail=True)  # On to step 4, whose snapshot is kept.
    assert (out["tier"], out["restored"]) == ("disk", 3)
    assert not torch.equal(out["weight"], first["weight"])
    assert snapshot in caplog.text and "memory tier" in caplog.text
    # Never tried again: the restart deleted it.
    assert snapshot_files(logdir, base) == [
        "model.ckpt-4.data-00000-of-00001",
        "model.ckpt-4.index",
    ]


def test_a_slot_of_an_older_generation_is_refused(dirs, caplog):
    logdir, base = dirs
    Run(logdir, base, memory_tier=ts.MemoryTierConfig(slots=3, root=base)).train(7, fail=True)
    directory = rank_dir(logdir, base)
    # Step 6's snapshot put in the place of a newer one: its checksums all pass.
    for suffix in (".index", ".data-00000-of-00001"):
        shutil.copy(
            os.path.join(directory, "model.ckpt-6" + suffix),
            os.path.join(directory, "model.ckpt-9" + suffix),
        )
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        out = Run(logdir, base).train(1, fail=True)
    assert (out["tier"], out["restored"]) == ("memory", 7)
    assert "model.ckpt-9: its manifest is of step 6 (an older generation" in caplog.text
    assert "model.ckpt-9.index" not in snapshot_files(logdir, base)


def test_a_newer_snapshot_of_an_abandoned_timeline_is_never_restored_later(dirs):
    logdir, base = dirs
    Run(logdir, base).train(7, fail=True, checkpoint_at=3)
    damage(os.path.join(rank_dir(logdir, base), "model.ckpt-7"), "bit flip")
    out = Run(logdir, base).train(2, fail=True)  # From disk at 3, on to 5.
    assert (out["tier"], out["restored"], out["step"]) == ("disk", 3, 5)
    again = Run(logdir, base).train(0)
    assert (again["tier"], again["restored"]) == ("memory", 5)


def test_snapshots_of_a_log_directory_made_again_are_never_restored(dirs, caplog):
    logdir, base = dirs
    Run(logdir, base).train(7, fail=True)
    shutil.rmtree(logdir)
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        out = Run(logdir, base).train(0)
    assert (out["tier"], out["restored"]) == (None, 0)
    assert "holds snapshots of another run" in caplog.text


def test_a_memory_root_too_small_is_a_clear_error_at_the_start(dirs):
    logdir, base = dirs
    run = Run(logdir, base, memory_tier=ts.MemoryTierConfig(slots=10**8, root=base))
    with pytest.raises(MemoryTierFullError, match=r"needs [0-9]+ bytes") as raised:
        run.train(1)
    assert raised.value.needed_bytes > raised.value.free_bytes


def test_a_memory_root_that_does_not_exist_is_a_clear_error_naming_it(dirs):
    logdir, base = dirs
    missing = os.path.join(base, "missing")
    run = Run(logdir, base, memory_tier=ts.MemoryTierConfig(root=missing))
    with pytest.raises(FileNotFoundError, match=r"MemoryTierConfig\.root") as raised:
        run.train(1)
    assert raised.value.filename == missing
    assert not os.path.exists(missing)  # Not made: the user names a tmpfs.


def monitored(logdir: str, base: str, steps: int, *, fail: bool) -> tuple[int, torch.Tensor]:
    """Run a MonitoredTrainingSession with the memory tier for ``steps`` steps (then fail, if
    asked, after a step boundary); return the step it started at and the weight at the end."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    step = ts.GlobalStep()

    def train_step() -> None:
        model.weight.data.add_(1.0)
        step.increment()

    try:
        with ts.MonitoredTrainingSession(
            checkpoint_dir=logdir,
            state={"model": model, "global_step": step},
            save_summaries_steps=None,
            log_step_count_steps=None,
            memory_tier=ts.MemoryTierConfig(root=base),
        ) as sess:
            start = step.value
            for _ in range(steps):
                sess.run(train_step)
            sess.run(lambda: None)  # Its entry is a step boundary: the last step's snapshot.
            if fail:
                raise RuntimeError("the run fails")
    except RuntimeError as e:
        assert str(e) == "the run fails"
    return start, model.weight.detach().clone()


def test_a_monitored_training_session_resumes_from_the_memory_tier(dirs):
    logdir, base = dirs
    _, weight = monitored(logdir, base, 4, fail=True)
    start, again = monitored(logdir, base, 0, fail=False)
    assert start == 4 and torch.equal(weight, again)
    # The second session ended cleanly with a final checkpoint at step 4: memory freed.
    assert held_in_memory(logdir, base) == []


def test_ls_shows_the_memory_tier_and_which_snapshot_a_restart_uses(dirs, capsys):
    logdir, base = dirs
    Run(logdir, base).train(6, fail=True, checkpoint_at=2)
    assert cli_main(["ls", logdir, "--memory-root", base]) == 0
    out = capsys.readouterr().out
    memory_line = next(line for line in out.splitlines() if line.startswith("memory (rank 0)"))
    assert " 6 " in memory_line and "valid" in memory_line
    assert "<- a restart restores" in memory_line
    assert "from the memory tier (step 6)" in out
    assert any(line.startswith("disk") and "model.ckpt-2" in line for line in out.splitlines())
    damage(os.path.join(rank_dir(logdir, base), "model.ckpt-6"), "bit flip")
    assert cli_main(["ls", logdir, "--memory-root", base]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("A restart restores model.ckpt-2 (step 2).")
    memory_line = next(line for line in out.splitlines() if line.startswith("memory (rank 0)"))
    assert "CORRUPT" in memory_line
    CheckpointReader(os.path.join(logdir, "model.ckpt-2")).verify()


def test_a_sharded_snapshot_of_another_world_size_is_refused(dirs):
    # A sharded tier records the world size in every snapshot's origin: a restart at another
    # world size never takes a rank's local shards, whatever their shapes.
    from types import SimpleNamespace

    from torchsupervisor import MemoryTierConfig
    from torchsupervisor.tiers.memory import MemoryTier

    logdir, base = dirs
    config = MemoryTierConfig(root=base)
    written = MemoryTier(config, logdir, "r" * 32, sharded=True, world_size=2)
    assert written.slots == config.slots + 2
    state = {"w": torch.zeros(3)}
    prefix = written.saver.save(SimpleNamespace(state=state), written.save_path, global_step=5)
    assert [s.prefix for s in written.snapshots()] == [prefix]
    written.saver.close()
    other = MemoryTier(config, logdir, "r" * 32, sharded=True, world_size=4)
    assert other.snapshots() == []
    assert "'world_size': 2" in other.damaged[0] and prefix in other.damaged[0]
    other.saver.close()


def test_a_preemption_puts_the_last_step_in_memory_before_a_slow_final_checkpoint(dirs, caplog):
    # A snapshot every 50 steps, a stop at step 7 with half a second left, storage whose
    # fsync takes 3 s: the final checkpoint cannot make it, and the memory tier, asked first,
    # holds step 7: a restart on this node loses nothing.
    import signal

    from torchsupervisor.testing import FaultyStorage

    logdir, base = dirs
    slow = FaultyStorage()
    slow.delay("fsync", 3.0)
    run = Run(
        logdir,
        base,
        memory_tier=ts.MemoryTierConfig(every_n_steps=50, root=base),
        save_model_secs=3600,
        saver=ts.Saver(storage=slow),
        preemption_grace_secs=0.5,
        preemption_sources=None,
    )
    # The final checkpoint failed: the stop says so with its status (the scheduler must
    # know), though this node's memory holds the step.
    with pytest.raises(SystemExit) as stopped, run.sv.managed_session() as sess:
        for _ in range(7):
            sess.run(run.train_step)
        os.kill(os.getpid(), signal.SIGTERM)
        assert run.sv.should_stop()
    assert stopped.value.code == 1
    assert "this node's memory tier holds step 7: a restart on this node resumes there" in (
        caplog.text
    )
    assert "model.ckpt-7.index" in snapshot_files(logdir, base)
    assert ts.latest_checkpoint(logdir) is None  # Out of time: nothing on disk at all.
    out = Run(logdir, base, memory_tier=ts.MemoryTierConfig(every_n_steps=50, root=base)).train(0)
    assert (out["tier"], out["restored"]) == ("memory", 7)


def test_a_final_checkpoint_that_cannot_fit_is_not_started_once_memory_holds_the_step(dirs, caplog):
    # Every fsync takes 0.5 s: the checkpoint at step 3 (several) takes more. The stop at
    # step 7 has 1 s (less the memory tier's snapshot) left: the final checkpoint is not
    # started (the time goes to a clean exit), and the line says why and where step 7 is.
    import signal

    from torchsupervisor.testing import FaultyStorage

    logdir, base = dirs
    slow = FaultyStorage()
    slow.delay("fsync", 0.5)
    run = Run(
        logdir,
        base,
        memory_tier=ts.MemoryTierConfig(every_n_steps=50, root=base),
        save_model_secs=3600,
        saver=ts.Saver(storage=slow),
        preemption_grace_secs=1.0,
        preemption_sources=None,
    )
    with pytest.raises(SystemExit) as stopped, run.sv.managed_session() as sess:
        for _ in range(3):
            sess.run(run.train_step)
        run.sv.checkpoint()
        for _ in range(4):
            sess.run(run.train_step)
        os.kill(os.getpid(), signal.SIGTERM)
        assert run.sv.should_stop()
    assert stopped.value.code == 1
    assert "would take about" in caplog.text and "not started" in caplog.text
    assert "this node's memory tier holds step 7: a restart on this node resumes there" in (
        caplog.text
    )
    assert ts.latest_checkpoint(logdir).endswith("model.ckpt-3")
    out = Run(logdir, base, memory_tier=ts.MemoryTierConfig(every_n_steps=50, root=base)).train(0)
    assert (out["tier"], out["restored"]) == ("memory", 7)


def test_a_monitored_session_puts_the_stop_in_memory_and_skips_a_final_save_that_cannot_fit(
    dirs, caplog
):
    # MonitoredTrainingSession's first checkpoint (step 0) with fsyncs of 0.8 s takes more
    # than the 1 s a SIGTERM leaves: at the stop (step 7) the memory tier holds the step and
    # the final checkpoint is not started.
    import signal

    from torchsupervisor.testing import FaultyStorage

    logdir, base = dirs
    slow = FaultyStorage()
    slow.delay("fsync", 0.8)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    step = ts.GlobalStep()

    def train_step() -> None:
        model.weight.data.add_(1.0)
        step.increment()

    with (
        pytest.raises(SystemExit) as stopped,
        ts.MonitoredTrainingSession(
            checkpoint_dir=logdir,
            state={"model": model, "global_step": step},
            scaffold=ts.Scaffold(saver=ts.Saver(storage=slow)),
            save_summaries_steps=None,
            log_step_count_steps=None,
            memory_tier=ts.MemoryTierConfig(every_n_steps=50, root=base),
            preemption_grace_secs=1.0,
            preemption_sources=None,
        ) as sess,
    ):
        for _ in range(7):
            sess.run(train_step)
        deadline = time.monotonic() + 60
        while ts.latest_checkpoint(logdir) is None and time.monotonic() < deadline:
            time.sleep(0.05)  # Step 0's checkpoint, written in the background, commits.
        sess.run(lambda: None)  # A boundary: the driver sees it committed.
        os.kill(os.getpid(), signal.SIGTERM)
        assert sess.should_stop()
    assert stopped.value.code == 1
    assert "would take about" in caplog.text and "not started" in caplog.text
    assert "this node's memory tier holds step 7" in caplog.text
    assert ts.latest_checkpoint(logdir).endswith("model.ckpt-0")
    start, _ = monitored(logdir, base, 0, fail=False)
    assert start == 7
