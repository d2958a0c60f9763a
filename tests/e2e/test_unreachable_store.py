"""A preemption while the object store does not answer: the stop keeps to the grace period.

Every part of a stop shares the grace period: the final checkpoint, how the session ended,
the last events and the writer lock. What cannot finish within it is abandoned with a line
naming it; the events not uploaded stay in the local spool and the next run on the log
directory uploads them. The store is real (SeaweedFS) behind a proxy that stops answering.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from faulty_proxy import FaultyProxy

from torchsupervisor import summary_iterator
from torchsupervisor.storage import storage_for

GRACE_SECS = 3.0

_PROGRAM = r"""
import sys, time, torch
import torchsupervisor as ts

step = ts.GlobalStep()
w = torch.zeros(())
sv = ts.Supervisor(logdir=sys.argv[1], state={"w": w, "global_step": step},
                   save_model_secs=0.5, save_summaries_secs=0,
                   preemption_grace_secs=float(sys.argv[2]))
with sv.managed_session() as sess:
    while not sv.should_stop():
        sess.run(lambda: (w.add_(1.0), step.increment()))
        sv.summary_writer.add_scalar("loss", float(w), step.value)
        print("STEP", step.value, flush=True)
        time.sleep(0.02)
"""

_UPLOAD = r"""
import sys
import torchsupervisor as ts

ts.SummaryWriter(sys.argv[1]).close()  # A writer of the next run on the directory.
"""


def _steps_on_the_store(url: str) -> set[int]:
    st = storage_for(url)
    steps: set[int] = set()
    for name in st.list(url):
        if ".tfevents." in name:
            local = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tsv-{os.getpid()}-{name}")
            with open(local, "wb") as f:
                f.write(st.read_bytes(f"{url}/{name}", max_bytes=64 << 20))
            try:
                steps |= {e.step for e in summary_iterator(local) if e.summary.value}
            finally:
                os.remove(local)
    return steps


def test_a_sigterm_while_the_store_does_not_answer_exits_within_the_grace_period(s3_server, s3_url):
    # 30 s of grace took 164 s: the summary writer's close waited 120 s for its uploads.
    proxy = FaultyProxy(s3_server.endpoint, failures=0)
    try:
        env = {**os.environ, **s3_server.env, "AWS_ENDPOINT_URL": proxy.endpoint}
        proc = subprocess.Popen(
            [sys.executable, "-c", _PROGRAM, s3_url, str(GRACE_SECS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        last = 0
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # Until a checkpoint past step 0 is committed.
            last = int(line.split()[1])
            names = storage_for(s3_url).list(s3_url)
            saved = [n for n in names if n.startswith("model.ckpt-") and n.endswith(".index")]
            if last > 20 and [n for n in saved if n != "model.ckpt-0.index"]:
                break
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
        proxy.partition()
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
        elapsed = time.monotonic() - started
    finally:
        proxy.close()
    # Slack for a busy machine's exit; the fault made it 120 s more than the grace period.
    assert elapsed < GRACE_SECS + 30, (elapsed, err[-3000:])
    assert proc.returncode == 1, err[-3000:]  # Work was lost: never exit 0.
    stepped = max([last, *(int(s.split()[1]) for s in out.split("\n") if s.startswith("STEP"))])
    assert "checkpoint" in err and "within" in err and "abandoned" in err, err[-3000:]
    assert "did not finish within" in err and "the next run on" in err, err[-3000:]
    # The next run on the directory uploads the events the stop left in the local spool.
    (kept,) = re.findall(r"its file is kept in (\S+) and the next run", err)
    assert os.path.exists(kept)
    env = {**os.environ, **s3_server.env}
    subprocess.run([sys.executable, "-c", _UPLOAD, s3_url], check=True, env=env, timeout=120)
    assert not os.path.exists(kept)
    assert set(range(1, stepped + 1)) <= _steps_on_the_store(s3_url)
