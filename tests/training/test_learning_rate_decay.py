"""The decay schedules against TF's documented formulas, computed by hand, and GlobalStepLR."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from torchsupervisor import GlobalStep, Saver, create_global_step
from torchsupervisor.errors import InvalidArgumentError
from torchsupervisor.training.learning_rate_decay import (
    GlobalStepLR,
    exponential_decay,
    inverse_time_decay,
    natural_exp_decay,
    piecewise_constant,
    piecewise_constant_decay,
    polynomial_decay,
)

# ---------------------------------------------------------------------- exponential_decay


@pytest.mark.parametrize("step", [0, 1, 50, 99, 100, 101, 250, 1000])
def test_exponential_decay_continuous(step):
    # 0.1 * 0.96 ** (step / 100)
    assert exponential_decay(0.1, step, 100, 0.96) == pytest.approx(0.1 * 0.96 ** (step / 100))


@pytest.mark.parametrize(
    ("step", "periods"), [(0, 0), (99, 0), (100, 1), (101, 1), (199, 1), (200, 2), (350, 3)]
)
def test_exponential_decay_staircase_drops_every_decay_steps(step, periods):
    got = exponential_decay(0.1, step, 100, 0.5, staircase=True)
    assert got == pytest.approx(0.1 * 0.5**periods)


def test_exponential_decay_reads_global_step_and_tensor_steps():
    step = GlobalStep(150)
    assert exponential_decay(1.0, step, 100, 0.5) == pytest.approx(0.5**1.5)
    assert exponential_decay(1.0, torch.tensor(150), 100, 0.5) == pytest.approx(0.5**1.5)
    assert exponential_decay(torch.tensor(2.0), np.int64(150), 100, 0.5) == pytest.approx(
        2 * 0.5**1.5
    )


@pytest.mark.parametrize(
    "fn", [exponential_decay, inverse_time_decay, natural_exp_decay, polynomial_decay]
)
def test_global_step_is_required(fn):
    with pytest.raises(ValueError, match=rf"^global_step is required for {fn.__name__}\.$"):
        fn(0.1, None, 100, 0.5)


@pytest.mark.parametrize(
    "fn", [exponential_decay, inverse_time_decay, natural_exp_decay, polynomial_decay]
)
@pytest.mark.parametrize("decay_steps", [0, -10])
def test_decay_steps_must_be_positive(fn, decay_steps):
    with pytest.raises(InvalidArgumentError, match=r"decay_steps .* must be positive"):
        fn(0.1, 5, decay_steps, 0.5)


def test_non_numeric_arguments_are_type_errors():
    with pytest.raises(TypeError, match="global_step"):
        exponential_decay(0.1, "5", 100, 0.5)
    with pytest.raises(TypeError, match="learning_rate"):
        exponential_decay(None, 5, 100, 0.5)
    with pytest.raises(TypeError, match="decay_rate"):
        exponential_decay(0.1, 5, 100, torch.tensor([0.5, 0.6]))


def test_invalid_arithmetic_gives_nan_as_in_tf():
    # A negative base to a fractional power: TF yields NaN, not a Python complex or exception.
    assert math.isnan(exponential_decay(0.1, 50, 100, -0.5))


# ----------------------------------------------------------------------- inverse_time_decay


@pytest.mark.parametrize("step", [0, 1, 5, 10, 15, 100])
def test_inverse_time_decay(step):
    # 0.1 / (1 + 0.5 * step / 10)
    assert inverse_time_decay(0.1, step, 10, 0.5) == pytest.approx(0.1 / (1 + 0.5 * step / 10))


@pytest.mark.parametrize(("step", "p"), [(0, 0), (9, 0), (10, 1), (19, 1), (25, 2)])
def test_inverse_time_decay_staircase(step, p):
    assert inverse_time_decay(0.1, step, 10, 0.5, staircase=True) == pytest.approx(
        0.1 / (1 + 0.5 * p)
    )


# ------------------------------------------------------------------------ natural_exp_decay


@pytest.mark.parametrize("step", [0, 1, 5, 10, 15, 100])
def test_natural_exp_decay(step):
    assert natural_exp_decay(0.1, step, 10, 0.5) == pytest.approx(0.1 * math.exp(-0.5 * step / 10))


@pytest.mark.parametrize(("step", "p"), [(0, 0), (9, 0), (10, 1), (25, 2)])
def test_natural_exp_decay_staircase(step, p):
    assert natural_exp_decay(0.1, step, 10, 0.5, staircase=True) == pytest.approx(
        0.1 * math.exp(-0.5 * p)
    )


# ------------------------------------------------------------------------- polynomial_decay


@pytest.mark.parametrize("step", [0, 1, 25, 50, 99, 100, 101, 1000])
def test_polynomial_decay_linear_stays_at_end_after_decay_steps(step):
    s = min(step, 100)
    expected = (0.1 - 0.01) * (1 - s / 100) + 0.01
    assert polynomial_decay(0.1, step, 100, 0.01) == pytest.approx(expected)


def test_polynomial_decay_defaults_and_power():
    # end_learning_rate defaults to 0.0001, power to 1.0.
    assert polynomial_decay(0.1, 50, 100) == pytest.approx((0.1 - 0.0001) * 0.5 + 0.0001)
    # power 0.5: sqrt decay.
    assert polynomial_decay(0.1, 75, 100, 0.01, power=0.5) == pytest.approx(
        (0.1 - 0.01) * 0.25**0.5 + 0.01
    )


@pytest.mark.parametrize(
    ("step", "period"),
    [
        (0, 100),  # step 0: the multiplier is 1 (TF's special case), not ceil(0) = 0.
        (1, 100),
        (100, 100),  # a multiple of decay_steps: the end of the period, end_learning_rate.
        (101, 200),  # one step later the rate jumps back up.
        (150, 200),
        (200, 200),
        (201, 300),
    ],
)
def test_polynomial_decay_cycle(step, period):
    expected = (0.1 - 0.01) * (1 - step / period) ** 2 + 0.01
    assert polynomial_decay(0.1, step, 100, 0.01, power=2.0, cycle=True) == pytest.approx(expected)


def test_polynomial_decay_cycle_reaches_end_at_each_multiple():
    rates = [polynomial_decay(1.0, s, 10, 0.0, cycle=True) for s in range(0, 31)]
    assert rates[0] == pytest.approx(1.0)
    for multiple in (10, 20, 30):
        assert rates[multiple] == pytest.approx(0.0)
        if multiple < 30:
            assert rates[multiple + 1] > rates[multiple]


# ----------------------------------------------------------------------- piecewise_constant


@pytest.mark.parametrize(
    ("x", "expected"),
    [(0, 1.0), (100000, 1.0), (100001, 0.5), (110000, 0.5), (110001, 0.1), (10**9, 0.1)],
)
def test_piecewise_constant_intervals_include_their_upper_boundary(x, expected):
    assert piecewise_constant(x, [100000, 110000], [1.0, 0.5, 0.1]) == expected


def test_piecewise_constant_with_a_global_step_and_tensors():
    step = GlobalStep(7)
    assert piecewise_constant(step, [5, 10], [1.0, 0.5, 0.1]) == 0.5
    step.assign(11)
    assert piecewise_constant(step, [5, 10], [1.0, 0.5, 0.1]) == 0.1
    x = torch.tensor(3.5)
    got = piecewise_constant(x, [torch.tensor(3.0)], [torch.tensor(1.0), torch.tensor(2.0)])
    assert got == 2.0 and isinstance(got, float)
    assert piecewise_constant(2.5, [1.0, 2.0], [1, 2, 3]) == 3
    assert piecewise_constant_decay is piecewise_constant


def test_piecewise_constant_dtype_errors_have_tf_texts():
    with pytest.raises(
        ValueError,
        match=r"^Boundaries \(<dtype: 'float32'>\) must have the same dtype as x "
        r"\(<dtype: 'int64'>\)\.$",
    ):
        piecewise_constant(GlobalStep(3), [1.5], [1.0, 0.5])
    with pytest.raises(
        ValueError, match=r"Boundaries \(<dtype: 'int32'>\) .* x \(<dtype: 'float32'>"
    ):
        piecewise_constant(2.5, [1], [1.0, 0.5])
    with pytest.raises(
        ValueError,
        match=r"^Values must have elements all with the same dtype "
        r"\(<dtype: 'float32'> vs <dtype: 'int32'>\)\.$",
    ):
        piecewise_constant(3, [5], [1.0, 1])
    # int32 boundaries are promoted for an int64 x (a GlobalStep, or an int64 tensor).
    assert piecewise_constant(torch.tensor(3), [5], [1.0, 0.5]) == 1.0
    # ...but int64 boundaries do not fit an int32 x.
    with pytest.raises(ValueError, match="Boundaries"):
        piecewise_constant(torch.tensor(3, dtype=torch.int32), [torch.tensor(5)], [1.0, 0.5])


def test_piecewise_constant_length_and_order_errors():
    with pytest.raises(
        ValueError, match=r"^The length of boundaries should be 1 less than the length of values$"
    ):
        piecewise_constant(3, [5, 10], [1.0, 0.5])
    # TF checks the lengths (schedule construction) before the dtypes (evaluation).
    with pytest.raises(ValueError, match=r"^The length of boundaries"):
        piecewise_constant(3, [1.5, 2.5], [1.0, 2.0])
    with pytest.raises(InvalidArgumentError, match="strictly increasing"):
        piecewise_constant(3, [10, 5], [1.0, 0.5, 0.1])
    with pytest.raises(InvalidArgumentError, match="strictly increasing"):
        piecewise_constant(3, [5, 5], [1.0, 0.5, 0.1])
    with pytest.raises(TypeError, match="piecewise_constant takes"):
        piecewise_constant("3", [5], [1.0, 0.5])


# ----------------------------------------------------------------------------- GlobalStepLR


def _model_and_optimizer(lr: float = 1.0, groups: int = 1):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    optimizer = torch.optim.SGD([{"params": [p]} for p in params], lr=lr)
    return params, optimizer


def _schedule(step: int) -> float:
    return polynomial_decay(0.1, step, 100, 0.01)


def _one_step(params, optimizer):
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()


def test_scheduler_sets_the_rate_of_the_current_step_at_construction():
    _, optimizer = _model_and_optimizer()
    step = GlobalStep(40)
    scheduler = GlobalStepLR(optimizer, _schedule, step)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(_schedule(40))
    assert scheduler.get_last_lr() == [pytest.approx(_schedule(40))]


def test_each_update_uses_the_rate_of_its_step():
    params, optimizer = _model_and_optimizer()
    step = GlobalStep()
    step.bind(optimizer)
    scheduler = GlobalStepLR(optimizer, _schedule, step)
    for s in range(5):
        before = params[0].detach().clone()
        _one_step(params, optimizer)
        # SGD: w -= lr * 1, with lr the schedule at the step the update started from.
        assert (before - params[0].detach()).tolist() == pytest.approx([_schedule(s)] * 2)
        scheduler.step()
        assert step.value == s + 1
        assert scheduler.get_last_lr() == [pytest.approx(_schedule(s + 1))]


def test_the_rate_follows_a_restored_step_not_the_number_of_scheduler_steps():
    params, optimizer = _model_and_optimizer()
    step = GlobalStep()
    step.bind(optimizer)
    scheduler = GlobalStepLR(optimizer, _schedule, step)
    for _ in range(3):
        _one_step(params, optimizer)
        scheduler.step()
    # A restore: the step jumps, and the optimizer state carries a stale learning rate.
    step.assign(70)
    optimizer.param_groups[0]["lr"] = 123.0
    before = params[0].detach().clone()
    _one_step(params, optimizer)
    assert (before - params[0].detach()).tolist() == pytest.approx([_schedule(70)] * 2)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(_schedule(71))


def test_without_sync_before_step_the_rate_changes_only_in_scheduler_step():
    params, optimizer = _model_and_optimizer()
    step = GlobalStep()
    scheduler = GlobalStepLR(optimizer, _schedule, step, sync_before_step=False)
    step.assign(50)
    optimizer.param_groups[0]["lr"] = 1.0
    _one_step(params, optimizer)
    assert params[0].tolist() == pytest.approx([-1.0, -1.0])
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(_schedule(50))


def test_remove_hook_stops_the_sync():
    params, optimizer = _model_and_optimizer()
    step = GlobalStep(10)
    scheduler = GlobalStepLR(optimizer, _schedule, step)
    scheduler.remove_hook()
    optimizer.param_groups[0]["lr"] = 1.0
    _one_step(params, optimizer)
    assert params[0].tolist() == pytest.approx([-1.0, -1.0])


def test_one_function_per_group_and_partial_schedules():
    _, optimizer = _model_and_optimizer(groups=2)
    step = GlobalStep(200)
    fns = [
        functools.partial(exponential_decay, 0.1, decay_steps=100, decay_rate=0.5),
        lambda s: piecewise_constant(s, [100], [1.0, 0.25]),
    ]
    GlobalStepLR(optimizer, fns, step)
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(0.025), 0.25]


def test_tensor_step_and_default_graph_step():
    _, optimizer = _model_and_optimizer()
    counter = torch.tensor(30)
    GlobalStepLR(optimizer, _schedule, counter)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(_schedule(30))
    counter.fill_(60)
    optimizer.step()  # No gradients: SGD skips the parameters, the pre-step sync still runs.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(_schedule(60))
    graph_step = create_global_step()
    graph_step.assign(90)
    _, optimizer = _model_and_optimizer()
    scheduler = GlobalStepLR(optimizer, _schedule)
    assert scheduler.global_step is graph_step
    assert optimizer.param_groups[0]["lr"] == pytest.approx(_schedule(90))


def test_scheduler_argument_errors():
    _, optimizer = _model_and_optimizer(groups=2)
    step = GlobalStep()
    with pytest.raises(TypeError, match="is not an Optimizer"):
        GlobalStepLR(object(), _schedule, step)
    with pytest.raises(ValueError, match="Expected 2 lr functions, but got 1"):
        GlobalStepLR(optimizer, [_schedule], step)
    with pytest.raises(TypeError, match="lr_fn must be callable"):
        GlobalStepLR(optimizer, 0.1, step)
    with pytest.raises(ValueError, match=r"^global_step is required for GlobalStepLR\.$"):
        GlobalStepLR(optimizer, _schedule)
    with pytest.raises(TypeError, match="global_step must be a GlobalStep"):
        GlobalStepLR(optimizer, _schedule, 5)
    with pytest.raises(TypeError, match="integer"):
        GlobalStepLR(optimizer, _schedule, torch.tensor(1.5))


def test_scheduler_state_round_trips_through_a_checkpoint(tmp_path):
    params, optimizer = _model_and_optimizer()
    step = GlobalStep()
    step.bind(optimizer)
    scheduler = GlobalStepLR(optimizer, _schedule, step)
    for _ in range(4):
        _one_step(params, optimizer)
        scheduler.step()
    saver = Saver({"optimizer": optimizer, "scheduler": scheduler, "global_step": step})
    path = saver.save(None, str(tmp_path / "model.ckpt"), global_step=step)

    params2, optimizer2 = _model_and_optimizer()
    step2 = GlobalStep()
    step2.bind(optimizer2)
    scheduler2 = GlobalStepLR(optimizer2, _schedule, step2)
    Saver({"optimizer": optimizer2, "scheduler": scheduler2, "global_step": step2}).restore(
        None, path
    )
    assert step2.value == 4
    assert scheduler2.last_epoch == scheduler.last_epoch
    assert "_lr_fns" not in scheduler2.state_dict()
    before = params2[0].detach().clone()
    _one_step(params2, optimizer2)
    assert (before - params2[0].detach()).tolist() == pytest.approx([_schedule(4)] * 2)
