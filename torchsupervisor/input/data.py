"""Resumable data order: a seeded sampler and a DataLoader wrapper that checkpoint their position.

An exact continuation after a restart must feed the model the batches the stopped run would
have fed it next. ``ResumableSampler`` yields a seeded permutation per epoch (or the natural
order) from a given position. ``ResumableDataLoader`` wraps a ``torch.utils.data.DataLoader``
over it and keeps ``(epoch, batches consumed)`` in its ``state_dict``; put it in the state.

What counts as consumed: with ``global_step`` given, a batch counts once the global step moved
past the step at which it was fetched, i.e. once a training step ran on it. That makes the
position exact wherever the checkpoint is taken, whether the loop fetches before checking
``should_stop()`` (``for batch in loader: if sv.should_stop(): break``) or after, and with
gradient accumulation (batches of an unfinished accumulation are replayed, as their gradients
were not saved). Without ``global_step``, a batch counts as soon as it is fetched.

Workers and prefetching do not matter: the position counts batches handed to the loop, not
batches prepared by workers, and every epoch's worker seeds come from the loader's own
generator (seeded with ``seed`` and the epoch), not from the global RNG. Worker-side
randomness (augmentation) is reproduced only if it is derived from the sample index, since a
resumed epoch distributes its batches over the workers from the resume point.

Preemption signals: the loader's worker processes ignore SIGTERM, SIGUSR1 and SIGINT (it
wraps ``worker_init_fn`` in ``IgnorePreemptionSignals``, which runs first and then calls
yours), so that a scheduler signalling the whole process group (SLURM, ``kill -TERM -<pgid>``)
stops the training cleanly with a final checkpoint instead of killing the workers and, with
them, the main process ("DataLoader worker ... exited unexpectedly"), or hanging it. The workers
are started with these signals blocked, so one arriving while they start is not lost in the
main process nor fatal to a worker. With a plain ``DataLoader`` or a ``StatefulDataLoader``,
pass ``worker_init_fn=IgnorePreemptionSignals()`` yourself (see
``torchsupervisor.driver.preemption``).

Objects of ``torchdata.stateful_dataloader.StatefulDataLoader`` (or any object with
``state_dict``/``load_state_dict``) can be put in the state as they are.

A ``ResumableSampler`` cannot be checkpointed on its own: a plain ``DataLoader`` draws its
indices ahead of the training loop (a batch per fetch, several with worker prefetching), so
the sampler cannot know which samples were trained on. Put the ``ResumableDataLoader`` in the
state; a sampler found in the state makes the save fail with a ``TypeError`` that says so
(rather than checkpointing offset 0 and silently replaying an epoch from its start).
"""

from __future__ import annotations

import collections
import contextlib
import signal
import time
from collections.abc import Iterable, Iterator, Sized
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from torchsupervisor.core.checks import check_int
from torchsupervisor.core.global_step import read_step
from torchsupervisor.core.waits import INPUT_WAITS
from torchsupervisor.driver.preemption import IgnorePreemptionSignals

if TYPE_CHECKING:
    from torchsupervisor.core.global_step import GlobalStepLike

__all__ = ["ResumableDataLoader", "ResumableSampler"]


def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=generator)


class ResumableSampler(Sampler[int]):
    """Yield the indices of one epoch from a given position.

    Args:
        data_source: The dataset (or any sized object), or its length.
        shuffle: A seeded permutation per epoch (``seed`` and ``epoch`` determine it);
            otherwise ``0 .. n-1``.
        seed: The shuffling seed.
        rank, world_size: This replica's share of each epoch, as ``DistributedSampler``
            splits it: the epoch's order (the same on every rank) padded with its first
            indices to a multiple of ``world_size``, then every ``world_size``-th index from
            ``rank``. Every rank gets ``ceil(n / world_size)`` indices, disjoint but for the
            padding. Default: the whole epoch (rank 0 of 1).

    Attributes:
        epoch: The epoch whose order is yielded.
        start: The position in that order where iteration starts.

    The sampler itself does not move: ``ResumableDataLoader`` sets ``epoch`` and ``start``
    (or set them yourself). It does not record its position: do not put it in the state
    (``state_dict`` raises ``TypeError``); put the ``ResumableDataLoader`` there instead.

    TF name: none (a seeded order from any position; TF 1's input queues did not checkpoint
    their position).
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not isinstance(data_source, (int, Sized)) or isinstance(data_source, bool):
            raise TypeError(
                f"data_source must be a dataset with a length, or a length, got {data_source!r}"
            )
        self._n = data_source if isinstance(data_source, int) else len(data_source)
        if self._n < 0:
            raise ValueError(f"data_source length must be >= 0, got {self._n}")
        world_size = check_int("world_size", world_size, minimum=1)
        rank = check_int("rank", rank)
        if rank >= world_size:
            raise ValueError(f"rank must be below world_size ({world_size}), got {rank}")
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start = 0

    def order(self, epoch: int) -> list[int]:
        """Return the full order of ``epoch`` (every rank's, before the split)."""
        if self.shuffle:
            return _permutation(self._n, self.seed, epoch).tolist()
        return list(range(self._n))

    def shard(self, epoch: int) -> list[int]:
        """Return this rank's indices of ``epoch``, in order (see ``rank``)."""
        order = self.order(epoch)
        if self.world_size == 1 or not order:
            return order
        per_rank = -(-len(order) // self.world_size)
        padding = per_rank * self.world_size - len(order)
        order += (order * (padding // len(order) + 1))[:padding]
        return order[self.rank :: self.world_size]

    def shard_length(self) -> int:
        """This rank's indices in an epoch: ``ceil(n / world_size)``."""
        return -(-self._n // self.world_size) if self._n else 0

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard(self.epoch)[self.start :])

    def __len__(self) -> int:
        return max(0, self.shard_length() - self.start)

    def state_dict(self) -> dict[str, int]:
        """Refuse to be checkpointed: the sampler does not know what was trained on.

        A ``DataLoader`` draws indices before the loop trains on them (ahead by the
        prefetched batches with workers), so a position counted here would skip or replay
        samples after a restart, and ``start`` never moves by itself (it would save offset 0).

        Raises:
            TypeError: Always, saying to put a ``ResumableDataLoader`` in the state instead
                (a save of a state holding the sampler fails with it).
        """
        raise TypeError(_NOT_CHECKPOINTABLE)

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Refuse to be restored (see ``state_dict``).

        Raises:
            TypeError: Always.
        """
        raise TypeError(_NOT_CHECKPOINTABLE)


_NOT_CHECKPOINTABLE = (
    "A ResumableSampler cannot be checkpointed: the DataLoader draws its indices ahead of "
    "training, so it does not know which samples were trained on. Put a ResumableDataLoader "
    "(which drives a ResumableSampler and records the batches trained on) in the state instead"
)


class ResumableDataLoader:
    """A DataLoader whose position in the data is checkpointed with the state.

    Iterating yields the remaining batches of the current epoch and then moves to the next
    epoch; iterate again for the next epoch. A restored loader continues with the first batch
    the stopped run had not trained on.

    Args:
        dataset: The map-style dataset.
        batch_size: Samples per batch.
        shuffle: Shuffle each epoch with a permutation seeded by ``seed`` and the epoch.
        seed: Seed of the order and of the workers' seeds.
        drop_last: Drop the last incomplete batch of an epoch.
        global_step: The global step (see the module docstring); None: a batch counts as
            consumed when fetched.
        rank, world_size: Read this replica's share of each epoch, as a
            ``DistributedSampler`` would (``ResumableSampler``): pass
            ``torch.distributed.get_rank()`` and ``get_world_size()``. It replaces
            ``DistributedSampler`` and its ``set_epoch``: the epoch moves by itself and is
            checkpointed. Every rank reads as many batches an epoch, so in a run whose ranks
            step together the position is the same on all of them, and the checkpoint's
            (rank 0's) resumes every rank exactly. Default: the whole dataset.
        **loader_kwargs: Passed to ``DataLoader`` (``num_workers``, ``collate_fn``,
            ``pin_memory``, ...; not ``sampler``, ``shuffle``, ``batch_sampler``,
            ``generator``). A ``worker_init_fn`` is wrapped in ``IgnorePreemptionSignals``:
            the workers ignore the preemption signals, then it runs.

    Attributes:
        epoch: The epoch being read (0 first); it moves when an iteration ends, and is
            saved and restored with the position.

    Raises:
        ValueError: For ``batch_size < 1``, a forbidden keyword, or a ``rank`` not below
            ``world_size``.
        TypeError: For a dataset without a length, or a ``rank``/``world_size`` that is not
            an int.

    Thread safety: iterate from one thread (the training loop).

    TF name: none (the role of ``tf.data.experimental.make_saveable_from_iterator``; TF 1's
    input queues did not checkpoint their position).
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 1,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        global_step: GlobalStepLike | None = None,
        rank: int = 0,
        world_size: int = 1,
        **loader_kwargs: Any,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        forbidden = {"sampler", "shuffle", "batch_sampler", "generator"} & set(loader_kwargs)
        if forbidden:
            raise ValueError(f"ResumableDataLoader chooses {sorted(forbidden)} itself")
        if not isinstance(dataset, Sized):
            raise TypeError(
                f"dataset must be a map-style dataset with a length (__len__), got {dataset!r}"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = ResumableSampler(
            len(dataset),  # type: ignore[arg-type]
            shuffle=shuffle,
            seed=seed,
            rank=rank,
            world_size=world_size,
        )
        self._seed = seed
        self._global_step = global_step
        init = loader_kwargs.pop("worker_init_fn", None)
        if not isinstance(init, IgnorePreemptionSignals):
            init = IgnorePreemptionSignals(init)
        self._worker_init_fn = init
        self._loader_kwargs = loader_kwargs
        self.epoch = 0
        self._consumed = 0  # batches of this epoch trained on (or fetched, without a step)
        self._fetched_at: collections.deque[int] = collections.deque()

    def __len__(self) -> int:
        """The batches of one epoch (of this rank's share)."""
        n = self.sampler.shard_length()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _settle(self) -> None:
        """Count the fetched batches whose training step has run."""
        if self._global_step is None:
            return
        step = read_step(self._global_step)
        while self._fetched_at and self._fetched_at[0] < step:
            self._fetched_at.popleft()
            self._consumed += 1

    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch that training has consumed."""
        self._settle()
        return self._consumed

    def __iter__(self) -> Iterator[Any]:
        self._settle()
        self._fetched_at.clear()  # Batches of an abandoned iteration not trained on: replayed.
        self.sampler.epoch = self.epoch
        self.sampler.start = self._consumed * self.batch_size
        generator = torch.Generator().manual_seed(self._seed * 1_000_003 + self.epoch)
        loader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=self.sampler,
            drop_last=self.drop_last,
            generator=generator,
            worker_init_fn=self._worker_init_fn,
            **self._loader_kwargs,
        )
        # Workers inherit the blocked signals; IgnorePreemptionSignals unblocks them there.
        with _blocked(self._worker_init_fn.signals if loader.num_workers else ()):
            started = time.perf_counter()
            batches = iter(loader)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            finally:  # The wait for the batch (the goodput ledger's ``data`` badput).
                INPUT_WAITS.add(time.perf_counter() - started)
            if self._global_step is None:
                self._consumed += 1
            else:
                self._settle()
                self._fetched_at.append(read_step(self._global_step))
            yield batch
            started = time.perf_counter()
        self.epoch += 1
        self._consumed = 0
        self._fetched_at.clear()

    def state_dict(self) -> dict[str, int]:
        """Return ``{"epoch", "batches_consumed"}``."""
        return {"epoch": self.epoch, "batches_consumed": self.batches_consumed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Continue from a saved position (takes effect at the next ``iter``)."""
        self.epoch = int(state_dict["epoch"])
        self._consumed = int(state_dict["batches_consumed"])
        self._fetched_at.clear()


@contextlib.contextmanager
def _blocked(signals: Iterable[signal.Signals]) -> Iterator[None]:
    """Block ``signals`` in this thread meanwhile; one that arrived is delivered at the end."""
    signals = set(signals)
    if not signals or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
