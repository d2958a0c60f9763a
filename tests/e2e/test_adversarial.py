"""Adversarial classes as randomized trials (``make test-slow``): nothing may lose work.

Each class runs many trials with a fixed seed and counts failures (printed at the end of the
run, see ``adversarial_record``); its test fails if any trial failed.

Damage classes (in process, on a copy of a log directory holding five checkpoints, incremental
ones among them, and an events file): corruption of a random file at random offsets,
truncation, a missing file, hostile manifests and links, non-regular files in place of
regular ones. Each trial checks that the restart restores exactly one step's state from a
checkpoint no damage touched, the first such one in the order a restart tries them, within
seconds; that ``verify`` predicts that same checkpoint; and that the damaged files are never
loaded.

Process classes: a full disk on a small tmpfs (as root only), a read-only logdir (as root
only), two writers on one logdir, SIGTERM and SIGINT at random moments, SIGKILL at random
moments (``test_crash_torture``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import adversarial_record
import pytest
import torch
from repo_paths import worker
from supervisor_helpers import committed_steps

import torchsupervisor as ts
from torchsupervisor import CheckpointReader, Saver, Session
from torchsupervisor.checkpoint.format import Manifest
from torchsupervisor.checkpoint.recovery import plan_restore
from torchsupervisor.cli import main as cli_main
from torchsupervisor.errors import DataLossError
from torchsupervisor.storage import is_temporary_name
from torchsupervisor.summary import SummaryWriter

pytestmark = pytest.mark.slow

TORTURE_WORKER = worker("torture_worker.py")
TRIALS = 40
FALLBACK_SECS = 10.0
SIZE = 1000
FROZEN = torch.randn(20_000, generator=torch.Generator().manual_seed(3))


def _state(step: ts.GlobalStep, frozen: torch.Tensor) -> dict:
    return {"w": torch.zeros(SIZE), "frozen": frozen, "global_step": step}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A logdir with checkpoints of steps 2..6 (max_to_keep 5; incremental saves reference
    the frozen tensor of full ones) and an events file."""
    logdir = tmp_path_factory.mktemp("template")
    step = ts.GlobalStep()
    state = _state(step, FROZEN.clone())
    saver = Saver(max_to_keep=5)
    sess = Session(state)
    for _ in range(6):
        step.increment()
        state["w"].fill_(float(step.value))
        saver.save(sess, str(logdir / "model.ckpt"), step)
    saver.close()
    with SummaryWriter(logdir) as writer:
        for s in range(50):
            writer.add_scalar("loss", 1.0 / (s + 1), s)
    return logdir


def _uses(logdir: str) -> dict[str, set[str]]:
    """For every committed checkpoint, the files a restore of it reads."""
    out = {}
    for prefix in plan_restore(logdir).candidates:
        manifest = CheckpointReader(prefix).manifest
        used = {manifest.shards[e.shard].file for e in manifest.tensors.values()}
        out[prefix] = {os.path.basename(prefix) + ".index", *used}
    return out


def _verify_prediction(logdir: str) -> str | None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli_main(["verify", logdir])
    for line in out.getvalue().splitlines():
        if line.startswith("A restart restores "):
            return line.removeprefix("A restart restores ").split(" (")[0].rstrip(".")
        if " and fall back to " in line:
            return line.split(" and fall back to ")[1].split(" (")[0].rstrip(".,")
    return None


def _restart(logdir: str) -> tuple[str | None, str | None]:
    """Restart on ``logdir``; return (restored prefix or None, what is wrong or None)."""
    step = ts.GlobalStep()
    state = _state(step, torch.zeros(FROZEN.numel()))
    sv = ts.Supervisor(
        logdir=logdir,
        state=state,
        saver=Saver(max_to_keep=5),
        save_model_secs=3600,
        save_summaries_secs=0,
        save_rng_state=False,
    )
    try:
        with sv.managed_session() as sess:
            restored = sess.restored_checkpoint
    except DataLossError:
        return None, None
    if restored is None:
        return None, None
    if not (state["w"] == float(step.value)).all():
        return restored, f"restored {restored} does not hold one step's state"
    if not torch.equal(state["frozen"], FROZEN):
        return restored, f"restored {restored} has a wrong frozen tensor"
    return restored, None


def _files_of(logdir: str, prefix: str) -> list[str]:
    base = os.path.basename(prefix)
    return sorted(n for n in os.listdir(logdir) if n.startswith(base + "."))


def _pick_target(rng: random.Random, logdir: str, allow_state_file=True) -> str:
    candidates = plan_restore(logdir).candidates
    if allow_state_file and rng.random() < 0.15:
        return os.path.join(logdir, "checkpoint")
    prefix = candidates[0] if rng.random() < 0.5 else rng.choice(candidates)
    return os.path.join(logdir, rng.choice(_files_of(logdir, prefix)))


def _corrupt(rng, logdir):
    if rng.random() < 0.1:
        events = [n for n in os.listdir(logdir) if n.startswith("events.out")]
        path = os.path.join(logdir, rng.choice(events))
    else:
        path = _pick_target(rng, logdir)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(data))
        data[i] ^= rng.randint(1, 255)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _truncate(rng, logdir):
    path = _pick_target(rng, logdir)
    size = os.path.getsize(path)
    os.truncate(path, rng.randrange(size) if size else 0)
    return path


def _remove(rng, logdir):
    path = _pick_target(rng, logdir)
    os.remove(path)
    return path


def _non_regular(rng, logdir):
    path = _pick_target(rng, logdir)
    os.remove(path)
    kind = rng.choice(["fifo", "directory", "/dev/zero", "/dev/null", "/dev/urandom"])
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    else:
        os.symlink(kind, path)
    return path


def _hostile(rng, logdir):
    candidates = plan_restore(logdir).candidates
    prefix = candidates[0] if rng.random() < 0.5 else rng.choice(candidates)
    index = prefix + ".index"
    with open(index, "rb") as f:
        manifest = Manifest.from_bytes(f.read())
    kind = rng.choice(["parent", "absolute", "link_out", "huge", "deep", "nested_dir"])
    if kind == "link_out":
        own = [n for n in _files_of(logdir, prefix) if ".data-" in n]
        if own:
            shard = os.path.join(logdir, own[0])
            outside = os.path.join(os.path.dirname(logdir), f"outside-{rng.random()}")
            os.replace(shard, outside)
            os.symlink(outside, shard)
            return shard
        kind = "parent"
    if kind in ("parent", "absolute", "nested_dir"):
        name = {
            "parent": "../" + manifest.shards[0].file,
            "absolute": os.path.join(logdir, manifest.shards[0].file),
            "nested_dir": "sub/" + manifest.shards[0].file,
        }[kind]
        shards = (dataclasses.replace(manifest.shards[0], file=name), *manifest.shards[1:])
        manifest = dataclasses.replace(manifest, shards=shards)
    elif kind == "huge":
        name, entry = rng.choice(sorted(manifest.tensors.items()))
        huge = rng.choice([1 << 33, 1 << 40, 1 << 50])
        itemsize = entry.dtype.itemsize
        tensors = dict(manifest.tensors)
        tensors[name] = dataclasses.replace(
            entry, shape=(huge // itemsize,), end=entry.begin + huge // itemsize * itemsize
        )
        shard = manifest.shards[entry.shard]
        shards = list(manifest.shards)
        shards[entry.shard] = dataclasses.replace(shard, size_bytes=shard.data_offset + 2 * huge)
        manifest = dataclasses.replace(manifest, tensors=tensors, shards=tuple(shards))
    else:
        nested = None
        for _ in range(rng.randint(70, 900)):
            nested = [nested]
        manifest = dataclasses.replace(manifest, tree={"dict": {"deep": nested}})
    with open(index, "wb") as f:
        f.write(manifest.to_bytes())
    return index


DAMAGE = {
    "corruption at random offsets": _corrupt,
    "truncation": _truncate,
    "missing file": _remove,
    "hostile manifest or link": _hostile,
    "non-regular file": _non_regular,
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_never_loads_a_broken_checkpoint(template, tmp_path, kind):
    rng = random.Random(f"{kind}-20261125")
    for trial in range(TRIALS):
        logdir = str(tmp_path / f"trial{trial}")
        shutil.copytree(template, logdir, symlinks=True)
        uses = _uses(logdir)
        damaged = DAMAGE[kind](rng, logdir)
        name = os.path.basename(damaged)
        start = time.monotonic()
        prediction = _verify_prediction(logdir)
        restored, wrong = _restart(logdir)
        elapsed = time.monotonic() - start
        order = plan_restore(logdir).candidates
        intact = [p for p in order if name not in uses.get(p, {name})]
        expected = intact[0] if intact else None
        failure = None
        if wrong:
            failure = wrong
        elif restored != expected:
            failure = f"restored {restored}, expected {expected}"
        elif (os.path.basename(restored) if restored else None) != prediction:
            failure = f"verify predicted {prediction}, the restart restored {restored}"
        elif elapsed > FALLBACK_SECS:
            failure = f"took {elapsed:.1f} s"
        adversarial_record.record(kind, None if failure is None else f"{name}: {failure}")
    assert not adversarial_record.FAILURES[kind], adversarial_record.FAILURES[kind]


# ------------------------------------------------------------------------ process classes


def _worker(logdir, *args, **kwargs):
    return subprocess.Popen(
        [sys.executable, TORTURE_WORKER, logdir, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


_committed = committed_steps


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signals_at_random_moments_stop_with_a_final_checkpoint(tmp_path, sig):
    kind = f"{sig.name} at random moments"
    rng = random.Random(f"{kind}-20261125")
    logdir = str(tmp_path)
    expected = 0
    for _ in range(15):
        proc = _worker(logdir)
        failure = None
        try:
            restored = proc.stdout.readline().split()
            if restored != ["RESTORED", str(expected), "True"]:
                failure = f"restart gave {restored}, expected step {expected}"
            proc.stdout.readline()  # TRAINING
            time.sleep(rng.uniform(0.0, 1.0))
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        stopped = [line.split()[1] for line in out.splitlines() if line.startswith("STOPPED")]
        if failure is None and proc.returncode != 0:
            failure = f"exit status {proc.returncode}: {err[-300:]}"
        elif failure is None and "Traceback" in err:
            failure = f"a traceback: {err[-300:]}"
        elif failure is None and (not stopped or _committed(logdir)[-1] != int(stopped[0])):
            failure = f"no final checkpoint at the stop step {stopped}"
        if stopped:
            expected = int(stopped[0])
        adversarial_record.record(kind, failure)
    assert len(_committed(logdir)) <= 5  # Retention held.
    assert not adversarial_record.FAILURES[kind], adversarial_record.FAILURES[kind]


def test_two_writers_on_one_logdir(tmp_path):
    kind = "two writers"
    rng = random.Random(f"{kind}-20261125")
    for trial in range(10):
        logdir = str(tmp_path / f"trial{trial}")
        first = _worker(logdir, 10**9)
        failure = None
        try:
            first.stdout.readline()  # RESTORED
            first.stdout.readline()  # TRAINING
            time.sleep(rng.uniform(0.0, 0.5))
            start = time.monotonic()
            second = subprocess.run(
                [sys.executable, TORTURE_WORKER, logdir, "5"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if second.returncode == 0 or "LogdirLockedError" not in second.stderr:
                failure = f"the second writer ran: {second.returncode} {second.stderr[-300:]}"
            elif f"pid {first.pid}" not in second.stderr:
                failure = f"the error does not name the first writer: {second.stderr[-300:]}"
            elif time.monotonic() - start > 60:
                failure = "the second writer did not fail at once"
            first.send_signal(signal.SIGTERM)
            out, err = first.communicate(timeout=120)
            if failure is None and first.returncode != 0:
                failure = f"the first writer failed: {err[-300:]}"
            stopped = [x.split()[1] for x in out.splitlines() if x.startswith("STOPPED")]
            if failure is None and _committed(logdir)[-1] != int(stopped[0]):
                failure = "the first writer's final checkpoint is missing"
        finally:
            if first.poll() is None:
                first.kill()
                first.communicate()
        adversarial_record.record(kind, failure)
    assert not adversarial_record.FAILURES[kind], adversarial_record.FAILURES[kind]


def _mount_tmpfs(path, size):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode()[-200:]}")


def _umount(path):
    subprocess.run(["umount", "-l", path], capture_output=True)


FULL_DISK_WORKER = """
import sys, time, torch, torchsupervisor as ts
logdir, size = sys.argv[1], int(sys.argv[2])
step = ts.GlobalStep()
w = torch.zeros(size)
sv = ts.Supervisor(logdir=logdir, state={"w": w, "global_step": step},
                   save_model_secs=0.01, save_summaries_secs=0)
with sv.managed_session() as sess:
    print("RESTORED", step.value, bool((w == step.value).all()), flush=True)
    for _ in range(150):
        def train():
            w.add_(1)
            step.increment()
        sess.run(train)
        sv.should_stop()
        time.sleep(0.01)
print("STEPS", step.value, flush=True)
"""


def test_a_full_disk_never_damages_older_checkpoints(tmp_path):
    kind = "disk full (small tmpfs)"
    mount = str(tmp_path / "small")
    _mount_tmpfs(mount, "2m")
    try:
        rng = random.Random(f"{kind}-20261125")
        for trial in range(6):
            logdir = os.path.join(mount, f"trial{trial}")
            # 4 bytes per float: checkpoints of 0.6 to 1.2 MB in 2 MB, so the disk fills.
            size = rng.randint(150_000, 300_000)
            failure = None
            for run in range(2):  # A run that fills the disk, then a restart on it.
                done = subprocess.run(
                    [sys.executable, "-c", FULL_DISK_WORKER, logdir, str(size)],
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                restored = [x for x in done.stdout.splitlines() if x.startswith("RESTORED")]
                if not restored or not restored[0].endswith("True"):
                    failure = f"run {run}: {done.stdout[-200:]} {done.stderr[-300:]}"
                    break
                if "No space left on device" not in done.stderr and run == 0:
                    failure = "the disk never filled"
                    break
                if [n for n in os.listdir(logdir) if is_temporary_name(n)]:
                    failure = f"run {run} left temporary files"
                    break
                try:
                    _committed(logdir)  # Every committed checkpoint is intact.
                except Exception as e:
                    failure = f"run {run}: a committed checkpoint is damaged: {e}"
                    break
            shutil.rmtree(logdir, ignore_errors=True)
            adversarial_record.record(kind, failure)
    finally:
        _umount(mount)
    assert not adversarial_record.FAILURES[kind], adversarial_record.FAILURES[kind]


def test_a_read_only_logdir_restores_and_reports(tmp_path):
    kind = "read-only logdir"
    mount = str(tmp_path / "ro")
    _mount_tmpfs(mount, "512m")
    try:
        for trial in range(4):
            logdir = os.path.join(mount, f"trial{trial}")
            first = subprocess.run(
                [sys.executable, TORTURE_WORKER, logdir, str(5 + trial)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert first.returncode == 0, first.stderr
            before = _committed(logdir)
            subprocess.run(["mount", "-o", "remount,ro", mount], check=True)
            try:
                second = subprocess.run(
                    [sys.executable, TORTURE_WORKER, logdir, str(10 + trial)],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
            finally:
                subprocess.run(["mount", "-o", "remount,rw", mount], check=True)
            failure = None
            if not second.stdout.startswith(f"RESTORED {5 + trial} True"):
                failure = f"no restore from a read-only logdir: {second.stderr[-300:]}"
            elif second.returncode == 0:
                failure = "the lost work was not reported by the exit status"
            elif "Read-only file system" not in second.stderr:
                failure = f"the error does not say why: {second.stderr[-300:]}"
            elif _committed(logdir) != before:
                failure = "the checkpoints changed"
            shutil.rmtree(logdir, ignore_errors=True)
            adversarial_record.record(kind, failure)
    finally:
        _umount(mount)
    assert not adversarial_record.FAILURES[kind], adversarial_record.FAILURES[kind]
