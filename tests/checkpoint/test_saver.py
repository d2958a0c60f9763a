"""Saver: save/restore round trips, TF's naming, errors and retention, async saves."""

from __future__ import annotations

import os

import numpy as np
import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

from torchsupervisor import GlobalStep, Saver, Session, get_checkpoint_state, latest_checkpoint
from torchsupervisor.checkpoint.reader import CheckpointReader
from torchsupervisor.errors import CheckpointSaveError, InvalidArgumentError, NotFoundError
from torchsupervisor.storage.lock import LOCK_FILENAME
from torchsupervisor.testing import FakeClock


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _trained_state():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 6)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "global_step": GlobalStep(3),
        "buffer": torch.arange(4, dtype=torch.int32),
        "array": np.linspace(0, 1, 5),
        "extra": {"epoch": 2, "note": "hi", "lrs": [0.1, 0.01]},
    }


def _files(directory):
    return sorted(n for n in os.listdir(directory) if n != LOCK_FILENAME)


def test_round_trip_restores_every_kind_of_state(tmp_path):
    state = _trained_state()
    sess = Session(state)
    saver = Saver()
    prefix = saver.save(sess, str(tmp_path / "model.ckpt"), global_step=state["global_step"])
    assert prefix == str(tmp_path / "model.ckpt-3")
    assert _files(tmp_path) == [
        "checkpoint",
        "model.ckpt-3.data-00000-of-00001",
        "model.ckpt-3.index",
    ]
    expected_model = {k: v.clone() for k, v in state["model"].state_dict().items()}
    expected_opt = state["optimizer"].state_dict()
    expected_sched = state["scheduler"].state_dict()

    fresh = _trained_state()
    for p in fresh["model"].parameters():
        p.data.fill_(0.5)
    fresh["global_step"].assign(99)
    fresh["buffer"].zero_()
    fresh["array"][:] = -1
    fresh["extra"] = {"epoch": 0}
    saver.restore(Session(fresh), prefix)

    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, expected_model[k]), k
    restored_opt = fresh["optimizer"].state_dict()
    assert restored_opt["param_groups"] == expected_opt["param_groups"]
    for pid, values in expected_opt["state"].items():
        for name, value in values.items():
            assert torch.equal(restored_opt["state"][pid][name], value)
    assert fresh["scheduler"].state_dict() == expected_sched
    assert fresh["global_step"].value == 3
    assert torch.equal(fresh["buffer"], torch.arange(4, dtype=torch.int32))
    np.testing.assert_array_equal(fresh["array"], np.linspace(0, 1, 5))
    assert fresh["extra"] == {"epoch": 2, "note": "hi", "lrs": [0.1, 0.01]}


def test_restored_optimizer_state_continues_identically(tmp_path):
    state = _trained_state()
    saver = Saver()
    prefix = saver.save(Session(state), str(tmp_path / "m"), global_step=3)
    other = _trained_state()
    saver.restore(Session(other), prefix)
    x = torch.randn(5, 6)
    for s in (state, other):
        s["optimizer"].zero_grad()
        s["model"](x).pow(2).mean().backward()
        s["optimizer"].step()
    for a, b in zip(state["model"].parameters(), other["model"].parameters()):
        assert torch.equal(a, b)


def test_shards_are_plain_safetensors_files(tmp_path):
    state = _trained_state()
    prefix = Saver().save(Session(state), str(tmp_path / "m"), global_step=1)
    shard = prefix + ".data-00000-of-00001"
    with safe_open(shard, "pt") as f:
        assert torch.equal(f.get_tensor("model/0.weight"), state["model"][0].weight)
        assert f.metadata() == {"format": "pt"}
    loaded = safetensors.torch.load_file(shard)
    assert torch.equal(loaded["buffer"], state["buffer"])
    # Every tensor the reader lists is in the shard, but the step (kept in the manifest).
    listed = set(CheckpointReader(prefix).get_variable_to_shape_map())
    assert set(loaded) == listed - {"global_step"}


@pytest.mark.parametrize("relative", [True, False])
def test_state_file_is_tf_text_format_relative_by_default(tmp_path, relative):
    saver = Saver(max_to_keep=2) if relative else Saver(max_to_keep=2, save_relative_paths=False)
    sess = Session({"w": torch.zeros(2)})
    for step in (100, 200, 300):
        saver.save(sess, str(tmp_path / "model.ckpt"), global_step=step)
    text = (tmp_path / "checkpoint").read_text()
    where = "" if relative else f"{tmp_path}/"
    assert text == (
        f'model_checkpoint_path: "{where}model.ckpt-300"\n'
        f'all_model_checkpoint_paths: "{where}model.ckpt-200"\n'
        f'all_model_checkpoint_paths: "{where}model.ckpt-300"\n'
    )
    assert not os.path.exists(tmp_path / "model.ckpt-100.index")
    assert saver.last_checkpoints == [
        str(tmp_path / "model.ckpt-200"),
        str(tmp_path / "model.ckpt-300"),
    ]


def test_save_takes_tfs_arguments_in_tfs_order(tmp_path):
    # Ported code passes TF's meta-graph options, by keyword or by position: accepted, no file.
    saver = Saver()
    sess = Session({"w": torch.ones(2)})
    prefix = saver.save(sess, str(tmp_path / "m"), 1, None, "meta", False, False)
    assert not os.path.exists(os.path.join(tmp_path, "checkpoint"))  # write_state=False
    assert saver.save(sess, str(tmp_path / "m"), 2, write_meta_graph=True) == prefix[:-1] + "2"
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".meta")]
    assert latest_checkpoint(str(tmp_path)) == prefix[:-1] + "2"


def test_save_relative_paths(tmp_path):
    saver = Saver(save_relative_paths=True)
    saver.save(Session({"w": torch.zeros(1)}), str(tmp_path / "model.ckpt"), global_step=5)
    assert (tmp_path / "checkpoint").read_text() == (
        'model_checkpoint_path: "model.ckpt-5"\nall_model_checkpoint_paths: "model.ckpt-5"\n'
    )
    assert get_checkpoint_state(str(tmp_path)).model_checkpoint_path == str(
        tmp_path / "model.ckpt-5"
    )


def test_max_to_keep_deletes_oldest_first(tmp_path):
    saver = Saver(max_to_keep=3)
    w = torch.zeros(1)
    sess = Session({"w": w})
    kept = []
    for step in range(6):
        w.add_(1)  # Training changes the state between checkpoints.
        kept.append(saver.save(sess, str(tmp_path / "m"), global_step=step))
        assert saver.last_checkpoints == kept[-3:]
        for old in kept[:-3]:
            assert not os.path.exists(old + ".index")
            assert not os.path.exists(old + ".data-00000-of-00001")
        for live in kept[-3:]:
            assert os.path.exists(live + ".index")


@pytest.mark.parametrize("max_to_keep", [0, None])
def test_max_to_keep_zero_or_none_keeps_everything(tmp_path, max_to_keep):
    saver = Saver(max_to_keep=max_to_keep)
    sess = Session({"w": torch.zeros(1)})
    for step in range(4):
        saver.save(sess, str(tmp_path / "m"), global_step=step)
    assert saver.last_checkpoints == []
    assert len([f for f in _files(tmp_path) if f.endswith(".index")]) == 4
    state = get_checkpoint_state(str(tmp_path))
    assert list(state.all_model_checkpoint_paths) == [str(tmp_path / "m-3")]


def test_keep_checkpoint_every_n_hours(tmp_path, fake_clock):
    # Keep one checkpoint every 0.7 s; max_to_keep=2. Saves one second apart.
    saver = Saver(max_to_keep=2, keep_checkpoint_every_n_hours=0.7 / 3600, clock=fake_clock)
    sess = Session({"w": torch.zeros(1)})
    prefixes = []
    for step in range(5):
        prefixes.append(saver.save(sess, str(tmp_path / "m"), global_step=step))
        fake_clock.advance(1.0)
    exists = [os.path.exists(p + ".index") for p in prefixes]
    # m-0 (saved before the first 0.7 s passed) is deleted; m-1 and m-2 are preserved for good;
    # m-3 and m-4 are the two tracked ones.
    assert exists == [False, True, True, True, True]
    assert saver.last_checkpoints == prefixes[3:]


def test_pad_step_number_and_no_step(tmp_path):
    saver = Saver(pad_step_number=True)
    sess = Session({"w": torch.zeros(1)})
    assert saver.save(sess, str(tmp_path / "m"), global_step=42) == str(tmp_path / "m-00000042")
    assert saver.save(sess, str(tmp_path / "m")) == str(tmp_path / "m")
    assert CheckpointReader(str(tmp_path / "m")).global_step is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(latest_filename="sub/checkpoint"), "must not contain path components"),
        (dict(save_path_name="checkpoint"), "collides with 'save_path'"),
    ],
)
def test_save_argument_errors(tmp_path, kwargs, match):
    name = kwargs.pop("save_path_name", "m")
    with pytest.raises(ValueError, match=match):
        Saver().save(Session({"w": torch.zeros(1)}), str(tmp_path / name), **kwargs)


def test_missing_parent_directory(tmp_path):
    path = str(tmp_path / "nope" / "model.ckpt")
    with pytest.raises(ValueError, match=r"Parent directory of .*nope/model.ckpt doesn't exist"):
        Saver().save(Session({"w": torch.zeros(1)}), path)
    # save_async leaves the check to its writer: the same text, through the future.
    saver = Saver()
    sess = Session({"w": torch.zeros(1)})
    future = saver.save_async(sess, path, global_step=1)
    with pytest.raises(CheckpointSaveError, match=r"Parent directory of .*nope/model.ckpt doesn't"):
        future.result(timeout=60)
    assert not os.path.exists(os.path.dirname(path))
    os.makedirs(os.path.dirname(path))  # The failed save released its buffers: the next works.
    assert saver.save_async(sess, path, global_step=2).result(timeout=60) == path + "-2"


def test_empty_state(tmp_path):
    with pytest.raises(ValueError, match="No variables to save"):
        Saver({})
    with pytest.raises(ValueError, match="No variables to save"):
        Saver().save(Session({}), str(tmp_path / "m"))
    assert Saver(allow_empty=True).save(Session({}), str(tmp_path / "m")) is None
    assert _files(tmp_path) == []


def test_restore_errors(tmp_path):
    saver = Saver()
    sess = Session({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"Can't load save_path when it is None\."):
        saver.restore(sess, None)
    with pytest.raises(ValueError, match="The passed save_path is not a valid checkpoint: "):
        saver.restore(sess, str(tmp_path / "missing"))
    prefix = saver.save(sess, str(tmp_path / "m"), global_step=1)
    with pytest.raises(NotFoundError, match="Key other not found in checkpoint"):
        Saver().restore(Session({"other": torch.zeros(2)}), prefix)
    with pytest.raises(InvalidArgumentError, match=r"Shape of 'w' .*\(3,\).*\(2,\)"):
        Saver().restore(Session({"w": torch.zeros(3)}), prefix)


def test_module_mismatch_is_a_clear_error(tmp_path):
    prefix = Saver().save(Session({"model": nn.Linear(2, 2)}), str(tmp_path / "m"))
    with pytest.raises(InvalidArgumentError, match=r"Shape of 'model/weight' .*\(3, 2\).*m: "):
        Saver().restore(Session({"model": nn.Linear(2, 3)}), prefix)
    with pytest.raises(InvalidArgumentError, match=r"Restoring 'model' from .*m failed: miss"):
        Saver().restore(Session({"model": nn.Linear(2, 2, bias=False)}), prefix)


def _rewrite_manifest(prefix, **changes):
    """Change fields of a checkpoint's manifest (its own checksum recomputed)."""
    import dataclasses

    from torchsupervisor.checkpoint.format import Manifest

    with open(prefix + ".index", "rb") as f:
        manifest = Manifest.from_bytes(f.read())
    with open(prefix + ".index", "wb") as f:
        f.write(dataclasses.replace(manifest, **changes).to_bytes())


def _values(state):
    return {
        name: {k: v.clone() for k, v in obj.state_dict().items()}
        if isinstance(obj, nn.Module)
        else obj.clone()
        for name, obj in state.items()
    }


def _assert_untouched(state, before):
    for name, obj in state.items():
        if isinstance(obj, nn.Module):
            for k, v in obj.state_dict().items():
                assert torch.equal(v, before[name][k]), (name, k)
        else:
            assert torch.equal(obj, before[name]), name


def test_a_shape_mismatch_is_found_before_anything_is_loaded(tmp_path):
    torch.manual_seed(0)
    saved = {"a": torch.ones(2), "model": nn.Linear(4, 2), "z": torch.ones(3)}
    prefix = Saver().save(Session(saved), str(tmp_path / "m"), global_step=7)
    # "a" comes first and fits; the module does not (another output width): nothing loads.
    live = {"a": torch.zeros(2), "model": nn.Linear(4, 5), "z": torch.zeros(3)}
    before = _values(live)
    with pytest.raises(InvalidArgumentError) as info:
        Saver().restore(Session(live), prefix)
    message = str(info.value)
    assert "'model/weight'" in message and prefix in message
    assert "(5, 4)" in message and "(2, 4)" in message
    _assert_untouched(live, before)
    # A bare tensor last in the state, the same.
    live = {"a": torch.zeros(2), "model": nn.Linear(4, 2), "z": torch.zeros(4)}
    before = _values(live)
    with pytest.raises(InvalidArgumentError, match=r"Shape of 'z' in the state \(4,\) .*: \(3,\)"):
        Saver().restore(Session(live), prefix)
    _assert_untouched(live, before)
    # A missing entry, the same.
    live = {
        "a": torch.zeros(2),
        "model": nn.Linear(4, 2),
        "z": torch.zeros(3),
        "new": torch.ones(1),
    }
    before = _values(live)
    with pytest.raises(NotFoundError, match="Key new not found in checkpoint"):
        Saver().restore(Session(live), prefix)
    _assert_untouched(live, before)


def test_a_dtype_change_warns_and_converts(tmp_path, caplog):
    prefix = Saver().save(
        Session({"w": torch.full((3,), 1.5), "model": nn.Linear(2, 2)}), str(tmp_path / "m")
    )
    w = torch.zeros(3, dtype=torch.float64)
    model = nn.Linear(2, 2).double()
    with caplog.at_level("WARNING", "torchsupervisor"):
        Saver().restore(Session({"w": w, "model": model}), prefix)
    assert torch.equal(w, torch.full((3,), 1.5, dtype=torch.float64))
    assert model.weight.dtype == torch.float64
    text = caplog.text
    assert f"Dtype of 'w' changed: float32 in checkpoint {prefix}, float64 in the state" in text
    assert "Dtype of 'model/weight' changed: float32" in text
    # Towards a lower kind (floating saved, integer live) values would be truncated: an error.
    counts = torch.zeros(3, dtype=torch.int64)
    live = {"model": nn.Linear(2, 2), "w": counts}
    before = _values(live)
    with pytest.raises(InvalidArgumentError, match=r"Dtype of 'w' in the state \(int64\)"):
        Saver().restore(Session(live), prefix)
    _assert_untouched(live, before)


def test_another_world_size_or_version_is_a_warning_naming_both(tmp_path, caplog):
    from torchsupervisor import __version__

    w = torch.ones(2)
    prefix = Saver().save(Session({"w": w}), str(tmp_path / "m"))
    _rewrite_manifest(prefix, world_size=4, torch_version="1.13.1", library_version="0.0.1")
    with caplog.at_level("WARNING", "torchsupervisor"):
        Saver().restore(Session({"w": torch.zeros(2)}), prefix)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"Checkpoint {prefix} was written by 4 replicas; this run has 1" in warnings
    assert (
        f"Checkpoint {prefix} was written with torch 1.13.1; this is torch {torch.__version__}"
        in warnings
    )
    assert (
        f"Checkpoint {prefix} was written with torchsupervisor 0.0.1; this is "
        f"torchsupervisor {__version__}" in warnings
    )
    caplog.clear()
    same = Saver().save(Session({"w": w}), str(tmp_path / "same"))
    with caplog.at_level("WARNING", "torchsupervisor"):
        Saver().restore(Session({"w": torch.zeros(2)}), same)
    assert not caplog.records


def test_unsaveable_state_is_rejected_with_its_path(tmp_path):
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"'extra/thing'.*Opaque"):
        Saver().save(Session({"extra": {"thing": Opaque()}}), str(tmp_path / "m"))
    with torch.device("meta"):
        lazy = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'model/weight': it is not initialized"):
        Saver().save(Session({"model": lazy}), str(tmp_path / "m"))
    assert _files(tmp_path) == []


def test_var_list_mapping_and_names(tmp_path):
    model = _model()
    full = Saver().save(Session({"model": model, "gs": GlobalStep(7)}), str(tmp_path / "full"))
    # A saver for a sub-module restores it from the full model's checkpoint.
    backbone = _model()[0]
    with torch.no_grad():
        backbone.weight.zero_()
    Saver({"model/0": backbone}).restore(None, full)
    assert torch.equal(backbone.weight, model[0].weight)
    # A list of names picks entries of the session state.
    state = {"model": _model(), "gs": GlobalStep(0)}
    Saver(["gs"]).restore(Session(state), full)
    assert state["gs"].value == 7
    only = Saver(["gs"]).save(Session(state), str(tmp_path / "only"))
    assert set(CheckpointReader(only).manifest.tree["dict"]) == {"gs"}
    with pytest.raises(ValueError, match=r"\['nope'\]"):
        Saver(["nope"]).save(Session(state), str(tmp_path / "x"))


def test_bare_tensor_is_restored_in_place(tmp_path):
    weight = torch.arange(6.0).reshape(2, 3)
    prefix = Saver({"w": weight}).save(None, str(tmp_path / "m"))
    target = torch.zeros(2, 3)
    keep = target.data_ptr()
    Saver({"w": target}).restore(None, prefix)
    assert torch.equal(target, weight) and target.data_ptr() == keep


def test_saving_the_same_step_again_replaces_the_checkpoint(tmp_path):
    w = torch.zeros(4)
    saver = Saver(max_to_keep=2)
    sess = Session({"w": w})
    first = saver.save(sess, str(tmp_path / "m"), global_step=1)
    w.fill_(7)
    second = saver.save(sess, str(tmp_path / "m"), global_step=1)
    assert first == second
    assert saver.last_checkpoints == [first]
    assert torch.equal(CheckpointReader(first).get_tensor("w"), torch.full((4,), 7.0))
    assert not [f for f in _files(tmp_path) if ".tmp" in f]


def test_sharded_save_and_shard_count_change(tmp_path):
    state = {f"t{i}": torch.full((256,), float(i)) for i in range(6)}  # 1 KiB each
    saver = Saver(max_shard_bytes=2048)
    prefix = saver.save(Session(state), str(tmp_path / "m"), global_step=1)
    data = [f for f in _files(tmp_path) if ".data-" in f]
    assert data == [f"m-1.data-0000{i}-of-00003" for i in range(3)]
    restored = {k: torch.zeros(256) for k in state}
    Saver().restore(Session(restored), prefix)
    assert all(torch.equal(restored[k], state[k]) for k in state)
    Saver().save(Session(state), str(tmp_path / "m"), global_step=1)  # Same prefix, 1 shard.
    assert [f for f in _files(tmp_path) if ".data-" in f] == ["m-1.data-00000-of-00001"]


def test_sharded_true_splits_at_the_default_shard_size(tmp_path, monkeypatch):
    import torchsupervisor.checkpoint.saver as saver_module

    assert saver_module.DEFAULT_MAX_SHARD_BYTES == 1 << 30
    monkeypatch.setattr(saver_module, "DEFAULT_MAX_SHARD_BYTES", 2048)
    state = {f"t{i}": torch.full((256,), float(i)) for i in range(6)}  # 1 KiB each
    Saver(sharded=True).save(Session(state), str(tmp_path / "m"), global_step=1)
    assert len([f for f in _files(tmp_path) if ".data-" in f]) == 3
    Saver().save(Session(state), str(tmp_path / "m"), global_step=2)  # Not sharded: one file.
    assert [f for f in _files(tmp_path) if "m-2.data-" in f] == ["m-2.data-00000-of-00001"]


def test_save_async_snapshot_is_isolated_from_later_training(tmp_path):
    w = torch.zeros(1 << 16)
    saver = Saver()
    future = saver.save_async(Session({"w": w}), str(tmp_path / "m"), global_step=1)
    w.fill_(1.0)  # The next step mutates the state while the save is being written.
    prefix = future.result(timeout=60)
    assert not saver.in_flight
    assert torch.equal(CheckpointReader(prefix).get_tensor("w"), torch.zeros(1 << 16))


def test_one_save_in_flight_then_the_next(tmp_path):
    saver = Saver(max_to_keep=10)
    sess = Session({"w": torch.zeros(1000)})
    futures = [saver.save_async(sess, str(tmp_path / "m"), global_step=i) for i in range(4)]
    assert [f.result(timeout=60) for f in futures] == [str(tmp_path / f"m-{i}") for i in range(4)]
    assert saver.last_checkpoints == [f.result() for f in futures]


def test_set_and_recover_last_checkpoints(tmp_path):
    saver = Saver(max_to_keep=2)
    sess = Session({"w": torch.zeros(1)})
    a = saver.save(sess, str(tmp_path / "m"), global_step=1)
    b = saver.save(sess, str(tmp_path / "m"), global_step=2)
    other = Saver(max_to_keep=2)
    other.recover_last_checkpoints([a, str(tmp_path / "m-77"), b])
    assert other.last_checkpoints == [a, b]
    c = other.save(sess, str(tmp_path / "m"), global_step=3)  # Continues deleting across runs.
    assert not os.path.exists(a + ".index") and other.last_checkpoints == [b, c]
    other.set_last_checkpoints_with_time([(a, 1.0), (b, 2.0)])
    assert other.last_checkpoints == [a, b]
    other.set_last_checkpoints([c])
    assert other.last_checkpoints == [c]


def test_mtimes_of_recovered_checkpoints_are_used(tmp_path):
    sess = Session({"w": torch.zeros(1)})
    old, older = (Saver().save(sess, str(tmp_path / "m"), global_step=s) for s in (2, 1))
    os.utime(older + ".index", (100.0, 100.0))
    os.utime(old + ".index", (1000.0, 1000.0))
    # The Saver starts at wall time 0 and keeps one checkpoint each 0.1 h (360 s) for good.
    clock = FakeClock(start_secs=0.0, epoch_secs=0.0)
    other = Saver(max_to_keep=1, keep_checkpoint_every_n_hours=0.1, clock=clock)
    other.recover_last_checkpoints([older, old])
    clock.advance(2000.0)
    other.save(sess, str(tmp_path / "m"), global_step=3)
    # Only the files' times tell them apart: 1000 s is past the first 360 s, 100 s is not.
    assert os.path.exists(old + ".index") and not os.path.exists(older + ".index")


def test_save_does_not_keep_the_training_thread_waiting_for_io(tmp_path):
    # Not a timing test of speed: it checks that save_async returns before the write ends,
    # using a storage whose fsync waits for the test to open a gate.
    from torchsupervisor.testing import GatedStorage

    storage = GatedStorage()
    gate = storage.hold("fsync", times=None)
    saver = Saver(storage=storage)
    future = saver.save_async(Session({"w": torch.ones(8)}), str(tmp_path / "m"), global_step=1)
    assert gate.reached.wait(60)  # The writer is in the middle of the write.
    assert not future.done() and saver.in_flight
    gate.open()
    assert future.result(timeout=60) == str(tmp_path / "m-1")


def test_restore_reports_what_differs(tmp_path, caplog):
    prefix = Saver().save(Session({"w": torch.zeros(2), "old": torch.ones(1)}), str(tmp_path / "m"))
    with caplog.at_level("WARNING", "torchsupervisor"):
        Saver().restore(Session({"w": torch.zeros(2)}), prefix)
    assert "has entries the state does not use: ['old']" in caplog.text
    # An entry added to the run later may be missing from older checkpoints when allowed.
    saver = Saver()
    with pytest.raises(NotFoundError, match="Key extra not found"):
        saver.restore(Session({"w": torch.zeros(2), "extra": torch.zeros(1)}), prefix)
    saver.allow_missing("extra")
    extra = torch.full((1,), 5.0)
    saver.restore(Session({"w": torch.zeros(2), "extra": extra, "old": torch.zeros(1)}), prefix)
    assert extra.item() == 5.0 and "has no 'extra' entry" in caplog.text
    assert CheckpointReader(prefix).manifest.world_size == 1


@pytest.mark.parametrize("save", ["save", "save_async"])
def test_a_negative_global_step_is_refused_before_anything_is_written(tmp_path, save):
    # The manifest records the steps taken; a negative one could never be read back.
    saver = Saver({"w": torch.zeros(2)})
    with pytest.raises(
        ValueError, match="global_step must be 0 or more to save a checkpoint, got -1"
    ):
        getattr(saver, save)(None, str(tmp_path / "model.ckpt"), global_step=GlobalStep(-1))
    assert [n for n in os.listdir(tmp_path) if n != LOCK_FILENAME] == []
