"""The sharded front end of MonitoredTrainingSession (``ShardedSessionCreator``,
``ShardedCheckpointSaverHook``) on its edges: what it refuses, with which error. Its runs (every
rank restores and saves together, stops, kills, the memory tier) are
``tests/e2e/test_monitored_sharded.py``'s."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchsupervisor as ts
from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState
from torchsupervisor.errors import FailedPreconditionError, InvalidArgumentError
from torchsupervisor.testing import run_world


def _sharded_state(world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = ts.GlobalStep()
    step.bind(optimizer)
    return {
        "model": model,
        "optimizer": ShardedOptimizerState(model, optimizer),
        "global_step": step,
    }


def _refusals(rank: int, world_size: int, logdir: str) -> list[str]:
    state = _sharded_state(world_size)
    refused = []
    with pytest.raises(InvalidArgumentError) as not_chief:
        ts.MonitoredTrainingSession(
            master="env://", is_chief=rank != 0, checkpoint_dir=logdir, state=state
        )
    refused.append(str(not_chief.value))
    creator = ts.ShardedSessionCreator(checkpoint_dir=logdir, state=state)
    sess = creator.create_session()
    try:
        assert sess.replicas is not None and sess.restored_checkpoint is None
        with pytest.raises(FailedPreconditionError) as again:
            creator.create_session()
        refused.append(str(again.value))
    finally:
        creator.close()
        sess.close()
    return refused


def test_a_sharded_state_has_rank_0_for_its_chief_and_one_session_per_process(tmp_path):
    not_chief, again = run_world(_refusals, str(tmp_path), world_size=1)[0]
    assert not_chief == (
        "With a sharded state the chief is rank 0; this is rank 0 with is_chief=False"
    )
    assert "is not re-created in-process" in again and "torchrun --max-restarts" in again


def test_the_sharded_hook_needs_a_session_every_rank_prepared(tmp_path):
    step = ts.GlobalStep()
    ts.add_to_collection(ts.GraphKeys.GLOBAL_STEP, step)
    hook = ts.ShardedCheckpointSaverHook(str(tmp_path), save_steps=1)
    hook.begin()
    with pytest.raises(ValueError, match="prepared together"):
        hook.after_create_session(ts.Session({"global_step": step}), None)


class _Recorder(ts.CheckpointSaverListener):
    """Records the calls it gets; asks to stop after the checkpoint of step 4."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def before_save(self, session, global_step_value):
        self.calls.append(("before", global_step_value))

    def after_save(self, session, global_step_value):
        self.calls.append(("after", global_step_value))
        return global_step_value == 4

    def end(self, session, global_step_value):
        self.calls.append(("end", global_step_value))


def _listened(rank: int, world_size: int, logdir: str) -> list[tuple[str, int]]:
    state = _sharded_state(world_size)
    model, step = state["model"], state["global_step"]
    listener = _Recorder()
    creator = ts.ShardedSessionCreator(checkpoint_dir=logdir, state=state)
    hook = ts.ShardedCheckpointSaverHook(logdir, save_steps=2, listeners=[listener])

    def train() -> None:
        model(torch.ones(2, 4)).sum().backward()
        state["optimizer"].optimizer.step()

    with ts.MonitoredSession(session_creator=creator, hooks=[hook]) as sess:
        while not sess.should_stop() and step.value < 20:
            sess.run(train)
    return listener.calls


def test_the_sharded_hook_calls_its_listeners_on_every_rank_around_each_agreed_save(tmp_path):
    calls = run_world(_listened, str(tmp_path), world_size=2)
    # Steps 0, 2 and 4 saved by both ranks, each save between its listeners' calls; the stop
    # a listener asked for at 4 holds on both; the final checkpoint is that of step 4 (not
    # written again).
    expected = [("before", 0), ("after", 0), ("before", 2), ("after", 2)]
    expected += [("before", 4), ("after", 4), ("end", 4)]
    assert calls == [expected, expected]
    assert ts.latest_checkpoint(str(tmp_path)).endswith("model.ckpt-4")
