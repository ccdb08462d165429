"""REPA (representation alignment, Yu et al. 2024, arXiv 2410.06940) for routed DiTs: a projection head on the
tokens after one block, aligned by negative cosine similarity with a frozen encoder's patch features of the
clean image.

With routing, the aligned tokens are the ones the block actually computed: when the block lies inside a route,
only the kept tokens, each compared with the encoder feature of its own position (the route's token indices
gather the targets); outside a route, every token. Set-aside tokens have no new representation at that block,
so aligning them would only pull on the block's input, which is not REPA.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from tread.routing import gather_tokens


class RepaHead(nn.Module):
    """REPA's projector: a 3-layer MLP with SiLU from the model width to the encoder's feature width."""

    def __init__(self, hidden_size: int, encoder_dim: int, projector_dim: int = 2048):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden_size, projector_dim), nn.SiLU(),
                                 nn.Linear(projector_dim, projector_dim), nn.SiLU(),
                                 nn.Linear(projector_dim, encoder_dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(tokens)


def patch_targets(features: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Encoder patch features (B, C, h, w) -> (B, N, C) on the model's token grid (row-major, as the DiT's patch
    embedding orders tokens): unchanged when the grids agree, else area-averaged (coarser) or bilinearly
    interpolated (finer)."""
    h, w = grid
    if features.shape[-2:] != (h, w):
        if features.shape[-2] >= h and features.shape[-1] >= w:
            features = F.adaptive_avg_pool2d(features, (h, w))
        else:
            features = F.interpolate(features, size=(h, w), mode="bilinear", align_corners=False)
    return features.flatten(2).transpose(1, 2)


def alignment_loss(projected: torch.Tensor, targets: torch.Tensor, ids: Optional[torch.Tensor]) -> torch.Tensor:
    """Mean negative cosine similarity of projected tokens (B, K, C) with their targets (B, N, C); `ids` (B, K)
    are the kept tokens' positions when the aligned block lay inside a route (None: all N tokens)."""
    if ids is not None:
        targets = gather_tokens(targets, ids)
    return -F.cosine_similarity(projected.float(), targets.float(), dim=-1).mean()
