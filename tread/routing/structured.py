"""Structured selection (routing.selection.mode=structured): SPRINT's group-wise token subsampling.

The grid is cut into k x k groups per frame and each keeps its share at random offsets, written as scores for
the router's usual top-K, so the compiled forward is unchanged (docs/routes.md, "Structured selection").
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from tread.routing.spec import RouteConfigError

Grid3 = tuple[int, int, int]


def group_side(ratio: float) -> int:
    """The group side k for a route dropping `ratio` of the tokens: the smallest k with k*k*(1 - ratio) >= 1."""
    if ratio <= 0.0:
        return 1
    return max(1, math.ceil(math.sqrt(1.0 / (1.0 - float(ratio))) - 1e-6))


def token_grid3(grid: Optional[Sequence[int]], num_tokens: int) -> Grid3:
    """The batch's token grid as (t, h, w) (an image backbone's (h, w) is one frame), checked against N."""
    if grid is None:
        raise RouteConfigError("routing.selection.mode=structured needs the batch's token grid (t, h, w), but this "
                               "backbone passes none; allowed here: routing.selection.mode=random or importance.")
    t, h, w = (1, *grid) if len(grid) == 2 else tuple(grid)
    if t * h * w != num_tokens:
        raise ValueError(f"structured selection: token grid {(t, h, w)} has {t * h * w} tokens, the batch {num_tokens}.")
    return int(t), int(h), int(w)


def order_size(grid: Grid3, k: int) -> int:
    """Uniforms one sample's within-group order draws: every position of the grid padded to whole k x k groups."""
    t, h, w = grid
    return t * (-(-h // k) * k) * (-(-w // k) * k)


def structured_scores(order: torch.Tensor, jitter: torch.Tensor, grid: Grid3, k: int,
                      force_keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scores (B, N) in (0, 1] from `order` (B, order_size) and `jitter` (B, N) uniforms in [0, 1): 1 - (rank +
    jitter) / k^2, rank = the token's place in its group's random order (force-kept tokens first)."""
    B, (t, h, w) = order.shape[0], grid
    H, W = -(-h // k) * k, -(-w // k) * k                                         # sides padded to whole groups
    inside = (torch.arange(H, device=order.device)[:, None] < h) & (torch.arange(W, device=order.device) < w)
    v = torch.where(inside, order.view(B, t, H, W), 2.0)                          # padding ranks last
    if force_keep is not None:
        forced = force_keep.to(device=order.device, dtype=order.dtype).view(B, t, h, w)
        v = v - F.pad(forced, (0, W - w, 0, H - h))                               # forced rank first
    v = v.view(B, t, H // k, k, W // k, k).transpose(3, 4).reshape(B, t, H // k, W // k, k * k)
    rank = v.argsort(dim=-1).argsort(dim=-1)                                      # 0 = the group's offset
    rank = rank.view(B, t, H // k, W // k, k, k).transpose(3, 4).reshape(B, t, H, W)[:, :, :h, :w]
    return 1.0 - (rank.reshape(B, -1).to(jitter.dtype) + jitter) / (k * k)
