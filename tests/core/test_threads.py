"""Background threads step aside for the training thread: niceness and SCHED_IDLE (Linux)."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from torchsupervisor import Saver, Session
from torchsupervisor.core import threads as priority

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux threads")


def _in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(timeout=60)
    return out[0]


@linux_only
def test_lower_sets_niceness_and_sched_idle_of_the_calling_thread_only():
    before = priority.current()

    def lowered():
        priority.lower(19, idle=True)
        return priority.current()

    assert _in_thread(lowered) == priority.Priority(19, os.SCHED_IDLE)
    assert priority.current() == before  # This thread is untouched.
    assert _in_thread(lambda: (priority.lower(0, idle=True), priority.current())[1]) == before


@linux_only
def test_the_checkpoint_writer_and_its_checksum_helper_run_at_idle_priority(tmp_path):
    saver = Saver()
    saver.save_async(Session({"w": torch.ones(1 << 20)}), str(tmp_path / "m"), 1).result(60)
    threads = {t.name: t.native_id for t in threading.enumerate()}
    for name in ("torchsupervisor-checkpoint-writer", "torchsupervisor-checksums"):
        assert os.getpriority(os.PRIO_PROCESS, threads[name]) == 19, name
        assert os.sched_getscheduler(threads[name]) == os.SCHED_IDLE, name
    saver.close()
