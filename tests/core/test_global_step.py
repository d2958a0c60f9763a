"""GlobalStep and TF's global-step helpers."""

from __future__ import annotations

import logging

import pytest
import torch

from torchsupervisor import (
    GlobalStep,
    Graph,
    GraphKeys,
    assert_global_step,
    create_global_step,
    get_global_step,
    get_or_create_global_step,
    global_step,
)
from torchsupervisor.core.global_step import read_step


def test_counter_basics():
    gs = GlobalStep(5)
    assert gs.value == 5 and int(gs) == 5 and gs.name == "global_step"
    assert gs.increment() == 6 and gs.increment(4) == 10
    gs.assign(torch.tensor(3))
    assert gs.state_dict() == {"value": 3}
    gs.load_state_dict({"value": 11})
    assert gs.value == 11 and "11" in repr(gs)
    assert [0, 1, 2][GlobalStep(1)] == 1  # __index__
    with pytest.raises(TypeError, match="integer"):
        gs.assign(1.5)
    with pytest.raises(TypeError, match="integer"):
        GlobalStep(True)


def test_bind_counts_optimizer_steps():
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    gs = GlobalStep()
    handle = gs.bind(opt)
    for _ in range(3):
        p.grad = torch.ones(1)
        opt.step()
    assert gs.value == 3
    handle.remove()
    opt.step()
    assert gs.value == 3


def test_collection_helpers():
    graph = Graph()
    assert get_global_step(graph) is None
    gs = get_or_create_global_step(graph)
    assert isinstance(gs, GlobalStep) and graph.get_collection(GraphKeys.GLOBAL_STEP) == [gs]
    assert get_or_create_global_step(graph) is gs
    with pytest.raises(ValueError, match=r'"global_step" already exists\.'):
        create_global_step(graph)


def test_several_global_steps_log_an_error(caplog):
    graph = Graph()
    graph.add_to_collection(GraphKeys.GLOBAL_STEP, GlobalStep())
    graph.add_to_collection(GraphKeys.GLOBAL_STEP, GlobalStep())
    with caplog.at_level(logging.ERROR, "torchsupervisor"):
        assert get_global_step(graph) is None
    assert "Multiple tensors in global_step collection." in caplog.text


def test_assert_global_step_and_value():
    assert_global_step(GlobalStep())
    assert_global_step(torch.tensor(3))
    with pytest.raises(TypeError, match="must be a Variable or Tensor"):
        assert_global_step(3)
    with pytest.raises(TypeError, match="does not have integer type"):
        assert_global_step(torch.tensor(3.0))
    with pytest.raises(TypeError, match="is not scalar"):
        assert_global_step(torch.tensor([3]))
    assert global_step(None, GlobalStep(7)) == 7
    assert global_step(None, torch.tensor(8)) == 8


def test_increment_and_read_step_check_their_types():
    step = GlobalStep(3)
    assert step.increment(torch.tensor(2)) == 5
    with pytest.raises(TypeError, match="n must be an integer"):
        step.increment(1.5)
    with pytest.raises(TypeError, match="integer scalar"):
        step.assign(torch.tensor(True))
    assert step.value == 5 and isinstance(step.value, int)

    class Named(GlobalStep):
        pass

    assert read_step(Named(7)) == 7  # Subclasses are global steps too.


def test_a_gate_runs_before_every_increment_and_can_be_taken_back():
    step = GlobalStep()
    seen = []
    assert step.gate_increments(lambda: seen.append(step.value)) is None
    step.increment()
    step.increment(2)
    assert seen == [0, 1] and step.value == 3
    gate = step.gate_increments(None)
    assert gate is not None
    step.increment()
    assert seen == [0, 1]


def test_a_mirror_gets_the_step_at_every_change(tmp_path):
    import mmap

    path = tmp_path / "heartbeat"
    path.write_bytes(bytes(8))
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 8)
    view = memoryview(mapped).cast("q")
    step = GlobalStep(4)
    step.mirror_to(view)
    assert view[0] == 4
    step.increment()
    step.increment(3)
    assert view[0] == 8
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step.bind(optimizer)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert view[0] == 9
    step.assign(20)
    assert view[0] == 20
    step.load_state_dict({"value": 30})
    assert view[0] == 30
    step.mirror_to(None)
    step.increment()
    assert view[0] == 30 and path.read_bytes() == (30).to_bytes(8, "little")  # In the file.
    view.release()
    mapped.close()
