"""The store agreements of sharded checkpoints, with several "ranks" as threads of one process
sharing an in-memory store (no process group): votes, one recorded decision, vetoes, timeouts,
and periodic requests saved at the same agreed step by every rank."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch.distributed as dist

from torchsupervisor.core.boundary import StepBoundary
from torchsupervisor.core.global_step import GlobalStep, read_step
from torchsupervisor.distributed.replicas import ReplicaAbort, ReplicaGroup
from torchsupervisor.driver.checkpoint_driver import CheckpointDriver
from torchsupervisor.driver.sharded_checkpoints import ShardedCheckpointService, _combine
from torchsupervisor.errors import DeadlineExceededError
from torchsupervisor.testing import FakeClock


class FakeSession:
    def __init__(self, owner_ident: int | None = None, restored: str | None = None) -> None:
        self.boundary = StepBoundary(owner_ident)
        self.restored_checkpoint = restored
        self.state: dict = {}
        self.closed = False


class RecordingSaver:
    """Records the steps saved (the real save is a collective of the ranks)."""

    last_save = None

    def __init__(self) -> None:
        self.saved: list[int] = []

    def save(self, sess, save_path, global_step=None):
        step = read_step(global_step)
        self.saved.append(step)
        return f"{save_path}-{step}"

    in_flight = False

    def save_async(self, sess, save_path, global_step=None):
        """Periodic checkpoints: done at once (the writer thread is the real Saver's)."""
        future = concurrent.futures.Future()
        future.set_result(self.save(sess, save_path, global_step))
        return future


def _groups(world_size: int = 2, clock: FakeClock | None = None) -> list[ReplicaGroup]:
    store = dist.HashStore()
    return [
        ReplicaGroup(1, store=store, rank=r, world_size=world_size, clock=clock)
        for r in range(world_size)
    ]


def _service(group, *, step=0, restored=None, owner=None, **kwargs):
    global_step = GlobalStep(step)
    saver = RecordingSaver()
    sess = FakeSession(owner, restored)
    clock = kwargs.get("clock")
    driver = CheckpointDriver(
        saver,
        "/ckpt/model.ckpt",
        global_step,
        clock=clock,
        last_step=step if restored else None,
        last_prefix=restored,
    )
    service = ShardedCheckpointService(sess, driver, group, **kwargs)
    return service, saver, global_step, sess


def _in_threads(*fns):
    results: list = [None] * len(fns)

    def run(i):
        try:
            results[i] = fns[i]()
        except BaseException as e:  # Reported by the test.
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    return results


def test_the_decision_of_a_full_vote():
    assert _combine([{"vote": "save", "step": 5}, {"vote": "save", "step": 5}]) == "save"
    assert _combine([{"vote": "same", "step": 5}, {"vote": "same", "step": 5}]) == "same"
    mixed = _combine([{"vote": "save", "step": 5}, {"vote": "same", "step": 5}])
    assert mixed == "skip: rank 1: same"
    apart = _combine([{"vote": "save", "step": 5}, {"vote": "save", "step": 6}])
    assert apart.startswith("skip: the ranks are at different steps [5, 6]")


def test_every_rank_saves_when_every_rank_votes_to():
    (s0, saver0, *_), (s1, saver1, *_) = (_service(g, step=7) for g in _groups())
    assert _in_threads(s0.save_now, s1.save_now) == ["/ckpt/model.ckpt-7"] * 2
    assert saver0.saved == saver1.saved == [7]
    assert s0.last_step == s1.last_step == 7
    # Again at the same step: every rank votes "same", nobody saves.
    assert _in_threads(s0.save_now, s1.save_now) == [None, None]
    assert saver0.saved == saver1.saved == [7]


def test_a_rank_whose_last_checkpoint_is_at_that_step_makes_every_rank_skip():
    g0, g1 = _groups()
    s0, saver0, *_ = _service(g0, step=7, restored="/ckpt/model.ckpt-7")
    s1, saver1, *_ = _service(g1, step=7)
    assert _in_threads(s0.save_now, s1.save_now) == [None, None]
    assert saver0.saved == saver1.saved == []


# The waits below run on a fake clock: a timeout passes in no real time, and "at once" means
# no fake time went by either (no wait for a vote that will not come).


def test_a_veto_skips_the_final_checkpoint_at_once():
    clock = FakeClock()
    g0, g1 = _groups(clock=clock)
    s0, saver0, *_ = _service(g0, step=3, clock=clock)
    s1, saver1, *_ = _service(g1, step=3, clock=clock)
    s1.veto("its session ended with an error")
    start = clock.monotonic()
    assert s0.final(timeout_secs=60) is None
    assert clock.monotonic() - start < 1
    assert saver0.saved == saver1.saved == []


def test_a_rank_that_votes_after_the_deadline_follows_the_recorded_decision():
    clock = FakeClock()
    g0, g1 = _groups(clock=clock)
    s0, saver0, *_ = _service(g0, step=3, clock=clock)
    s1, saver1, *_ = _service(g1, step=3, clock=clock)
    start = clock.monotonic()
    assert s0.final(timeout_secs=20) is None  # Rank 1 did not vote in time: skip.
    assert 20 <= clock.monotonic() - start < 21  # It waited out its budget, no more.
    start = clock.monotonic()
    assert s1.final(timeout_secs=60) is None  # Late: it must not save alone.
    assert clock.monotonic() - start < 1
    assert saver0.saved == saver1.saved == []


def test_an_explicit_checkpoint_that_only_one_rank_asks_for_times_out():
    clock = FakeClock()
    s0, saver0, *_ = _service(_groups(clock=clock)[0], step=3, agreement_secs=30, clock=clock)
    start = clock.monotonic()
    with pytest.raises(DeadlineExceededError, match="not every rank called it at step 3"):
        s0.save_now()
    assert 30 <= clock.monotonic() - start < 31
    assert saver0.saved == []


def test_gather_names_the_ranks_that_did_not_answer_and_stops_on_an_abort_flag():
    clock = FakeClock()
    g0, g1, g2 = _groups(3, clock=clock)
    g0.post("x", 1)
    g2.post("x", 3)
    start = clock.monotonic()
    with pytest.raises(DeadlineExceededError, match=r"Agreeing: rank\(s\) \[1\] did not answer"):
        g0.gather("x", 10, what="Agreeing")
    assert 10 <= clock.monotonic() - start < 11
    g1.raise_flag("abort", "rank 1: broken")
    g2.raise_flag("abort", "rank 2: ignored, the first reason is kept")
    start = clock.monotonic()
    with pytest.raises(ReplicaAbort, match="rank 1: broken"):
        g0.gather("y", 60, what="Agreeing", abort="abort")
    assert clock.monotonic() - start < 1
    g1.post("x", 2)
    assert g2.gather("x", 1, what="Agreeing") == [1, 2, 3]


def test_periodic_requests_are_saved_by_every_rank_at_the_same_agreed_step():
    """Two training threads at different speeds; the chief asks three times."""
    groups = _groups()
    services: list = [None, None]
    savers: list = [None, None]
    started = threading.Barrier(3)
    finished = threading.Event()

    def train(rank: int, step_secs: float) -> None:
        service, saver, global_step, sess = _service(
            groups[rank], owner=threading.get_ident(), poll_secs=0.005, agreement_secs=30
        )
        services[rank], savers[rank] = service, saver
        service.start()
        started.wait()
        try:
            while not finished.is_set() or sess.boundary.pending:
                if sess.boundary.pending:  # The step boundary (as in Session.run).
                    sess.boundary.run_pending()
                global_step.increment()
                time.sleep(step_secs)
        finally:
            service.close()

    threads = [
        threading.Thread(target=train, args=(0, 0.001)),
        threading.Thread(target=train, args=(1, 0.003)),
    ]
    for t in threads:
        t.start()
    started.wait()
    for k in range(1, 4):
        services[0].request()
        deadline = time.monotonic() + 20
        while len(savers[0].saved) < k and time.monotonic() < deadline:
            time.sleep(0.01)
    finished.set()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert len(savers[0].saved) == 3 and savers[0].saved == savers[1].saved
    assert savers[0].saved == sorted(set(savers[0].saved))


def test_a_checkpoint_still_being_written_holds_the_next_request_and_votes_no_past_its_wait():
    g0, g1 = _groups()
    s0, saver0, _, sess0 = _service(g0, step=3)
    s1, saver1, *_ = _service(g1, step=3)
    pending: concurrent.futures.Future = concurrent.futures.Future()
    saver0.save_async = lambda *args, **kwargs: pending  # Rank 0's writer is still busy.
    s0.driver.start(sess0, 2)
    s0.request()  # Not issued while the chief's checkpoint is being written.
    assert g0.add("save/requests", 0) == 0
    assert _in_threads(lambda: s0.final(timeout_secs=0.5), lambda: s1.final(timeout_secs=60)) == [
        None,
        None,
    ]
    decision = g1.flag("final/decision")
    assert "rank 0: no: rank 0's previous checkpoint is still being written" in decision
    assert saver0.saved == saver1.saved == []
    pending.set_result("/ckpt/model.ckpt-2")  # Written: the next vote goes ahead.
    assert s0.last_step == 2
    assert _in_threads(s0.save_now, s1.save_now) == ["/ckpt/model.ckpt-3"] * 2
    assert saver0.saved == saver1.saved == [3]


@pytest.mark.parametrize("wait", [True, False])
def test_close_waits_for_a_checkpoint_being_written_unless_told_not_to(caplog, wait):
    clock = FakeClock()
    s0, saver0, _, sess0 = _service(_groups(clock=clock)[0], step=3, agreement_secs=30, clock=clock)
    pending: concurrent.futures.Future = concurrent.futures.Future()
    saver0.save_async = lambda *args, **kwargs: pending  # The writer never finishes.
    s0.driver.start(sess0, 3)
    start = clock.monotonic()
    s0.close(wait=wait)
    waited = clock.monotonic() - start
    if wait:  # At most agreement_secs, then a warning; never forever.
        assert 30 <= waited < 31 and "still being written" in caplog.text
    else:  # A second Ctrl-C: not waited for at all.
        assert waited < 1 and "still being written" not in caplog.text
