"""Deterministic, sharded, resumable batch loading: the batch order is a pure function of (seed, epoch, rank,
world_size, batch_size), so a resumed run sees exactly the batches an uninterrupted one would."""
from __future__ import annotations

import itertools
import warnings
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch

from .meta import LatentDatasetError
from .reader import LatentDataset

EPOCH_STRIDE = 1_000_003  # epoch e shuffles with seed + EPOCH_STRIDE * e: distinct streams for nearby seeds
PHASE_STRIDE = 7_919      # resolution schedule phase p draws with seed + PHASE_STRIDE * p


class BatchSizeError(LatentDatasetError):
    """A batch size the data cannot fill (every batch has batch_size samples): named by its config key."""


class EpochBatch(list):
    """A batch of sample indices with its place in the stream: `epoch` and the yielding sampler's `seed` (a phase's
    own seed under a resolution schedule), and `index_base`, the global index of the reading dataset's sample 0 (a
    bucket's offset). LatentDataset draws each sample's caption from them; a list otherwise, and it pickles to
    DataLoader workers with its attributes."""

    def __init__(self, indices: Sequence[int], epoch: int, seed: int, index_base: int = 0):
        super().__init__(indices)
        self.epoch, self.seed, self.index_base = int(epoch), int(seed), int(index_base)


class EpochSampler:
    """Infinite iterator over per-rank batches (lists of indices), epoch after epoch, where each epoch's batches
    are a pure function of the epoch (`epoch_batches`, cached one epoch at a time). Iterating advances the
    position; state_dict() is the position of the next batch to be yielded; batches_from(k) yields from the k-th
    batch of the whole stream (k = epoch * batches_per_epoch + batch)."""

    batches_per_epoch: int
    seed: int

    def __init__(self):
        self.epoch = self.batch = 0
        self._cached: tuple[int, Optional[list[list[int]]]] = (-1, None)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        raise NotImplementedError

    def _batches(self, epoch: int) -> list[list[int]]:
        if self._cached[0] != epoch:
            self._cached = (epoch, self.epoch_batches(epoch))
        return self._cached[1]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            epoch, batches = self.epoch, self._batches(self.epoch)
            while self.epoch == epoch:  # re-shuffles if load_state_dict moved us to another epoch
                current = batches[self.batch]
                self.batch += 1  # advance before yielding, so state_dict() names the next batch
                if self.batch == self.batches_per_epoch:
                    self.epoch, self.batch = self.epoch + 1, 0
                yield EpochBatch(current, epoch, self.seed)

    def batches_from(self, index: int) -> Iterator[list[int]]:
        """The stream from its `index`-th batch on (moves this sampler's position there)."""
        self.load_state_dict({"epoch": index // self.batches_per_epoch, "batch": index % self.batches_per_epoch})
        return iter(self)

    def locate(self, index: int) -> dict[str, int]:
        """The (epoch, batch) of the stream's `index`-th batch."""
        return {"epoch": index // self.batches_per_epoch, "batch": index % self.batches_per_epoch}

    def state_dict(self) -> dict[str, int]:
        """Position of the next batch: {"epoch": e, "batch": b}."""
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Make the next yielded batch the one at state's position."""
        epoch, batch = int(state["epoch"]), int(state["batch"])
        if epoch < 0 or not 0 <= batch < self.batches_per_epoch:
            raise ValueError(f"sampler state {dict(state)} is out of range: need epoch >= 0 and batch in "
                             f"[0, {self.batches_per_epoch}) (batches per epoch)")
        self.epoch, self.batch = epoch, batch


def _check_rank(rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")


class ShardedBatchSampler(EpochSampler):
    """Epoch e uses perm = randperm(num_samples, seed + EPOCH_STRIDE * e); rank r takes perm[r::world_size],
    truncated to num_samples // world_size so every rank has the same number of batches, and yields its
    consecutive chunks of batch_size (a partial last batch is dropped)."""

    def __init__(self, num_samples: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 drop_last: bool = True):
        super().__init__()
        if not drop_last:
            raise ValueError("ShardedBatchSampler only supports drop_last=True (every batch has batch_size items)")
        _check_rank(rank, world_size)
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.shard_size = num_samples // world_size
        if not 1 <= batch_size <= self.shard_size:
            raise BatchSizeError(
                f"the per-process batch size (from train.batch_size) is {batch_size}, but each of the {world_size} "
                f"process(es) gets only {self.shard_size} of the dataset's {num_samples} samples per epoch; it must "
                f"lie in [1, {self.shard_size}]: lower train.batch_size, use fewer processes, or use more data.")
        self.batches_per_epoch = self.shard_size // batch_size

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        """This rank's sample order for `epoch`, (shard_size,) int64."""
        gen = torch.Generator().manual_seed(self.seed + EPOCH_STRIDE * epoch)
        perm = torch.randperm(self.num_samples, generator=gen)
        return perm[self.rank::self.world_size][:self.shard_size]

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        order, b = self.epoch_indices(epoch), self.batch_size
        return [order[i * b:(i + 1) * b].tolist() for i in range(self.batches_per_epoch)]


class BucketBatchSampler(EpochSampler):
    """Batches drawn from one bucket at a time, the same bucket on every rank at every step (docs/buckets.md
    "Training on buckets"). Epoch e shuffles each bucket and then all buckets' batches with one generator seeded
    seed + EPOCH_STRIDE * e; a bucket with fewer than batch_size * world_size samples gives no batch (`dropped`
    names it). `buckets` limits the epoch to those bucket indices (a resolution schedule's phase)."""

    def __init__(self, bucket_sizes: Sequence[int], batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 buckets: Optional[Sequence[int]] = None):
        super().__init__()
        _check_rank(rank, world_size)
        self.bucket_sizes, self.batch_size, self.seed = list(bucket_sizes), batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.offsets = [sum(self.bucket_sizes[:i]) for i in range(len(self.bucket_sizes))]
        self.num_samples = sum(self.bucket_sizes)
        self.active = list(range(len(self.bucket_sizes)) if buckets is None else buckets)
        self.per_bucket = {b: self.bucket_sizes[b] // world_size // batch_size for b in self.active}
        self.dropped = [b for b in self.active if self.per_bucket[b] == 0]
        self.batches_per_epoch = sum(self.per_bucket.values())
        if not self.batches_per_epoch:
            raise BatchSizeError(
                f"no bucket has a batch: the per-process batch size (from train.batch_size) is {batch_size} on "
                f"{world_size} process(es), so a bucket needs at least {batch_size * world_size} samples, but the "
                f"buckets drawn from have {[self.bucket_sizes[b] for b in self.active]}: lower train.batch_size, "
                f"use fewer processes, or use fewer, larger buckets.")

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed + EPOCH_STRIDE * epoch)
        queues, labels = {}, []
        for b in self.active:
            n, k = self.bucket_sizes[b], self.per_bucket[b]
            mine = (torch.randperm(n, generator=gen) + self.offsets[b])[self.rank::self.world_size][:k * self.batch_size]
            queues[b] = iter(mine.view(k, self.batch_size).tolist()) if k else iter(())
            labels.extend([b] * k)
        order = torch.randperm(len(labels), generator=gen).tolist()
        return [next(queues[labels[i]]) for i in order]


class PhasedSampler:
    """A resolution schedule: phase p (from its first batch on) draws from its own sampler, seeded apart
    (seed + PHASE_STRIDE * p), from position 0; the stream's k-th batch is phase p's (k - start_p)-th. The state
    is the stream position, so resuming in any phase is exact."""

    def __init__(self, phases: Sequence[tuple[int, EpochSampler]]):
        self.phases = list(phases)
        self.seed = self.phases[0][1].seed

    def _phase(self, index: int) -> int:
        return max(p for p, (start, _) in enumerate(self.phases) if start <= index)

    def batches_from(self, index: int) -> Iterator[list[int]]:
        for p in range(self._phase(index), len(self.phases)):
            start, sampler = self.phases[p]
            stop = self.phases[p + 1][0] if p + 1 < len(self.phases) else None
            stream = sampler.batches_from(max(0, index - start))
            for k in itertools.count(max(index, start)):
                if stop is not None and k >= stop:
                    break
                yield next(stream)

    def locate(self, index: int) -> dict[str, int]:
        p = self._phase(index)
        return {**self.phases[p][1].locate(index - self.phases[p][0]), "phase": p}


Batch = Union[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def _batched(batch: Any) -> Any:
    """collate_fn: LatentDataset.__getitems__ already returns a collated (x, y) or (x, y, extras) batch."""
    return batch


class _Stream:
    """The batch_sampler a DataLoader iterates: `sampler`'s stream from batch `index` on."""

    def __init__(self, sampler: Union[EpochSampler, PhasedSampler], index: int):
        self.sampler, self.index = sampler, index

    def __iter__(self) -> Iterator[list[int]]:
        return self.sampler.batches_from(self.index)


SETTINGS = ("seed", "batch_size", "world_size", "num_samples")   # what gives a saved loader position its meaning


class LatentLoader:
    """Infinite iterator of (x float32 (B, C, H, W), y int64 (B,)) batches, or (x, y, extras) for data with
    extras, in `sampler`'s order (default: ShardedBatchSampler; bucketed data: bucketed.make_sampler's).
    state_dict() is the position of the next batch the caller gets (counted by the loader, since workers
    prefetch ahead of the sampler), so resuming is exact.
    """

    def __init__(self, dataset: LatentDataset, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int = 2,
                 sampler: Optional[Union[EpochSampler, PhasedSampler]] = None):
        self.dataset = dataset
        self.sampler = sampler or ShardedBatchSampler(len(dataset), batch_size, seed, rank, world_size)
        self.settings = {"seed": seed, "batch_size": batch_size, "world_size": world_size,
                         "num_samples": len(dataset)}
        self.num_workers, self.pin_memory, self.prefetch_factor = num_workers, pin_memory, prefetch_factor
        self._next = 0  # index in the stream (epoch * batches_per_epoch + batch) of the next batch to return
        self._iter = None  # the DataLoader iterator, (re)built lazily at position self._next

    def _start(self) -> Iterator:
        # The loader is infinite, so one DataLoader iterator lives for the whole run (no persistent_workers).
        # Its own generator: starting an iterator draws a worker base seed, which from the global RNG would
        # shift the training noise stream of a resumed run (whose iterator starts after the RNG restore).
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=_Stream(self.sampler, self._next), collate_fn=_batched,
            num_workers=self.num_workers, pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,
            generator=torch.Generator().manual_seed(self.sampler.seed))
        return iter(loader)

    def __iter__(self) -> "LatentLoader":
        return self

    def __next__(self) -> Batch:
        if self._iter is None:
            self._iter = self._start()
        batch = next(self._iter)  # pin_memory turns the tuple into a list: hand back a tuple either way
        self._next += 1
        return tuple(batch)

    def state_dict(self) -> dict[str, int]:
        """Position of the next batch the caller will receive ("index" in the stream; its epoch and batch, and
        the resolution schedule's phase, for reading), plus the settings that give it meaning."""
        return {**self.sampler.locate(self._next), "index": self._next, **self.settings}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue exactly where the loader that produced `state` stopped (drops prefetched batches)."""
        changed = {k: (state[k], self.settings[k]) for k in SETTINGS if k in state and state[k] != self.settings[k]}
        if changed:
            warnings.warn(f"resuming the data loader with changed settings {changed} (saved, now): the batch "
                          f"order will differ from the original run's", stacklevel=2)
        if "index" in state and not changed:
            self._next = int(state["index"])
        else:   # clamping only matters with changed settings: it keeps the resumed run near where it stopped
            bpe = getattr(self.sampler, "batches_per_epoch", None) or self.sampler.phases[-1][1].batches_per_epoch
            self._next = int(state["epoch"]) * bpe + min(int(state["batch"]), bpe)
        self._iter = None  # shuts down old workers; the next __next__ restarts at the new position
