"""Where the memory tier lives: a root per user, a key per run, a directory per rank."""

from __future__ import annotations

import os

import pytest

from torchsupervisor.tiers import memory_root as roots


def test_the_root_is_per_user_under_the_chosen_file_system(tmp_path, monkeypatch):
    monkeypatch.delenv(roots.MEMORY_ROOT_ENV, raising=False)
    assert roots.memory_root() == f"/dev/shm/torchsupervisor-{os.getuid()}"
    monkeypatch.setenv(roots.MEMORY_ROOT_ENV, str(tmp_path))
    assert roots.memory_root() == str(tmp_path / f"torchsupervisor-{os.getuid()}")
    assert roots.memory_root("/elsewhere") == f"/elsewhere/torchsupervisor-{os.getuid()}"


def test_a_run_is_keyed_by_its_log_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert roots.run_key("runs/a") == roots.run_key(str(tmp_path / "runs" / "a"))
    assert roots.run_key("runs/a") != roots.run_key("runs/b")
    assert roots.run_key("s3://bucket/run/") == roots.run_key("s3://bucket/run")
    assert len(roots.run_key("s3://bucket/run")) == 16
    directory = roots.rank_directory("/root-of-tier", "s3://bucket/run", 3)
    assert directory == f"/root-of-tier/{roots.run_key('s3://bucket/run')}/rank-3"
    with pytest.raises(ValueError, match="rank"):
        roots.rank_directory("/root-of-tier", "runs/a", -1)
