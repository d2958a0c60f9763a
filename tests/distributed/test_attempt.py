"""The namespace each torchrun restart attempt agrees on, over a real TCP store (threads as ranks).

The store outlives the attempts, as torchrun's agents' store does: keys of dead workers stay.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from torchsupervisor.distributed.attempt import attempt_namespace
from torchsupervisor.errors import DeadlineExceededError
from torchsupervisor.testing import run_world

TIMEOUT = 60.0


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store


def _client(server):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False)


def _attempt(server, world_size, start_first=None):
    """Every rank of one attempt, each with its own client; ``start_first`` posts first."""
    with ThreadPoolExecutor(world_size) as pool:
        futures = {}
        if start_first is not None:
            futures[start_first] = pool.submit(
                attempt_namespace, _client(server), start_first, world_size, TIMEOUT
            )
            deadline = time.monotonic() + TIMEOUT
            hello = f"torchsupervisor/attempt/hello/{start_first}"
            while not server.check([hello]):
                assert time.monotonic() < deadline
                time.sleep(0.01)
        for rank in range(world_size):
            if rank not in futures:
                futures[rank] = pool.submit(
                    attempt_namespace, _client(server), rank, world_size, TIMEOUT
                )
        return [futures[rank].result(TIMEOUT) for rank in range(world_size)]


def test_every_rank_gets_the_same_namespace_and_each_attempt_a_new_one(server):
    first = _attempt(server, 3)
    second = _attempt(server, 3)
    assert len(set(first)) == 1 and len(set(second)) == 1
    assert first[0] != second[0]
    assert first[0].startswith("torchsupervisor/attempt/") and first[0].endswith("/")


def test_a_hello_posted_before_rank_0_starts_is_posted_again(server):
    _attempt(server, 2)
    # Rank 1 of the next attempt posts first; rank 0 then deletes every hello it finds
    # (they could be a dead worker's), and rank 1's next post is answered.
    assert len(set(_attempt(server, 2, start_first=1))) == 1


def test_a_dead_workers_hello_is_never_answered(server):
    # An attempt whose rank 0 died before answering: rank 1's hello stays in the store.
    stale = "dead-worker-nonce"
    server.set("torchsupervisor/attempt/hello/1", stale)
    namespaces = _attempt(server, 2)
    assert len(set(namespaces)) == 1
    assert not server.check([f"torchsupervisor/attempt/answer/{stale}"])


def test_one_rank_alone_needs_no_store_round_trip(server):
    assert attempt_namespace(_client(server), 0, 1, TIMEOUT).startswith("torchsupervisor/")


@pytest.mark.parametrize("rank,missing", [(0, "ranks [1] did not join"), (1, "rank 0 did not")])
def test_a_missing_rank_is_a_deadline_error_naming_it(server, rank, missing):
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match=re.escape(f"waiting 0.3 secs ({missing}")):
        attempt_namespace(_client(server), rank, 2, 0.3, poll_secs=0.05)
    assert time.monotonic() - started < 30  # Bounded: not torch's 30 minutes.


def test_ranks_of_one_attempt_started_in_any_order_agree(server):
    barrier = threading.Barrier(4)
    results = {}

    def rank_thread(rank):
        barrier.wait(TIMEOUT)
        results[rank] = attempt_namespace(_client(server), rank, 4, TIMEOUT, poll_secs=0.01)

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in (3, 1, 0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert len(results) == 4 and len(set(results.values())) == 1


def replica_prefix(rank: int, world_size: int, agent_store: bool) -> str:
    import os

    from torchsupervisor.distributed.replicas import ReplicaGroup

    if agent_store:  # As under torchrun's shared store, the group made by init_process_group.
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    first, second = ReplicaGroup(1), ReplicaGroup(2)  # Agreed once for the group.
    assert first.key("x")[: -len("1/x")] == second.key("x")[: -len("2/x")]
    dist.barrier()  # Rank 0 hosts the store: it stays until rank 1 has read its answer.
    return first.key("x")


def test_a_group_made_by_init_process_group_on_torchrun_store_gets_an_attempt_namespace():
    keys = run_world(replica_prefix, True)
    assert keys[0] == keys[1] and keys[0].startswith("torchsupervisor/attempt/")


def test_other_groups_need_no_agreement():
    assert run_world(replica_prefix, False) == ["torchsupervisor/1/x"] * 2
