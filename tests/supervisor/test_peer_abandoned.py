"""A replicated run's non-chief deletes its peer copy of a timeline the chief abandoned.

Real processes of a gloo group, each rank its own "node" (``GROUP_RANK``, its own memory
root). The first run ends by a hard failure of both ranks once the non-chief holds the
chief's snapshot of step 8; the chief's node is then lost (its memory deleted) and the copy
damaged. The restarted chief fetches the copy, refuses it (its checksums), and restores step 3
from the disk; the non-chief deletes the copy of step 8 before the chief sends again
(``WorkerMode`` -> ``replication.drop_abandoned``), so no later restart can take it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import pytest
import torch

from torchsupervisor import GlobalStep, MemoryTierConfig, Supervisor
from torchsupervisor.checkpoint.files import checkpoint_step
from torchsupervisor.testing import WorldError, run_world
from torchsupervisor.tiers.memory import held_in_memory

pytestmark = pytest.mark.skipif(not hasattr(os, "splice"), reason="Linux only")


def _node(rank: int, base: str) -> str:
    """Make this rank its own node with its own memory root; return the root."""
    root = os.path.join(base, f"node{rank}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    os.environ.update(GROUP_RANK=str(rank), TORCHSUPERVISOR_MEMORY_ROOT=root)
    return root


def _copies(base: str) -> list[int]:
    """The steps of the chief's snapshots that node 1 keeps copies of."""
    logdir, root = os.path.join(base, "log"), os.path.join(base, "node1")
    held = held_in_memory(logdir, root)
    return sorted(checkpoint_step(p) for h in held if h.copy for p in h.prefixes)


def _supervisor(base: str, w: torch.Tensor, step: GlobalStep) -> Supervisor:
    return Supervisor(
        logdir=os.path.join(base, "log"),
        state={"w": w, "global_step": step},
        save_model_secs=3600,  # The chief saves step 3 itself.
        save_summaries_secs=0,
        recovery_wait_secs=0.1,
        memory_tier=MemoryTierConfig(),
    )


def first_run(rank: int, world_size: int, base: str) -> None:
    """Train to step 8 (a checkpoint on disk at step 3), wait for node 1's copy of step 8,
    then die without a word (both ranks)."""
    _node(rank, base)
    w, step = torch.zeros(1000), GlobalStep()
    sv = _supervisor(base, w, step)
    with sv.managed_session() as sess:
        while step.value < 8:
            sv.should_stop()
            w += 1
            step.increment()
            if rank == 0 and step.value == 3:
                sv.saver.save(sess, sv.save_path, global_step=step)
        sv.should_stop()  # The boundary of step 8: its snapshot, then its copy.
        deadline = time.monotonic() + 60
        # The copy of step 8 is visible before the peer deletes the one of step 7: wait for
        # both (a copy of 7 left behind would be a valid older copy, restored instead of 3).
        while _copies(base) != [8] and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)  # A hard failure: nothing freed, no final checkpoint.


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def second_run(rank: int, world_size: int, base: str) -> tuple[int, float, list[str]]:
    """The restart: returns the step resumed at, ``w`` then, and what this rank logged."""
    _node(rank, base)
    messages = _Messages()
    logger = logging.getLogger("torchsupervisor")
    logger.addHandler(messages)
    logger.setLevel(logging.INFO)
    w, step = torch.zeros(1000), GlobalStep()
    sv = _supervisor(base, w, step)
    with sv.managed_session():
        resumed, value = step.value, float(w[0])
        while step.value < resumed + 2 and not sv.should_stop():
            w += 1
            step.increment()
    return resumed, value, messages.lines


def test_the_copy_of_an_abandoned_timeline_is_deleted_before_the_chief_sends_again(tmp_path):
    base = str(tmp_path)
    with pytest.raises(WorldError, match="no result"):
        run_world(first_run, base, timeout_secs=120)
    assert _copies(base) == [8]
    # The chief's node is lost, and the copy of step 8 damaged (a bit of its data flipped).
    shutil.rmtree(tmp_path / "node0")
    (data,) = (tmp_path / "node1").rglob("model.ckpt-8.data-*")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))
    (chief, worker) = run_world(second_run, base, timeout_secs=120)
    assert chief[:2] == (3, 3.0) and worker[0] == 3  # From the disk: the copy was refused.
    assert any("Fetched the memory tier's snapshot of step 8" in m for m in chief[2])
    assert any("model.ckpt-8" in m and "checksum" in m.lower() for m in chief[2]), chief[2]
    assert "Deleted the peer copy of step 8: the run restored step 3" in worker[2]
    assert 8 not in _copies(base)
