"""Keep-best retention: the newest ``max_to_keep`` plus the best K by the saved metrics.

Before: both pytorch/examples ports still ``torch.save``d their best model by hand.
"""

from __future__ import annotations

import pytest
import torch
from supervisor_helpers import checkpoint_steps

from torchsupervisor import GlobalStep, Graph, Saver, Session, Supervisor, get_checkpoint_state
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.cli import main


def _save_all(saver, logdir, scores, start=1, key="accuracy"):
    w = torch.zeros(2)
    sess = Session({"w": w})
    for step, score in enumerate(scores, start=start):
        w.fill_(step)
        metrics = None if score is None else {key: score, "step_seconds": 0.1}
        saver.save(sess, str(logdir / "model.ckpt"), global_step=step, metrics=metrics)


def _listed(logdir):
    state = get_checkpoint_state(str(logdir))
    return [int(p.rsplit("-", 1)[1]) for p in state.all_model_checkpoint_paths]


def test_the_newest_and_the_best_are_kept_and_the_state_file_lists_both(tmp_path):
    saver = Saver(max_to_keep=2, keep_best=1, best_fn="accuracy")
    _save_all(saver, tmp_path, [0.5, 0.9, 0.6, 0.7, None, 0.8])
    assert checkpoint_steps(tmp_path) == [2, 5, 6]  # Step 2 is the best; 5 and 6 the newest.
    assert _listed(tmp_path) == [2, 5, 6]
    assert saver.last_checkpoints[0].endswith("model.ckpt-2")
    best = CheckpointReader(str(tmp_path / "model.ckpt-2"))
    assert best.manifest.metrics == {"accuracy": 0.9, "step_seconds": 0.1}
    assert best.get_tensor("w").tolist() == [2.0, 2.0]
    # A better one displaces it, once it is no longer among the newest.
    _save_all(saver, tmp_path, [0.95, 0.1], start=7)
    assert checkpoint_steps(tmp_path) == [7, 8]  # 7 is the best and among the newest.
    _save_all(saver, tmp_path, [0.2], start=9)
    assert checkpoint_steps(tmp_path) == [7, 8, 9]


def test_min_mode_a_function_and_several_best(tmp_path):
    saver = Saver(max_to_keep=1, keep_best=2, best_fn=lambda m: m["loss"] * 2, best_mode="min")
    _save_all(saver, tmp_path, [3.0, 1.0, 2.0, 0.5, 4.0], key="loss")
    assert checkpoint_steps(tmp_path) == [2, 4, 5]  # Losses 1.0 and 0.5, and the newest.


def test_a_restarted_saver_never_deletes_the_best_of_the_last_run(tmp_path):
    first = Saver(max_to_keep=2, keep_best=1, best_fn="accuracy")
    _save_all(first, tmp_path, [0.5, 0.99, 0.6, 0.7])
    assert checkpoint_steps(tmp_path) == [2, 3, 4]
    # A new process: the state file's list, ranked again from the manifests' metrics.
    second = Saver(max_to_keep=2, keep_best=1, best_fn="accuracy")
    second.recover_last_checkpoints(get_checkpoint_state(str(tmp_path)).all_model_checkpoint_paths)
    _save_all(second, tmp_path, [0.1, 0.2, 0.3], start=5)
    assert checkpoint_steps(tmp_path) == [2, 6, 7]


def test_the_supervisor_checkpoints_with_metrics_and_keeps_the_best_across_a_restart(tmp_path):
    def run(accuracies):
        step = GlobalStep()
        state = {"w": torch.zeros(1), "global_step": step}
        saver = Saver(max_to_keep=1, keep_best=1, best_fn="accuracy")
        sv = Supervisor(
            graph=Graph(), logdir=str(tmp_path), state=state, saver=saver, save_model_secs=3600
        )
        with sv.managed_session() as sess:
            for accuracy in accuracies:
                sess.run(step.increment)
                sv.checkpoint(metrics={"accuracy": torch.tensor(accuracy)})  # An epoch's test.
        return step.value

    assert run([0.3, 0.8, 0.5]) == 3
    assert checkpoint_steps(tmp_path) == [2, 3]
    assert run([0.4, 0.6]) == 5  # Resumed at 3; nothing better than step 2's 0.8.
    assert checkpoint_steps(tmp_path) == [2, 5]


def test_ls_shows_the_metrics(tmp_path, capsys):
    saver = Saver(max_to_keep=1, keep_best=1, best_fn="accuracy")
    _save_all(saver, tmp_path, [0.9, 0.2])
    assert main(["ls", str(tmp_path), "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert "METRICS" in out and "accuracy=0.9 step_seconds=0.1" in out
    assert out.count("max_to_keep/best") == 2


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="keep_best needs best_fn"):
        Saver(keep_best=1)
    with pytest.raises(ValueError, match="best_mode must be 'max' or 'min'"):
        Saver(keep_best=1, best_fn="acc", best_mode="highest")
    with pytest.raises(TypeError, match="keep_best"):
        Saver(keep_best="1", best_fn="acc")
    saver = Saver(keep_best=1, best_fn="acc")
    with pytest.raises(ValueError, match="metric 'acc' is not finite"):
        saver.save(
            Session({"w": torch.zeros(1)}), str(tmp_path / "m"), metrics={"acc": float("nan")}
        )
    with pytest.raises(TypeError, match="metric 'acc' must be a number"):
        saver.save(Session({"w": torch.zeros(1)}), str(tmp_path / "m"), metrics={"acc": "high"})
