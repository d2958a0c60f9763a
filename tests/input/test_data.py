"""Resumable data order: the sampler and the loader's checkpointed position."""

from __future__ import annotations

import itertools
import pickle
import signal

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from torchsupervisor import GlobalStep, Saver, Session
from torchsupervisor.driver.preemption import WORKER_IGNORED_SIGNALS, IgnorePreemptionSignals
from torchsupervisor.input.data import ResumableDataLoader, ResumableSampler


def _dataset(n=20):
    return TensorDataset(torch.arange(n))


def _ids(batches):
    return [b[0].tolist() for b in batches]


def test_sampler_order_is_seeded_per_epoch_and_starts_anywhere():
    sampler = ResumableSampler(10, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(10))
    assert list(ResumableSampler(10, seed=3)) == first
    sampler.epoch = 1
    assert list(sampler) != first and sorted(sampler) == list(range(10))
    sampler.epoch, sampler.start = 0, 4
    assert list(sampler) == first[4:] and len(sampler) == 6
    plain = ResumableSampler(_dataset(5), shuffle=False)
    assert list(plain) == [0, 1, 2, 3, 4]


def test_a_sampler_alone_refuses_to_be_checkpointed(tmp_path):
    """With a plain DataLoader the sampler cannot know what was trained on: saving it fails
    loudly instead of recording offset 0 (which would replay the epoch from its start)."""
    sampler = ResumableSampler(20, seed=1)
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=4, sampler=sampler)
    batches = iter(loader)
    next(batches), next(batches)
    saver = Saver()
    with pytest.raises(TypeError, match=r"Put a ResumableDataLoader .* in the state instead"):
        saver.save(Session({"sampler": sampler}), str(tmp_path / "m"), global_step=2)
    assert not list(tmp_path.iterdir())  # Nothing written.
    with pytest.raises(TypeError, match="cannot be checkpointed"):
        sampler.load_state_dict({"epoch": 0, "start": 8})
    # The loader that drives it is what goes in the state.
    step = GlobalStep()
    resumable = ResumableDataLoader(_dataset(), batch_size=4, seed=1, global_step=step)
    prefix = saver.save(Session({"data": resumable}), str(tmp_path / "m"), global_step=0)
    assert prefix is not None


def test_loader_epochs_and_length():
    loader = ResumableDataLoader(_dataset(10), batch_size=4, seed=1)
    assert len(loader) == 3
    epoch0 = _ids(loader)
    epoch1 = _ids(loader)
    assert [len(b) for b in epoch0] == [4, 4, 2] and epoch0 != epoch1
    assert sorted(i for batch in epoch0 for i in batch) == list(range(10))
    assert len(ResumableDataLoader(_dataset(10), batch_size=4, drop_last=True)) == 2
    with pytest.raises(ValueError, match="sampler"):
        ResumableDataLoader(_dataset(), sampler=None)
    with pytest.raises(ValueError, match="batch_size"):
        ResumableDataLoader(_dataset(), batch_size=0)


def test_without_a_global_step_a_batch_counts_when_fetched():
    loader = ResumableDataLoader(_dataset(), batch_size=3, seed=2)
    reference = _ids(ResumableDataLoader(_dataset(), batch_size=3, seed=2))
    it = iter(loader)
    seen = _ids([next(it), next(it)])
    assert loader.state_dict() == {"epoch": 0, "batches_consumed": 2}
    resumed = ResumableDataLoader(_dataset(), batch_size=3, seed=2)
    resumed.load_state_dict(loader.state_dict())
    assert seen + _ids(resumed) == reference


@pytest.mark.parametrize("check_before_training", [True, False])
def test_with_a_global_step_a_batch_counts_once_trained(check_before_training):
    """Exact for both loop shapes: checkpoint between fetch and train, or after the train."""
    step = GlobalStep()
    loader = ResumableDataLoader(_dataset(), batch_size=3, seed=2, global_step=step)
    reference = _ids(ResumableDataLoader(_dataset(), batch_size=3, seed=2))
    trained = []
    snapshot = None
    for batch in loader:
        if check_before_training and step.value == 3:
            snapshot = loader.state_dict()  # Fetched batch 3, not trained on yet.
            break
        trained.append(batch[0].tolist())
        step.increment()
        if not check_before_training and step.value == 3:
            snapshot = loader.state_dict()  # Trained on batch 2.
            break
    assert snapshot == {"epoch": 0, "batches_consumed": 3}
    resumed = ResumableDataLoader(_dataset(), batch_size=3, seed=2, global_step=step)
    resumed.load_state_dict(snapshot)
    assert trained + _ids(resumed) == reference


def test_position_round_trips_through_a_checkpoint_with_workers(tmp_path):
    step = GlobalStep()
    loader = ResumableDataLoader(
        _dataset(40), batch_size=4, seed=5, global_step=step, num_workers=2
    )
    uninterrupted = ResumableDataLoader(_dataset(40), batch_size=4, seed=5, num_workers=2)
    epochs = _ids(uninterrupted) + _ids(uninterrupted)  # Epochs 0 and 1.
    trained = []
    for _ in range(2):
        for batch in loader:
            trained.append(batch[0].tolist())
            step.increment()
            if step.value == 13:
                break
        if step.value == 13:
            break
    prefix = Saver().save(Session({"data": loader, "step": step}), str(tmp_path / "m"))
    step2 = GlobalStep()
    resumed = ResumableDataLoader(
        _dataset(40), batch_size=4, seed=5, global_step=step2, num_workers=2
    )
    Saver().restore(Session({"data": resumed, "step": step2}), prefix)
    assert resumed.state_dict() == {"epoch": 1, "batches_consumed": 3}
    assert trained + _ids(resumed) == epochs


def test_stateful_dataloader_from_torchdata_round_trips(tmp_path):
    pytest.importorskip("torchdata.stateful_dataloader")
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    warnings.filterwarnings("ignore", message=".*set_vital.*")
    data = torch.arange(60).float()
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=2)
    it = iter(loader)
    for _ in range(5):
        next(it)
    prefix = Saver().save(Session({"data": loader}), str(tmp_path / "m"))
    expected = [next(it) for _ in range(3)]
    resumed = StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=2)
    Saver().restore(Session({"data": resumed}), prefix)
    got = [b for _, b in zip(range(3), iter(resumed))]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


_INIT: dict[str, int] = {"worker": 0}


def _user_init(worker_id: int) -> None:
    _INIT["worker"] = worker_id + 1


class _SignalState(Dataset):
    """Each item reports the process's signal state (as seen where it is loaded)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        return torch.tensor(
            [
                *(signal.getsignal(s) is signal.SIG_IGN for s in WORKER_IGNORED_SIGNALS),
                not set(WORKER_IGNORED_SIGNALS) & blocked,
                _INIT["worker"],
            ]
        )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_workers_ignore_the_preemption_signals_then_run_the_given_init(num_workers):
    handlers = {s: signal.getsignal(s) for s in WORKER_IGNORED_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    loader = ResumableDataLoader(
        _SignalState(), batch_size=2, num_workers=num_workers, worker_init_fn=_user_init
    )
    rows = torch.cat(list(loader)).tolist()
    n = len(WORKER_IGNORED_SIGNALS)
    if num_workers:  # Ignored and unblocked in the workers; the user's init ran after.
        assert all(row[: n + 1] == [1] * (n + 1) for row in rows), rows
        assert {row[-1] for row in rows} == {1, 2}
    else:  # The main process keeps its handlers (SIGINT is ignored already in a process
        # started in the background by a shell without job control).
        before = [int(handlers[s] is signal.SIG_IGN) for s in WORKER_IGNORED_SIGNALS]
        assert all(row == [*before, 1, 0] for row in rows), rows
    assert {s: signal.getsignal(s) for s in WORKER_IGNORED_SIGNALS} == handlers
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
    assert _INIT["worker"] == 0


def test_the_worker_init_wrapper_pickles_for_spawned_workers():
    init = pickle.loads(pickle.dumps(IgnorePreemptionSignals(_user_init)))
    assert init.worker_init_fn is _user_init
    assert init.signals == WORKER_IGNORED_SIGNALS
    assert "SIGTERM" in repr(init)


def _indices(batches):
    return [int(i) for batch in batches for i in batch]


def test_ranks_read_disjoint_shares_and_resume_from_rank_0s_position():
    # It replaces DistributedSampler + set_epoch: each rank its share, the epoch moving by
    # itself, and one position (rank 0's, the checkpoint's) resuming every rank exactly.
    data = torch.arange(10)

    def loaders():
        steps = [GlobalStep(), GlobalStep()]
        made = [
            ResumableDataLoader(
                data, batch_size=2, seed=3, global_step=steps[r], rank=r, world_size=2
            )
            for r in range(2)
        ]
        return made, steps

    whole, steps = loaders()
    assert [len(loader) for loader in whole] == [3, 3]  # ceil(10 / 2) = 5 samples: 3 batches.
    uninterrupted = {r: [] for r in range(2)}
    for epoch in range(2):
        shares = []
        for r, loader in enumerate(whole):
            batches = []
            for batch in loader:
                batches.append(batch.tolist())
                steps[r].increment()
            uninterrupted[r].extend(batches)
            shares.append(_indices(batches))
        assert sorted(shares[0] + shares[1]) == list(range(10))  # Disjoint, complete.
        assert all(loader.epoch == epoch + 1 for loader in whole)

    # Stop both ranks after 4 steps (epoch 1, batch 1); resume both from rank 0's state.
    first, steps = loaders()
    seen = {r: [] for r in range(2)}
    for r, loader in enumerate(first):
        for i, batch in enumerate(itertools.chain(iter(loader), iter(loader))):
            if i == 4:
                break
            seen[r].append(batch.tolist())
            steps[r].increment()
    saved = first[0].state_dict()
    assert saved == first[1].state_dict() == {"epoch": 1, "batches_consumed": 1}
    resumed, steps = loaders()
    for r, loader in enumerate(resumed):
        loader.load_state_dict(saved)
        seen[r].extend(batch.tolist() for batch in loader)
    assert seen == uninterrupted


def test_a_rank_share_pads_like_distributed_sampler_and_checks_its_arguments():
    sampler = ResumableSampler(5, shuffle=False, rank=1, world_size=3)
    assert sampler.shard(0) == [1, 4]  # [0..4] padded with 0: [0, 1, 2, 3, 4, 0].
    assert ResumableSampler(5, shuffle=False, rank=2, world_size=3).shard(0) == [2, 0]
    assert len(sampler) == 2
    with pytest.raises(ValueError, match="rank must be below world_size"):
        ResumableSampler(5, rank=2, world_size=2)
    with pytest.raises(TypeError, match="world_size"):
        ResumableDataLoader(torch.arange(4), world_size="2")
