"""What ``import torchsupervisor`` loads: not DCP (a second of start-up, with DTensor and
sympy), which only sharded checkpoints need. Every process pays the import: each torchrun
worker, each restart after a preemption."""

from __future__ import annotations

import subprocess
import sys

# Heavy modules a process without sharded checkpoints never uses.
_NOT_AT_IMPORT = ["torch.distributed.checkpoint", "torch.distributed.tensor", "sympy"]


def test_importing_the_package_leaves_dcp_unloaded():
    probe = (
        "import sys, torchsupervisor\n"
        f"print(','.join(m for m in {_NOT_AT_IMPORT!r} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == ""


def test_a_sharded_save_loads_dcp_when_it_needs_it(tmp_path):
    # The lazy imports still find DCP: a sharded save and restore in a fresh process.
    probe = f"""
import sys, torch, torch.distributed as dist
import torchsupervisor as ts
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
try:
    mesh = init_device_mesh("cpu", (1,))
    weight = DTensor.from_local(torch.arange(4.0), mesh, [Shard(0)])
    step = ts.GlobalStep()
    saver = ts.Saver({{"w": weight, "global_step": step}})
    path = saver.save(None, {str(tmp_path)!r} + "/model.ckpt", global_step=3)
    weight.to_local().zero_()
    saver.restore(None, path)
    assert weight.to_local().tolist() == [0.0, 1.0, 2.0, 3.0], weight.to_local()
    print("ok", "torch.distributed.checkpoint" in sys.modules)
finally:
    dist.destroy_process_group()
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "True"]
