"""Digits with a decaying learning rate and weight averaging, the TF 1 way, resumable.

    python examples/digits_decay_ema.py --logdir /tmp/digits-decay --max-steps 1500

The learning rate is ``polynomial_decay`` of the global step (TF's
``tf.train.polynomial_decay(lr, global_step, ...)``), applied by a ``GlobalStepLR`` scheduler;
an ``ExponentialMovingAverage`` of the weights (``num_updates`` = the global step) is part of
the checkpointed state. Kill the program at any moment, even with ``kill -9``, and run it
again: it resumes at the restored step and the learning rate continues from that step, not
from the start of the schedule.

At the end it restores the moving averages of the newest checkpoint into a fresh model
(``Saver(ema.variables_to_restore(model, prefix="model"))``) and compares the held-out
accuracy of the last weights with that of the averaged weights.

Every ``--log-every`` steps it prints ``step S lr LR loss L``: LR is the learning rate that the
update of step S (from step S to S + 1) used.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from torch import nn

import torchsupervisor as ts
from torchsupervisor.demo.digits import DigitsData, accuracy, build_model
from torchsupervisor.training.learning_rate_decay import GlobalStepLR, polynomial_decay
from torchsupervisor.training.moving_averages import ExponentialMovingAverage


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logdir", default="/tmp/torchsupervisor-digits-decay-ema")
    parser.add_argument("--max-steps", type=int, default=1500)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--end-learning-rate", type=float, default=0.001)
    parser.add_argument("--decay-steps", type=int, default=None, help="default: --max-steps")
    parser.add_argument("--power", type=float, default=1.0)
    parser.add_argument("--ema-decay", type=float, default=0.99)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-model-secs", type=float, default=10.0)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument(
        "--step-delay-secs", type=float, default=0.0, help="sleep in every step (to kill mid-way)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    data = DigitsData.load(seed=args.seed)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate, momentum=0.9)
    step = ts.GlobalStep()
    step.bind(optimizer)  # Every optimizer.step() adds 1, like minimize(..., global_step=...).

    # lr = polynomial_decay(learning_rate, global_step, decay_steps, end, power): the scheduler
    # evaluates it at the global step's value, so a restored step gives the restored rate.
    schedule = functools.partial(
        polynomial_decay,
        args.learning_rate,
        decay_steps=args.decay_steps or args.max_steps,
        end_learning_rate=args.end_learning_rate,
        power=args.power,
    )
    scheduler = GlobalStepLR(optimizer, schedule, step)

    # Shadows of the weights, checkpointed as "ema/<parameter>" with the rest of the state.
    ema = ExponentialMovingAverage(args.ema_decay, num_updates=step, name="ema")
    ema.apply(model)

    sv = ts.Supervisor(
        logdir=args.logdir,
        state={
            "model": model,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "global_step": step,
            ema.name: ema,
        },
        save_model_secs=args.save_model_secs,
        save_summaries_secs=5,
    )
    loss_fn = nn.CrossEntropyLoss()

    def train_step() -> tuple[torch.Tensor, float]:
        x, y = data.batch(step.value, args.batch_size, args.seed)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()  # Uses lr = schedule(step); then the step becomes step + 1.
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step()  # The rate of the next step.
        ema.apply(model)
        if args.step_delay_secs:
            time.sleep(args.step_delay_secs)
        return loss.detach(), lr

    with sv.managed_session() as sess:
        if sess.restored_checkpoint:
            print(f"Resumed at step {step.value} from {sess.restored_checkpoint}", flush=True)
        else:
            print(f"Starting from scratch in {args.logdir}", flush=True)
        while not sv.should_stop() and step.value < args.max_steps:
            current = step.value
            loss, lr = sess.run(train_step)
            # A summary's step is the number of steps done: the first step's loss at step 1.
            sv.summary_writer.add_scalar("train/loss", loss, step.value)
            sv.summary_writer.add_scalar("train/learning_rate", lr, step.value)
            if current % args.log_every == 0 or step.value == args.max_steps:
                print(f"step {current} lr {lr!r} loss {loss.item():.4f}", flush=True)

    # Evaluate with the moving averages of the newest checkpoint (the final one, written when
    # the session ended), restored into a fresh copy of the model.
    result = {"step": float(step.value), "accuracy": accuracy(model, data.test_x, data.test_y)}
    checkpoint = ts.latest_checkpoint(args.logdir)
    if checkpoint is not None:
        eval_model = build_model()
        ts.Saver(ema.variables_to_restore(eval_model, prefix="model")).restore(None, checkpoint)
        result["averaged_accuracy"] = accuracy(eval_model, data.test_x, data.test_y)
        print(
            f"Held-out accuracy at step {step.value}: last weights {result['accuracy']:.2%}, "
            f"moving averages {result['averaged_accuracy']:.2%} (from {checkpoint})",
            flush=True,
        )
    return result


if __name__ == "__main__":
    main()
