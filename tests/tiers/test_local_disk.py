"""The local-disk tier: copies of the memory tier's snapshots on disk at their own interval,
restored when the node's memory is gone (a reboot), checked byte by byte, freed at a clean end.

A reboot is simulated by deleting the memory tier's file system (its tmpfs directory) between
a failed run and its restart."""

from __future__ import annotations

import logging
import os
import shutil
import stat

import pytest
import torch

import torchsupervisor as ts
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.cli import main as cli_main
from torchsupervisor.core.session import Session
from torchsupervisor.errors import MemoryTierFullError
from torchsupervisor.tiers.local_disk import LocalDiskTier
from torchsupervisor.tiers.memory import MemoryTier
from torchsupervisor.tiers.memory_root import memory_root, rank_directory

from .test_memory import Run, damage


@pytest.fixture
def dirs(tmp_path):
    base = tmp_path / "shm"
    base.mkdir()
    return str(tmp_path / "logdir"), str(base), str(tmp_path / "local")


def config(base: str, local: str, **kwargs) -> ts.MemoryTierConfig:
    kwargs.setdefault("every_secs", 0)
    kwargs.setdefault("every_n_steps", 3)
    return ts.MemoryTierConfig(root=base, local_disk=ts.LocalDiskConfig(local, **kwargs))


def local_dir(logdir: str, local: str) -> str:
    return rank_directory(memory_root(local), logdir, 0)


def copies(logdir: str, local: str) -> list[int]:
    names = os.listdir(local_dir(logdir, local))
    indexes = [n for n in names if n.endswith(".index")]
    return sorted(int(n[len("model.ckpt-") : -len(".index")]) for n in indexes)


def reboot(base: str) -> None:
    """The node's memory is gone: its tmpfs is empty again."""
    shutil.rmtree(base)
    os.mkdir(base)


def test_config_checks_its_arguments(tmp_path):
    with pytest.raises(TypeError, match="directory"):
        ts.LocalDiskConfig(None)
    with pytest.raises(ValueError, match="directory"):
        ts.LocalDiskConfig("")
    with pytest.raises(ValueError, match="every_secs"):
        ts.LocalDiskConfig(str(tmp_path), every_secs=-1)
    with pytest.raises(ValueError, match="every_n_steps"):
        ts.LocalDiskConfig(str(tmp_path), every_n_steps=-1)
    with pytest.raises(ValueError, match="keep"):
        ts.LocalDiskConfig(str(tmp_path), keep=0)
    with pytest.raises(TypeError, match="local_disk"):
        ts.MemoryTierConfig(local_disk=str(tmp_path))
    with pytest.raises(ValueError, match="every_n_steps"):
        LocalDiskTier(ts.LocalDiskConfig(str(tmp_path)), "logdir", "a" * 32, {}, sharded=True)


def test_after_a_reboot_the_run_resumes_from_the_local_disk(dirs, caplog):
    logdir, base, local = dirs
    first = Run(logdir, base, memory_tier=config(base, local)).train(10, fail=True)
    # Every 3 steps from step 0 (3, 6, 9: one still waiting when the next is due gives way to
    # it), and at the end the newest (10); two kept.
    held = copies(logdir, local)
    assert len(held) == 2 and held[0] in (3, 6, 9) and held[1] == 10, held
    directory = local_dir(logdir, local)
    for path in (memory_root(local), os.path.dirname(directory), directory):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    for name in os.listdir(directory):
        assert stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode) == 0o600, name
    CheckpointReader(os.path.join(directory, "model.ckpt-10")).verify()
    reboot(base)
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        out = Run(logdir, base, memory_tier=config(base, local)).train(0, fail=True)
    assert (out["tier"], out["restored"]) == ("local", 10)
    assert torch.equal(out["weight"], first["weight"])
    assert "Restored step 10 from the local tier" in caplog.text


def test_the_memory_tier_comes_first_at_the_same_step(dirs):
    logdir, base, local = dirs
    Run(logdir, base, memory_tier=config(base, local)).train(10, fail=True)
    out = Run(logdir, base, memory_tier=config(base, local)).train(0, fail=True)
    assert (out["tier"], out["restored"]) == ("memory", 10)


def test_copies_by_time_take_the_newest_snapshot_when_the_interval_passed(dirs):
    logdir, base, local = dirs
    # An interval longer than the run: nothing copied but the newest at the end.
    slow = config(base, local, every_secs=3600, every_n_steps=0)
    Run(logdir, base, memory_tier=slow).train(6, fail=True)
    assert copies(logdir, local) == [6]
    # No interval: every snapshot is due (one not yet begun gives way to the next); the
    # newest two are kept, the last step's among them.
    every = config(base, local, every_secs=0, every_n_steps=0)
    out = Run(logdir, base, memory_tier=every).train(3, fail=True)
    held = copies(logdir, local)
    assert out["restored"] == 6 and len(held) == 2 and held[1] == 9, held


def test_a_damaged_copy_falls_back_to_the_older_one(dirs, caplog):
    logdir, base, local = dirs
    Run(logdir, base, memory_tier=config(base, local)).train(10, fail=True)
    older, _ = copies(logdir, local)
    newest = os.path.join(local_dir(logdir, local), "model.ckpt-10")
    damage(newest, "bit flip")
    reboot(base)
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        out = Run(logdir, base, memory_tier=config(base, local)).train(10 - older, fail=True)
    assert (out["tier"], out["restored"]) == ("local", older)
    assert f"The local tier's snapshot {newest} is not usable" in caplog.text
    assert "Restored " + newest[:-2] + f"{older} of the local tier" in caplog.text
    # Never tried again: the restart deleted it; the end copied its own step 10.
    assert copies(logdir, local)[-1] == 10
    CheckpointReader(newest).verify()


def test_copies_newer_than_the_restored_step_are_deleted(dirs):
    """A timeline the restart abandoned (here the memory tier restored an older step)."""
    logdir, base, local = dirs
    tier = MemoryTier(config(base, local), logdir, "a" * 32)
    disk = tier.local_disk
    state = {"w": torch.zeros(1000), "global_step": ts.GlobalStep()}
    disk.start(step=0, state_bytes=4000)
    for step in (4, 8):  # Both due (3 steps apart); 8 is the newest.
        state["global_step"].assign(step)
        disk.offer(tier.saver.save(Session(state), tier.save_path, global_step=step))
    disk.close_copier(flush=True)
    assert copies(logdir, local)[-1] == 8
    disk.start(step=5, state_bytes=4000)
    assert 8 not in copies(logdir, local)
    tier.close(free=True)
    assert not os.path.exists(local_dir(logdir, local))


def test_a_clean_end_frees_the_local_disk(dirs):
    logdir, base, local = dirs
    Run(logdir, base, memory_tier=config(base, local), save_model_secs=3600).train(7)
    assert ts.latest_checkpoint(logdir).endswith("model.ckpt-7")
    assert not os.path.exists(os.path.dirname(local_dir(logdir, local)))


def test_a_disk_too_small_is_an_error_at_the_start_naming_the_sizes(dirs, monkeypatch):
    logdir, base, local = dirs

    def statvfs(path):
        result = os.statvfs_result((4096, 4096, 100, 1, 1, 100, 100, 100, 0, 255))
        return result if path.startswith(local) else real(path)

    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", statvfs)
    with pytest.raises(MemoryTierFullError, match=r"The local tier at .* needs \d+ bytes"):
        Run(logdir, base, memory_tier=config(base, local)).train(1)


def test_a_failed_copy_is_a_warning_and_training_goes_on(dirs, caplog, monkeypatch):
    logdir, base, local = dirs

    def refuse(self, path, source, size):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr("torchsupervisor.storage.local.LocalStorage.put_copied", refuse)
    with caplog.at_level(logging.WARNING, logger="torchsupervisor"):
        out = Run(logdir, base, memory_tier=config(base, local)).train(7, fail=True)
    assert out["step"] == 7
    assert "could not be copied" in caplog.text and "No space left" in caplog.text
    assert copies(logdir, local) == []
    assert caplog.text.count("could not be copied") == 1  # Once per kind of error.


def test_ls_lists_the_local_copies_and_which_one_a_restart_uses(dirs, capsys):
    logdir, base, local = dirs
    Run(logdir, base, memory_tier=config(base, local)).train(10, fail=True)
    reboot(base)
    assert cli_main(["ls", logdir, "--memory-root", base, "--local-dir", local]) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if "model.ckpt-10" in row)
    assert line.startswith("local (rank 0)") and "local copy" in line
    assert "valid" in line and "<- a restart restores this" in line


class Created(ts.SessionRunHook):
    """Keeps the session the monitored session created (its ``restored_tier``)."""

    def after_create_session(self, session, coord) -> None:
        self.session = session


def test_monitored_training_session_resumes_from_the_local_disk(dirs):
    logdir, base, local = dirs

    def run(steps: int, fail: bool) -> tuple[str | None, int, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        step = ts.GlobalStep()
        state = {"model": model, "optimizer": optimizer, "global_step": step}
        created = Created()
        try:
            with ts.MonitoredTrainingSession(
                hooks=[created],
                checkpoint_dir=logdir,
                state=state,
                save_checkpoint_secs=3600,
                save_summaries_steps=None,
                save_summaries_secs=None,
                log_step_count_steps=None,
                memory_tier=config(base, local),
            ) as sess:
                tier, restored = created.session.restored_tier, step.value
                weights = [model.weight.detach().clone()]
                for _ in range(steps):

                    def train() -> None:
                        model(torch.randn(4, 8)).pow(2).mean().backward()
                        optimizer.step()
                        optimizer.zero_grad()
                        step.increment()

                    sess.run(train)
                    weights.append(model.weight.detach().clone())
                if fail:
                    raise RuntimeError("the run fails")
        except RuntimeError as e:
            assert str(e) == "the run fails"
        return tier, restored, weights

    _, _, weights = run(8, fail=True)
    # A snapshot at each step boundary (a run's start): the last is of step 7.
    assert copies(logdir, local)[-1] == 7
    reboot(base)
    tier, restored, again = run(0, fail=True)
    assert (tier, restored) == ("local", 7)
    assert torch.equal(again[0], weights[7])


@pytest.mark.parametrize("late_report", [False, True], ids=["", "late report"])
def test_a_preemption_copies_the_stop_step_to_the_local_disk_before_the_final_checkpoint(
    dirs, monkeypatch, late_report
):
    """The stop's step goes to memory, then to the local disk (whatever its interval), then the
    final checkpoint is tried in the time left: here it cannot make it (an fsync of 3 s), and
    after a reboot the run resumes from the local disk at the stop's step.

    ``late report``: the snapshot's future is done before its callback records the commit (a
    thread switch between the two, made long here); the stop waits for the record too (it
    used to see the step not held, now and then, and copy nothing to the local disk)."""
    import signal
    import time

    from torchsupervisor.testing import FaultyStorage

    logdir, base, local = dirs
    if late_report:
        done = MemoryTier._done

        def late(self, future, step):
            time.sleep(0.3)
            done(self, future, step)

        monkeypatch.setattr(MemoryTier, "_done", late)
    flushed = []
    flush = LocalDiskTier.flush

    def spy(self, step, timeout_secs):
        flushed.append((step, flush(self, step, timeout_secs)))
        return flushed[-1][1]

    monkeypatch.setattr(LocalDiskTier, "flush", spy)
    slow = FaultyStorage()
    slow.delay("fsync", 3.0)
    tiers = config(base, local, every_secs=3600, every_n_steps=0)
    run = Run(
        logdir,
        base,
        memory_tier=tiers,
        save_model_secs=3600,
        saver=ts.Saver(storage=slow),
        preemption_grace_secs=2.0,
        preemption_sources=None,
    )
    with pytest.raises(SystemExit), run.sv.managed_session() as sess:
        for _ in range(7):
            sess.run(run.train_step)
        os.kill(os.getpid(), signal.SIGTERM)
        assert run.sv.should_stop()
    assert flushed == [(7, True)]
    assert copies(logdir, local) == [7]
    assert ts.latest_checkpoint(logdir) is None  # Out of time: nothing in the directory.
    reboot(base)
    out = Run(logdir, base, memory_tier=tiers).train(0, fail=True)
    assert (out["tier"], out["restored"]) == ("local", 7)


def test_a_flush_whose_copy_fails_gives_up_at_once(dirs, monkeypatch):
    """A preemption's copy to the local disk that fails does not eat the time left."""
    import time

    logdir, base, local = dirs

    def refuse(self, path, source, size):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr("torchsupervisor.storage.local.LocalStorage.put_copied", refuse)
    tier = MemoryTier(config(base, local, every_secs=3600, every_n_steps=0), logdir, "a" * 32)
    disk = tier.local_disk
    state = {"w": torch.zeros(1000), "global_step": ts.GlobalStep()}
    disk.start(step=0, state_bytes=4000)
    state["global_step"].assign(5)
    disk.offer(tier.saver.save(Session(state), tier.save_path, global_step=5))
    started = time.monotonic()
    assert disk.flush(5, 30.0) is False
    assert time.monotonic() - started < 10
    tier.close(free=True)
