"""Deterministic, sharded, resumable batch loading over a LatentDataset.

The batch order is a pure function of (seed, epoch, rank, world_size, batch_size), so a run resumed from
a checkpoint sees exactly the batches an uninterrupted run would have seen.
"""
from __future__ import annotations

import warnings
from typing import Any, Iterator, Mapping, Union

import torch

from .reader import LatentDataset

EPOCH_STRIDE = 1_000_003  # epoch e shuffles with seed + EPOCH_STRIDE * e: distinct streams for nearby seeds


class ShardedBatchSampler:
    """Infinite iterator over per-rank batches (lists of indices), epoch after epoch.

    Epoch e uses perm = randperm(num_samples, seed + EPOCH_STRIDE * e); rank r takes perm[r::world_size],
    truncated to num_samples // world_size so every rank has the same number of batches, and yields its
    consecutive chunks of batch_size (a partial last batch is dropped). Iterating advances the sampler's
    position; state_dict() is the position of the next batch to be yielded.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 drop_last: bool = True):
        if not drop_last:
            raise ValueError("ShardedBatchSampler only supports drop_last=True (every batch has batch_size items)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.shard_size = num_samples // world_size
        if not 1 <= batch_size <= self.shard_size:
            raise ValueError(
                f"the per-process batch size (from train.batch_size) is {batch_size}, but each of the {world_size} "
                f"process(es) gets only {self.shard_size} of the dataset's {num_samples} samples per epoch; it must "
                f"lie in [1, {self.shard_size}]: lower train.batch_size, use fewer processes, or use more data.")
        self.batches_per_epoch = self.shard_size // batch_size
        self.epoch = self.batch = 0

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        """This rank's sample order for `epoch`, (shard_size,) int64."""
        gen = torch.Generator().manual_seed(self.seed + EPOCH_STRIDE * epoch)
        perm = torch.randperm(self.num_samples, generator=gen)
        return perm[self.rank::self.world_size][:self.shard_size]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            epoch, order = self.epoch, self.epoch_indices(self.epoch)
            while self.epoch == epoch:  # re-shuffles if load_state_dict moved us to another epoch
                start = self.batch * self.batch_size
                self.batch += 1  # advance before yielding, so state_dict() names the next batch
                if self.batch == self.batches_per_epoch:
                    self.epoch, self.batch = self.epoch + 1, 0
                yield order[start:start + self.batch_size].tolist()

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


Batch = Union[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def _batched(batch: Any) -> Any:
    """collate_fn: LatentDataset.__getitems__ already returns a collated (x, y) or (x, y, extras) batch."""
    return batch


class LatentLoader:
    """Infinite iterator of (x float32 (B, C, H, W), y int64 (B,)) batches that can be checkpointed exactly;
    (x, y, extras) batches, passed through as the dataset returns them, for data with per-sample
    conditioning / loss masks (LatentDataset.has_extras).

    Workers prefetch ahead of the caller, so the sampler's own position runs ahead too; the loader instead
    counts the batches it has handed out, and state_dict() is the position of the next one the caller gets.
    """

    def __init__(self, dataset: LatentDataset, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int = 2):
        self.dataset = dataset
        self.sampler = ShardedBatchSampler(len(dataset), batch_size, seed, rank, world_size)
        self.num_workers, self.pin_memory, self.prefetch_factor = num_workers, pin_memory, prefetch_factor
        self._next = 0  # global index (epoch * batches_per_epoch + batch) of the next batch to return
        self._iter = None  # the DataLoader iterator, (re)built lazily at position self._next

    def _start(self) -> Iterator:
        bpe = self.sampler.batches_per_epoch
        self.sampler.load_state_dict({"epoch": self._next // bpe, "batch": self._next % bpe})
        # The loader is infinite, so one DataLoader iterator lives for the whole run (no persistent_workers).
        # Its own generator: starting an iterator draws a worker base seed, which from the global RNG would
        # shift the training noise stream of a resumed run (whose iterator starts after the RNG restore).
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=self.sampler, collate_fn=_batched, num_workers=self.num_workers,
            pin_memory=self.pin_memory, prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,
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
        """Position of the next batch the caller will receive, plus the settings that give it meaning."""
        s = self.sampler
        return {"epoch": self._next // s.batches_per_epoch, "batch": self._next % s.batches_per_epoch,
                "seed": s.seed, "batch_size": s.batch_size, "world_size": s.world_size, "num_samples": s.num_samples}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue exactly where the loader that produced `state` stopped (drops prefetched batches)."""
        s = self.sampler
        changed = {k: (state[k], getattr(s, k)) for k in ("seed", "batch_size", "world_size", "num_samples")
                   if k in state and state[k] != getattr(s, k)}
        if changed:
            warnings.warn(f"resuming the data loader with changed settings {changed} (saved, now): the batch "
                          f"order will differ from the original run's", stacklevel=2)
        # Clamping only matters with changed settings: it keeps the resumed run near where it stopped.
        self._next = int(state["epoch"]) * s.batches_per_epoch + min(int(state["batch"]), s.batches_per_epoch)
        self._iter = None  # shuts down old workers; the next __next__ restarts at the new position
