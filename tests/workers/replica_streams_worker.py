"""Two ranks of a gloo group gathering their random streams (``ReplicaStreams``).

Usage: python replica_streams_worker.py CASE   (as the ranks of a group: ``run_ranks``)

CASE ``gather``: each rank seeds torch with ``100 + rank`` and draws a number per step; at
each of three step boundaries every rank gathers, and the chief prints what it holds of
rank 1 (``HELD <step> <sha256 of its torch state>``); rank 1 prints its own
(``OWN <step> <sha256>``). A second boundary at the same step gathers nothing (the chief
runs one alone: a collective there would leave it waiting), and between steps the chief's
``RNGState`` saves no other rank's state (``NONE <step>``).

CASE ``dead``: rank 1 exits after the first gather; the chief's next gather raises
(``RAISED <type> <seconds>``).
"""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist

from torchsupervisor.core.rng import REPLICAS, RNGState, decode_rng_state
from torchsupervisor.core.session import Session
from torchsupervisor.distributed.replica_streams import ReplicaStreams


def digest(state) -> str:
    return hashlib.sha256(state["torch"].numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    case = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    step = torch.zeros((), dtype=torch.int64)
    rng = RNGState()
    sess = Session({"rng": rng, "global_step": step})
    streams = ReplicaStreams(rng, step, rank=rank, world_size=dist.get_world_size())
    streams.start(sess, every_boundary=True)
    for n in range(1, 4):
        torch.rand(3)
        step += 1
        if case == "dead" and n == 2 and rank == 1:
            os._exit(0)
        started = time.monotonic()
        try:
            sess.boundary.run_pending()
        except RuntimeError as e:
            print(f"RAISED {type(e).__name__} {time.monotonic() - started:.1f}", flush=True)
            os._exit(0)
        if rank == 0:
            sess.boundary.run_pending()  # The same step again: nothing gathered.
            held = rng.state_dict().get(REPLICAS, {})
            state = decode_rng_state(base64.b64decode(held["1"]))
            print(f"HELD {n} {digest(state)} {state['rank']}", flush=True)
        else:
            print(f"OWN {n} {digest(RNGState().state_dict())}", flush=True)
        dist.barrier()
    if rank == 0:
        step += 1  # A step not gathered at: the chief saves its own streams alone.
        print(f"NONE {int(step)} {REPLICAS not in rng.state_dict()}", flush=True)
    streams.close()
    assert rng.replicas is None
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
