"""Routing a sequence that is split across processes (context parallelism, docs/scaling.md).

Each of the `degree` processes of a context group holds one contiguous shard of the routable tokens. A route
keeps the same number of tokens in every shard (`shard_keep`: the route's keep count spread evenly, rounded up,
and grown to the most tokens any shard force-keeps), so no process waits for another at the all-to-all; each
shard picks its kept tokens among its own, from the scores drawn for the whole sequence (identical on every
process of the group: the router is seeded per context group). One process holding the whole sequence routes
it the same way with `shards=degree` (TokenRouter.select), which is what the tests compare a split run against.
"""
from __future__ import annotations

import math
from typing import Optional, Protocol

import torch

from tread.routing.spec import RouteConfigError


class SequenceSplit(Protocol):
    """What the block loop needs of a split sequence: the group's size, this process's shard, its share of a
    whole-sequence tensor, and the whole sequence back from the shards (with gradients)."""

    degree: int     # processes of the context group, shards of the sequence
    index: int      # this process's shard

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """(B, N, ...) -> this process's contiguous (B, N / degree, ...) share."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N / degree, ...) from every process -> (B, N, ...) in shard order."""
        ...


def check_split(num_tokens: int, degree: int, where: str = "train.context_parallel.degree") -> None:
    """A sequence of `num_tokens` splits into `degree` equal shards, or a one-line RouteConfigError."""
    if degree < 1 or num_tokens % degree:
        raise RouteConfigError(f"{where}={degree}: the sequence has {num_tokens} routable tokens, which do not split "
                               f"into {degree} equal shards; allowed: a degree dividing {num_tokens} (or a token "
                               f"grid whose size the degree divides).")


def shard_keep(num_keep: int, num_tokens: int, degree: int, force_keep: Optional[torch.Tensor] = None) -> int:
    """The route's kept tokens over the whole sequence when it is cut into `degree` shards: every shard keeps
    ceil(num_keep / degree), grown to the most tokens one shard of one sample force-keeps (one host sync, only
    with a mask); returns degree times that."""
    check_split(num_tokens, degree)
    per_shard = min(math.ceil(num_keep / degree), num_tokens // degree)
    if force_keep is not None:
        forced = force_keep.to(torch.bool).reshape(force_keep.shape[0], degree, -1).sum(dim=2)
        per_shard = max(per_shard, int(forced.max()))
    return per_shard * degree


def top_per_shard(score: torch.Tensor, num_keep: int, shards: int) -> torch.Tensor:
    """Indices (B, num_keep) of the highest scores of (B, N), num_keep / shards from each contiguous shard, shard
    by shard (a token's index is its place in the whole sequence)."""
    B, N = score.shape
    n, k = N // shards, num_keep // shards
    if shards == 1:
        return score.topk(min(num_keep, N), dim=1, sorted=False).indices
    ids = score.view(B, shards, n).topk(k, dim=2, sorted=False).indices              # (B, P, k) within shards
    offsets = torch.arange(shards, device=score.device).view(1, shards, 1) * n
    return (ids + offsets).reshape(B, shards * k)
