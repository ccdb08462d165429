"""REPA (representation alignment, Yu et al. 2024, arXiv 2410.06940) for routed DiTs: a projection head on the
tokens after one block, aligned by negative cosine similarity with a frozen encoder's patch features.

Inside a route only the kept tokens are aligned, each with its own position's feature (docs/research.md).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from tread.models.errors import ModelConfigError
from tread.routing import gather_tokens

# The backbone's auxiliary output (forward(..., return_aux=True) -> (output, aux)) holds under this key the
# aligned tokens: (projected tokens (B, K or N, C), their token ids (B, K) inside a route, else None).
REPA_AUX = "repa"


class RepaHead(nn.Module):
    """REPA's projector: a 3-layer MLP with SiLU from the model width to the encoder's feature width, on the tokens
    after block `block` (a plain attribute: the state dict holds only the MLP)."""

    def __init__(self, hidden_size: int, encoder_dim: int, projector_dim: int = 2048, block: int = 0):
        super().__init__()
        self.block = block
        self.mlp = nn.Sequential(nn.Linear(hidden_size, projector_dim), nn.SiLU(),
                                 nn.Linear(projector_dim, projector_dim), nn.SiLU(),
                                 nn.Linear(projector_dim, encoder_dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(tokens)

    def flops(self, num_tokens: int) -> float:
        """Forward FLOPs per sample (multiply-add = 2) on num_tokens tokens."""
        return float(sum(2 * num_tokens * m.in_features * m.out_features for m in self.mlp
                         if isinstance(m, nn.Linear)))


def repa_head(repa: Optional[Mapping[str, Any]], hidden_size: int, depth: int) -> Optional[RepaHead]:
    """The RepaHead of model.repa (None without it); its block may count from the end (null: from depth)."""
    if not repa:
        return None
    block = check_repa_block(resolve_repa_block(repa.get("block"), depth), depth)
    dim = repa.get("encoder_dim")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ModelConfigError(f"model.repa.encoder_dim={dim!r} must be a positive integer (the encoder's feature "
                               f"width; null is filled in from the encoder when training starts).")
    return RepaHead(hidden_size, dim, int(repa.get("projector_dim") or 2048), block)


def published_repa_block(depth: int) -> int:
    """REPA's published alignment depth as a rule of the model's depth: the tokens after the first
    max(1, min(8, depth // 3)) blocks (SiT-B, depth 12: 4; SiT-L, 24: 8; SiT-XL, 28: 8), as a 0-based block index."""
    return max(1, min(8, int(depth) // 3)) - 1


def resolve_repa_block(block: Any, depth: int) -> Any:
    """model.repa.block, or REPA's published block for `depth` when it is null (None)."""
    return published_repa_block(depth) if block is None else block


def check_repa_block(block: Any, depth: int) -> int:
    """model.repa.block as a block index in 0..depth-1 (it may count from the end); the schema checks it too,
    before the REPA encoder is built."""
    if isinstance(block, bool) or not isinstance(block, int) or not -depth <= block < depth:
        raise ModelConfigError(f"model.repa.block={block!r} must be a block index in {-depth}..{depth - 1} for a "
                               f"model of depth {depth} (REPA aligns the tokens after that block).")
    return block % depth


def repa_tap(head: Optional[RepaHead], return_aux: bool) -> Optional[dict]:
    """run_blocks' `tap` for the head's block when the forward was asked for its auxiliary output (None: the
    head does not run, as in every sampling forward)."""
    return {"block": head.block} if return_aux and head is not None else None


def repa_output(x: torch.Tensor, head: Optional[RepaHead], tap: Optional[dict], return_aux: bool) -> Any:
    """A backbone's return value: x, or with return_aux (x, aux), aux holding the projected tapped tokens and
    their ids under REPA_AUX (empty without a head)."""
    if not return_aux:
        return x
    return x, ({} if tap is None else {REPA_AUX: (head(tap["tokens"]), tap["ids"])})


def patch_targets(features: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Encoder patch features (B, C, h, w) -> (B, N, C) on the model's row-major token grid: unchanged when the grids
    agree, else area-averaged (coarser) or bilinearly interpolated (finer)."""
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
