"""Preemption notice benchmark: a 30 s cloud notice (GCE's) with a 500 MB state, steps lost.

    python benchmarks/preemption_notice.py
    python benchmarks/preemption_notice.py --state-mb 100 --notice-secs 30

``benchmarks/goodput_worker.py`` trains (fixed 50 ms steps, ``--state-mb`` of state changed
every step, a periodic checkpoint only every hour) with a fake GCE metadata server on
127.0.0.1 named by ``GCE_METADATA_HOST`` (how the clouds' SDKs find theirs; ours polls it:
``preemption_sources="auto"``). After 20 steps the server's ``instance/preempted`` turns
``TRUE``: the machine goes away ``--notice-secs`` later (a SIGKILL then, if the process is
still there). The run is then started again, as a new machine would, and the steps lost are
the ones it has to redo.

Side by side, the same run listening to signals only (no metadata server named): nothing stops
it before the SIGKILL, and it redoes every step since its last checkpoint.

Reported per variant: notice to the stop seen by the loop, notice to the session's end (the
final checkpoint committed), whether that was within the notice, and the steps lost. Writes
JSON (``--json``, default ``benchmarks/results/preemption_notice.json``).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "goodput_worker.py")


class FakeGce:
    """``/computeMetadata/v1/instance/preempted`` on 127.0.0.1: FALSE until ``preempt()``."""

    def __init__(self) -> None:
        self.preempted = False
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ok = self.headers.get("Metadata-Flavor") == "Google"
                body = (b"TRUE" if fake.preempted else b"FALSE") if ok else b""
                self.send_response(200 if ok else 403)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.host = f"127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _lines(path: str) -> list[list[str]]:
    try:
        with open(path) as f:
            return [line.split() for line in f if line.strip()]
    except FileNotFoundError:
        return []


def run_variant(name: str, notice: bool, args: argparse.Namespace, root: str) -> dict[str, Any]:
    logdir, truth = os.path.join(root, name), os.path.join(root, f"{name}.truth")
    gce = FakeGce() if notice else None
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GCE_METADATA_HOST", None)
    if gce is not None:
        env["GCE_METADATA_HOST"] = gce.host
    common = ["--truth", truth, "--state-mb", str(args.state_mb), "--data-every", "0"]
    common += ["--save-secs", "3600"]
    try:
        process = subprocess.Popen(
            [sys.executable, WORKER, logdir, "100000", *common],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 600
        while sum(w[0] == "step" for w in _lines(truth)) < 20:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the worker did not train: {process.stderr.read()}")
            time.sleep(0.02)
        noticed_at = time.time()
        if gce is not None:
            gce.preempted = True
        try:
            process.wait(timeout=args.notice_secs)
            killed = False
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)  # The machine is gone.
            process.wait(timeout=60)
            killed = True
        err = process.stderr.read()
    finally:
        if gce is not None:
            gce.close()
    lines = _lines(truth)
    reached = max(int(w[1]) for w in lines if w[0] == "step")
    stop = next((float(w[1]) for w in lines if w[0] == "stop"), None)
    end = next((float(w[1]) for w in lines if w[0] == "end"), None)
    # A new machine: the run again, a few steps past where it was.
    before = len(lines)
    env.pop("GCE_METADATA_HOST", None)
    again = subprocess.run(
        [sys.executable, WORKER, logdir, str(reached + 3), *common],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if again.returncode != 0:
        raise RuntimeError(f"{name}: the restart failed: {again.stderr[-3000:]}")
    first = next(int(w[1]) for w in _lines(truth)[before:] if w[0] == "step")
    resumed = first - 1
    return {
        "variant": name,
        "notice_to_stop_secs": None if stop is None else stop - noticed_at,
        "notice_to_end_secs": None if end is None else end - noticed_at,
        "killed": killed,
        "reached": reached,
        "resumed": resumed,
        "steps_lost": reached - resumed,
        "log": [line for line in err.splitlines() if "Preemption notice" in line][:1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mb", type=int, default=500)
    parser.add_argument("--notice-secs", type=float, default=30.0)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "preemption_notice.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="notice-bench-") as root:
        rows = [
            run_variant("notice", True, args, root),
            run_variant("signals only", False, args, root),
        ]
    print(f"state {args.state_mb} MB, notice {args.notice_secs:g} s before the machine goes")
    print(f"{'variant':<14} {'to stop':>8} {'to end':>8} {'killed':>7} {'steps lost':>11}")
    for r in rows:
        stop = "-" if r["notice_to_stop_secs"] is None else f"{r['notice_to_stop_secs']:.2f}s"
        end = "-" if r["notice_to_end_secs"] is None else f"{r['notice_to_end_secs']:.2f}s"
        print(f"{r['variant']:<14} {stop:>8} {end:>8} {r['killed']!s:>7} {r['steps_lost']:>11}")
    if rows[0]["log"]:
        print(rows[0]["log"][0])
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"state_mb": args.state_mb, "notice_secs": args.notice_secs, "rows": rows}, f)


if __name__ == "__main__":
    main()
