"""ExponentialMovingAverage: TF's update and decay rules, checkpoints, and restoring averages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchsupervisor import GlobalStep, Saver, Session
from torchsupervisor.errors import InvalidArgumentError, NotFoundError
from torchsupervisor.training.moving_averages import ExponentialMovingAverage


def _by_hand(values, decays):
    """shadow starts at values[0]; then shadow -= (1 - d) * (shadow - v) for each later v."""
    shadow = values[0]
    for value, decay in zip(values[1:], decays):
        shadow -= (1 - decay) * (shadow - value)
    return shadow


def test_apply_follows_tfs_formula_over_several_steps():
    w = torch.tensor([1.0, -2.0], dtype=torch.float64)
    ema = ExponentialMovingAverage(0.9)
    ema.apply({"w": w})
    shadow = ema.average(w)
    assert shadow is not w and shadow.tolist() == [1.0, -2.0]  # A copy of the start value.
    history = [[1.0, -2.0]]
    for k in range(1, 6):
        with torch.no_grad():
            w.add_(torch.tensor([0.5 * k, -0.25], dtype=torch.float64))
        history.append(w.tolist())
        ema.apply({"w": w})
    expected = [_by_hand([h[i] for h in history], [0.9] * 5) for i in range(2)]
    assert shadow.tolist() == pytest.approx(expected, rel=1e-12)
    # By hand for the first coordinate: 1, then 1.5, 2.5, 4, 6, 8.5.
    s = 1.0
    for v in (1.5, 2.5, 4.0, 6.0, 8.5):
        s = 0.9 * s + 0.1 * v
    assert shadow[0].item() == pytest.approx(s)


@pytest.mark.parametrize(
    ("step", "decay"), [(0, 0.1), (5, 6 / 15), (90, 91 / 100), (1000, 0.99), (10**6, 0.99)]
)
def test_num_updates_rule(step, decay):
    # min(decay, (1 + n) / (10 + n)) with decay 0.99.
    ema = ExponentialMovingAverage(0.99, num_updates=GlobalStep(step))
    expected = min(0.99, (1 + step) / (10 + step))
    assert ema.current_decay() == pytest.approx(expected)
    assert expected == pytest.approx(decay)
    w = torch.zeros(1, dtype=torch.float64)
    ema.apply({"w": w})
    w.fill_(1.0)
    ema.apply({"w": w})
    assert ema.average(w).item() == pytest.approx(1 - expected)


def test_num_updates_is_read_at_every_apply():
    step = GlobalStep(0)
    counter = torch.tensor(0)
    ema = ExponentialMovingAverage(0.999, num_updates=step)
    ema_t = ExponentialMovingAverage(0.999, num_updates=counter)
    w = torch.zeros(1, dtype=torch.float64)
    ema.apply({"w": w})
    ema_t.apply({"w": w})
    values, decays = [0.0], []
    for k in range(1, 4):
        step.increment()
        counter.add_(1)
        w.fill_(float(k))
        values.append(float(k))
        decays.append(min(0.999, (1 + k) / (10 + k)))
        ema.apply({"w": w})
        ema_t.apply({"w": w})
    assert ema.average("w").item() == pytest.approx(_by_hand(values, decays))
    assert ema_t.average("w").item() == pytest.approx(_by_hand(values, decays))


def test_module_names_average_and_average_name():
    model = nn.Linear(3, 2)
    ema = ExponentialMovingAverage(0.5, name="ema")
    ema.apply(model)
    assert ema.average_name(model.weight) == "ema/weight"
    assert ema.average_name("bias") == "ema/bias"
    assert ema.average_name("not/averaged/yet") == "ema/not/averaged/yet"
    assert torch.equal(ema.average(model.bias), model.bias.detach())
    assert ema.average("weight") is ema.average(model.weight)
    assert ema.average(torch.zeros(1)) is None
    assert ema.average("missing") is None
    assert set(ema.state_dict()) == {"weight", "bias"}
    assert ema.average_name(torch.zeros(1)) == "ema/Variable"  # TF's name for it; see below.
    with pytest.raises(TypeError, match="a tensor or its name"):
        ema.average(3)


def test_apply_none_and_lists_of_averaged_tensors():
    model = nn.Linear(2, 1)
    ema = ExponentialMovingAverage(0.0)  # decay 0: the shadow jumps to the value.
    with pytest.raises(ValueError, match="needs var_list the first time"):
        ema.apply()
    ema.apply(model)
    with torch.no_grad():
        model.weight.fill_(3.0)
        model.bias.fill_(4.0)
    ema.apply([model.weight])  # Only the weight.
    # decay 0: shadow - (shadow - value) is the value up to rounding.
    assert ema.average(model.weight).flatten().tolist() == pytest.approx([3.0, 3.0])
    assert ema.average(model.bias).item() != pytest.approx(4.0)
    ema.apply()  # Everything averaged so far.
    assert ema.average(model.bias).item() == pytest.approx(4.0)
    ema.apply([("extra", torch.ones(2))])
    assert ema.average("extra").tolist() == [1.0, 1.0]


def test_apply_errors():
    ema = ExponentialMovingAverage(0.9)
    with pytest.raises(TypeError, match=r"^The variables must be half, float, or double: step"):
        ema.apply({"step": torch.tensor([1, 2])})
    w = torch.ones(2)
    ema.apply({"w": w})
    with pytest.raises(InvalidArgumentError, match="'w' has shape \\(2,\\); the new tensor"):
        ema.apply({"w": torch.ones(3)})
    with pytest.raises(ValueError, match=r"^Moving average already computed for: w"):
        ema.apply({"w2": w})
    with pytest.raises(ValueError, match="non-empty name"):
        ema.apply({"": torch.ones(1)})
    with pytest.raises(TypeError, match="var_list must be"):
        ema.apply(3)
    with pytest.raises(TypeError, match="is not a tensor"):
        ema.apply({"x": [1.0]})


def test_a_new_tensor_under_an_averaged_name_updates_that_average():
    """TF's CIFAR-10 trainer averages its losses: eagerly, a new tensor at every step."""
    ema = ExponentialMovingAverage(0.9, name="avg")
    losses = [4.0, 2.0, 1.0]
    expected = losses[0]
    for i, value in enumerate(losses):
        loss = torch.tensor(value)
        ema.apply([("total_loss", loss)])
        if i:
            expected -= 0.1 * (expected - value)
        assert float(ema.average("total_loss")) == pytest.approx(expected)
        assert ema.average(loss) is ema.average("total_loss")
    assert list(ema.state_dict()) == ["total_loss"]


def test_constructor_errors():
    with pytest.raises(TypeError, match="decay must be a float"):
        ExponentialMovingAverage("0.9")
    with pytest.raises(TypeError):
        ExponentialMovingAverage(0.9, num_updates=1.5)
    with pytest.raises(ValueError, match="without '/'"):
        ExponentialMovingAverage(0.9, name="a/b")
    with pytest.raises(ValueError, match="without '/'"):
        ExponentialMovingAverage(0.9, name="")
    ema = ExponentialMovingAverage(0.9, num_updates=7, zero_debias=True)
    assert ema.current_decay() == pytest.approx(8 / 17)
    assert ema.decay == 0.9 and ema.num_updates == 7 and ema.name == "ExponentialMovingAverage"


def test_shadow_follows_a_module_moved_to_another_dtype():
    model = nn.Linear(2, 1)
    ema = ExponentialMovingAverage(0.5)
    ema.apply(model)
    model.double()
    ema.apply(model)
    assert ema.average("weight").dtype == torch.float64


def test_load_state_dict_overwrites_in_place_and_checks():
    w = torch.zeros(2)
    ema = ExponentialMovingAverage(0.9)
    ema.apply({"w": w})
    shadow = ema.average(w)
    ema.load_state_dict({"w": torch.tensor([5.0, 6.0])})
    assert ema.average(w) is shadow and shadow.tolist() == [5.0, 6.0]
    with pytest.raises(KeyError, match="missing"):
        ema.load_state_dict({})
    with pytest.raises(ValueError, match="has shape"):
        ema.load_state_dict({"w": torch.zeros(3)})
    with pytest.raises(TypeError, match="not a tensor"):
        ema.load_state_dict({"w": 1.0})
    with pytest.raises(TypeError, match="must be a mapping"):
        ema.load_state_dict([("w", torch.zeros(2))])


def test_values_restored_before_apply_become_the_starting_shadows():
    ema = ExponentialMovingAverage(0.5)
    ema.load_state_dict({"w": torch.tensor([4.0, 4.0], dtype=torch.float64)})
    # Saved again before anything was applied: nothing is lost.
    assert ema.state_dict()["w"].tolist() == [4.0, 4.0]
    w = torch.zeros(2)
    ema.apply({"w": w})  # The shadow starts at the restored 4 (as float32), then moves to 0.
    assert ema.average(w).dtype == torch.float32
    assert ema.average(w).tolist() == [2.0, 2.0]
    ema2 = ExponentialMovingAverage(0.5)
    ema2.load_state_dict({"w": torch.zeros(3)})
    with pytest.raises(InvalidArgumentError, match="has shape"):
        ema2.apply({"w": torch.zeros(2)})


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _train(model: nn.Module, ema: ExponentialMovingAverage, step: GlobalStep, steps: int):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step.bind(optimizer)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 3, generator=generator)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        ema.apply(model)


def test_shadows_are_checkpointed_and_restored_into_an_evaluation_model(tmp_path):
    torch.manual_seed(0)
    model = _net()
    step = GlobalStep()
    ema = ExponentialMovingAverage(0.8, num_updates=step, name="ema")
    ema.apply(model)
    _train(model, ema, step, 5)
    state = {"model": model, "ema": ema, "global_step": step}
    path = Saver().save(Session(state), str(tmp_path / "model.ckpt"), global_step=step)
    averages = {name: t.clone() for name, t in ema.state_dict().items()}
    assert not torch.equal(averages["0.weight"], model[0].weight)

    # Resume: a new EMA restored with the rest of the state has the same shadows.
    model2, step2 = _net(), GlobalStep()
    ema2 = ExponentialMovingAverage(0.8, num_updates=step2, name="ema")
    ema2.apply(model2)
    Saver().restore(Session({"model": model2, "ema": ema2, "global_step": step2}), path)
    for name, value in averages.items():
        assert torch.equal(ema2.average(name), value)

    # Evaluate with the averages: a fresh model restored through variables_to_restore.
    eval_model = _net()
    var_list = ema.variables_to_restore(eval_model, prefix="model")
    assert set(var_list) == {
        "ema/0.weight",
        "ema/0.bias",
        "ema/1.weight",
        "ema/1.bias",
        "ema/2.weight",
        "ema/2.bias",
        "model/1.running_mean",
        "model/1.running_var",
        "model/1.num_batches_tracked",
    }
    Saver(var_list).restore(None, path)
    for name, param in eval_model.named_parameters():
        assert torch.equal(param.detach(), averages[name]), name
    assert torch.equal(eval_model[1].running_mean, model[1].running_mean)
    assert eval_model[1].num_batches_tracked.item() == 5
    # The TF docs' form: {ema.average_name(var): var}.
    fresh = nn.Linear(3, 4)
    Saver({ema.average_name("0.weight"): fresh.weight}).restore(None, path)
    assert torch.equal(fresh.weight.detach(), averages["0.weight"])


def test_variables_to_restore_defaults_and_errors(tmp_path):
    model = nn.Linear(2, 2)
    ema = ExponentialMovingAverage(0.5, name="avg")
    ema.apply(model)
    mapping = ema.variables_to_restore()
    assert mapping == {"avg/weight": model.weight, "avg/bias": model.bias}
    assert ema.variables_to_restore({"weight": model.weight}) == {"avg/weight": model.weight}
    with pytest.raises(TypeError, match="prefix"):
        ema.variables_to_restore({"weight": model.weight}, prefix="model")
    # An EMA saved under another state name cannot be found under its own.
    path = Saver({"elsewhere": ema}).save(None, str(tmp_path / "x.ckpt"))
    with pytest.raises(NotFoundError, match="avg/weight"):
        Saver(mapping).restore(None, path)


def test_the_seeds_example_applies_bare_tensors_and_restores_by_average_name(tmp_path):
    # Training: ema.apply([var0, var1]) with plain tensors, as the seed writes it.
    var0, var1 = torch.zeros(3), torch.ones(2)
    ema = ExponentialMovingAverage(0.5)
    ema.apply([var0, var1])
    var0.fill_(4.0)
    var1.fill_(3.0)
    ema.apply([var0, var1])
    assert ema.average(var0).tolist() == [2.0, 2.0, 2.0]
    assert ema.average_name(var1) == "ExponentialMovingAverage/Variable_1"
    path = Saver().save(Session({ema.name: ema}), str(tmp_path / "model.ckpt"))

    # Evaluation, another program: a new EMA names the new tensors before any apply().
    eval0, eval1 = torch.zeros(3), torch.zeros(2)
    ema = ExponentialMovingAverage(0.5)
    shadow_var0_name = ema.average_name(eval0)
    shadow_var1_name = ema.average_name(eval1)
    Saver({shadow_var0_name: eval0, shadow_var1_name: eval1}).restore(None, path)
    assert eval0.tolist() == [2.0, 2.0, 2.0] and eval1.tolist() == [2.0, 2.0]
    # apply() keeps the names average_name() gave.
    ema.apply([eval0, eval1])
    assert set(ema.state_dict()) == {"Variable", "Variable_1"}


def test_a_list_names_its_tensors_by_place_at_every_call():
    # A loss is a new tensor at every step: the same place goes on with the same average.
    ema = ExponentialMovingAverage(0.5)
    for value in (2.0, 4.0):
        ema.apply([torch.tensor(value), torch.tensor(10 * value)])
    assert ema.average("Variable").item() == 3.0
    assert ema.average("Variable_1").item() == 30.0
    assert set(ema.state_dict()) == {"Variable", "Variable_1"}
    # A name average_name() gave another tensor is never taken by a place.
    other = ExponentialMovingAverage(0.5)
    assert other.average_name(torch.ones(1)) == "ExponentialMovingAverage/Variable"
    with pytest.raises(ValueError, match="average_name\\(\\) named another tensor 'Variable'"):
        other.apply([torch.ones(2)])
    # A trainable tensor's average is never handed to another tensor at its place.
    weights = ExponentialMovingAverage(0.5)
    weights.apply([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="Place 0 of apply\\(\\)'s list is 'Variable'"):
        weights.apply([torch.nn.Parameter(torch.zeros(2))])


def test_tfs_scoped_names_are_averaged_saved_and_restored(tmp_path):
    # TF's CIFAR-10 trainer: loss_averages.apply(losses + [total_loss]) with names such as
    # "local3/weight_loss"; here given as pairs (eager tensors have no op name).
    ema = ExponentialMovingAverage(0.5, name="avg")
    for value in (2.0, 4.0):
        ema.apply([("local3/weight_loss", torch.tensor(value)), ("total_loss", torch.tensor(1.0))])
    assert ema.average("local3/weight_loss").item() == 3.0
    assert ema.average_name("local3/weight_loss") == "avg/local3/weight_loss"
    path = Saver().save(Session({"avg": ema}), str(tmp_path / "model.ckpt"))
    restored = ExponentialMovingAverage(0.5, name="avg")
    Saver().restore(Session({"avg": restored}), path)
    assert restored.state_dict()["local3/weight_loss"].item() == 3.0
    # A Saver over the shadow's checkpoint name finds it too.
    into = torch.zeros(())
    Saver({ema.average_name("local3/weight_loss"): into}).restore(None, path)
    assert into.item() == 3.0
