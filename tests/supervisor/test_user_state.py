"""The user's state mapping is what is saved and restored, plain values included, by the
Supervisor and by MonitoredTrainingSession (``core/training_state.py``)."""

from __future__ import annotations

import torch

from torchsupervisor import GlobalStep, Graph, MonitoredTrainingSession, Supervisor


def _train(state, steps: int, optimizer) -> None:
    for _ in range(steps):
        optimizer.step()
        state["best"] = min(state["best"], float(state["global_step"].value))
        state["lr"] *= 0.5
        state["history"]["seen"] += 1


def _state() -> tuple[dict, torch.optim.Optimizer]:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = GlobalStep()
    step.bind(optimizer)
    state = {"model": model, "global_step": step, "best": 1e9, "lr": 1.0, "history": {"seen": 0}}
    return state, optimizer


def test_the_supervisor_saves_and_restores_the_users_plain_values(tmp_path):
    # A copy of the mapping saved 1e9 forever (nanoGPT's best_val_loss, an LR in a dict).
    state, optimizer = _state()
    sv = Supervisor(graph=Graph(), logdir=str(tmp_path), state=state, save_model_secs=3600)
    with sv.managed_session():
        _train(state, 4, optimizer)
    assert "rng" not in state  # Saved beside it.

    state, optimizer = _state()
    sv = Supervisor(graph=Graph(), logdir=str(tmp_path), state=state, save_model_secs=3600)
    with sv.managed_session():
        assert state["global_step"].value == 4
        assert (state["best"], state["lr"], state["history"]) == (1.0, 0.0625, {"seen": 4})


def test_monitored_training_session_saves_and_restores_the_users_plain_values(tmp_path):
    for expected in (None, (1.0, 0.125, {"seen": 3})):
        state, optimizer = _state()
        with (
            Graph().as_default(),
            MonitoredTrainingSession(
                checkpoint_dir=str(tmp_path), state=state, save_summaries_steps=0
            ),
        ):
            if expected is not None:
                assert (state["best"], state["lr"], state["history"]) == expected
            else:
                _train(state, 3, optimizer)
        assert "rng" not in state
