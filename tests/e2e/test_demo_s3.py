"""The main job on S3: the digits demo with ``--logdir s3://...`` on a real S3 server
(SeaweedFS), killed with SIGKILL, resumed to the end, and verified."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from torchsupervisor.checkpoint.state_file import latest_checkpoint
from torchsupervisor.storage import storage_for

_RESUMED = re.compile(r"Resumed at step (\d+) from (\S+)")


def _demo(url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torchsupervisor", "demo", "--logdir", url, *args]


def _committed_steps(url: str) -> list[int]:
    names = storage_for(url).list(url)
    return sorted(
        int(n[len("model.ckpt-") : -len(".index")])
        for n in names
        if n.startswith("model.ckpt-") and n.endswith(".index")
    )


def test_demo_on_s3_survives_sigkill_and_resumes_to_the_end(s3_server, s3_url):
    env = {**os.environ, **s3_server.env}
    args = ["--max-steps", "300", "--save-model-secs", "0.5", "--log-every", "50"]
    proc = subprocess.Popen(_demo(s3_url, *args), stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert "Starting from scratch" in proc.stdout.readline()
        deadline = time.monotonic() + 120
        while not [s for s in _committed_steps(s3_url) if s > 0]:
            assert proc.poll() is None, "the demo ended before it was killed"
            assert time.monotonic() < deadline, "no checkpoint past step 0 within 120 s"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    killed_at = max(_committed_steps(s3_url))

    resumed = subprocess.run(
        _demo(s3_url, *args), capture_output=True, text=True, env=env, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    step, prefix = _RESUMED.search(resumed.stdout).groups()
    assert int(step) >= killed_at > 0 and prefix.startswith(s3_url)
    assert "Done at step 300" in resumed.stdout

    verify = subprocess.run(
        [sys.executable, "-m", "torchsupervisor", "verify", s3_url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "A restart restores model.ckpt-300 (step 300)" in verify.stdout
    assert latest_checkpoint(s3_url) == f"{s3_url}/model.ckpt-300"
    assert storage_for(s3_url).leftovers(s3_url) == []
    assert storage_for(s3_url).lock_owner(s3_url) == {}
