"""What a PyTorch port meets (docs/porting.md): ``torch.compile`` and data-parallel wrappers
(DDP, ``DataParallel``) must not change the state's names, and AMP's skipped steps must not
count as steps."""

from __future__ import annotations

import torch

from torchsupervisor import GlobalStep, Saver, Session
from torchsupervisor.checkpoint.reader import CheckpointReader


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def test_a_compiled_model_saves_and_restores_under_its_own_names(tmp_path):
    compiled = torch.compile(_model(0), backend="eager")
    compiled(torch.randn(5, 3))  # Compiled and run once: its BatchNorm statistics moved.
    path = Saver().save(Session({"model": compiled}), str(tmp_path / "compiled.ckpt"))
    names = sorted(CheckpointReader(path).get_variable_to_shape_map())
    assert "model/0.weight" in names and not [n for n in names if "_orig_mod" in n]
    # Into an uncompiled model, and into a compiled one: the same checkpoint.
    for target in (_model(1), torch.compile(_model(2), backend="eager")):
        Saver().restore(Session({"model": target}), path)
        for (name, value), (_, want) in zip(
            target.state_dict().items(), compiled.state_dict().items()
        ):
            assert torch.equal(value, want), name
    # A plain model's checkpoint restores into a compiled one.
    plain = _model(3)
    path = Saver().save(Session({"model": plain}), str(tmp_path / "plain.ckpt"))
    target = torch.compile(_model(4), backend="eager")
    Saver().restore(Session({"model": target}), path)
    assert torch.equal(target._orig_mod[0].weight, plain[0].weight)


def test_a_checkpoint_with_compiled_names_still_restores(tmp_path):
    # Other tools (and torch.save of a compiled model's state_dict) write "_orig_mod." keys.
    compiled = torch.compile(_model(0), backend="eager")
    prefixed = dict(compiled.state_dict())
    assert all(k.startswith("_orig_mod.") for k in prefixed)
    path = Saver({"model": prefixed}).save(None, str(tmp_path / "old.ckpt"))
    target = _model(1)
    Saver().restore(Session({"model": target}), path)
    assert torch.equal(target[0].weight, compiled._orig_mod[0].weight)


def test_a_data_parallel_models_checkpoint_has_the_plain_models_names(tmp_path):
    """``DataParallel`` (as ``DistributedDataParallel``: ``module.`` before every name) is
    saved and restored through the module it wraps: its checkpoint loads into a plain model,
    a plain one's into it, and one compiled inside it too."""
    wrapped = torch.nn.DataParallel(_model(0))
    wrapped(torch.randn(5, 3))
    path = Saver().save(Session({"model": wrapped}), str(tmp_path / "dp.ckpt"))
    names = sorted(CheckpointReader(path).get_variable_to_shape_map())
    assert "model/0.weight" in names and not [n for n in names if "module." in n]
    for target in (_model(1), torch.nn.DataParallel(torch.compile(_model(2), backend="eager"))):
        Saver().restore(Session({"model": target}), path)
        for (name, value), (_, want) in zip(
            target.state_dict().items(), wrapped.state_dict().items()
        ):
            assert torch.equal(value, want), name


def test_a_checkpoint_with_ddp_names_still_restores_unless_the_model_has_such_a_child(tmp_path):
    # Earlier versions (and torch.save of a DDP model's state_dict) wrote "module." keys.
    prefixed = dict(torch.nn.DataParallel(_model(0)).state_dict())
    assert all(k.startswith("module.") for k in prefixed)
    path = Saver({"model": prefixed}).save(None, str(tmp_path / "old.ckpt"))
    for target in (_model(1), torch.nn.DataParallel(_model(2))):
        Saver().restore(Session({"model": target}), path)
        plain = getattr(target, "module", target)
        assert torch.equal(plain[0].weight, prefixed["module.0.weight"])
    # A model whose one child is called "module": its names are its own.
    holder = torch.nn.Module()
    holder.module = _model(3)
    Saver().restore(Session({"model": holder}), path)
    assert torch.equal(holder.module[0].weight, prefixed["module.0.weight"])


def test_a_step_amp_skips_is_not_counted_and_the_scaler_is_state(tmp_path):
    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    step = GlobalStep()
    step.bind(optimizer)
    x = torch.randn(4, 3)

    def train(poison: bool) -> None:
        optimizer.zero_grad()
        loss = model(x).pow(2).mean() * (float("inf") if poison else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # Skipped when the gradients are not finite.
        scaler.update()

    train(poison=False)
    train(poison=True)
    train(poison=False)
    assert step.value == 2  # The skipped step is no step.
    assert scaler.get_scale() == 2.0**15  # Halved once, by the skipped step.
    state = {"model": model, "optimizer": optimizer, "scaler": scaler, "global_step": step}
    path = Saver().save(Session(state), str(tmp_path / "amp.ckpt"))
    restored = torch.amp.GradScaler("cpu")
    Saver(["scaler"]).restore(Session({**state, "scaler": restored}), path)
    assert restored.get_scale() == 2.0**15
