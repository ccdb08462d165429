"""Loss-mask and token-keep geometry next to routing: a per-sample loss mask (coverage in [0, 1] at any
resolution) brought to the latent grid (resize_loss_mask, to weight the loss) or to the token grid
(token_keep_mask, which tokens a masked model keeps)."""
from __future__ import annotations

from typing import Sequence

import torch


def _area_weights(src: int, dst: int) -> torch.Tensor:
    """(dst, src) float64 matrix: row i holds the fraction of target cell i covered by each source pixel
    (exact: in units of 1 / dst pixel every overlap has integer ends)."""
    i = torch.arange(dst, dtype=torch.int64)[:, None]
    j = torch.arange(src, dtype=torch.int64)[None, :]
    overlap = (torch.minimum((i + 1) * src, (j + 1) * dst) - torch.maximum(i * src, j * dst)).clamp_min(0)
    return overlap.double() / src


def _area_resize(mask: torch.Tensor, hw: Sequence[int], name: str) -> torch.Tensor:
    """Exact area-weighted resize of a (B, 1, Hm, Wm) (or (B, Hm, Wm)) coverage mask to (B, 1, H, W), float64."""
    if not (isinstance(hw, (tuple, list, torch.Size)) and len(hw) == 2 and
            all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in hw)):
        raise ValueError(f"{name}: the target size is {hw!r} but must be (H, W) with two positive integers")
    if mask.ndim == 3:
        mask = mask.unsqueeze(1)
    if mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[2] < 1 or mask.shape[3] < 1:
        raise ValueError(f"{name}: loss_mask must be a (B, 1, Hm, Wm) (or (B, Hm, Wm)) coverage mask in [0, 1], "
                         f"got shape {list(mask.shape)}")
    if mask.dtype == torch.uint8:
        raise ValueError(f"{name}: loss_mask is uint8; pass coverage in [0, 1] (uint8 / 255, as LatentDataset "
                         f"returns it)")
    (h, w), (hm, wm) = hw, mask.shape[2:]
    wh, ww = _area_weights(hm, h).to(mask.device), _area_weights(wm, w).to(mask.device)
    return torch.einsum("hi,bcij,wj->bchw", wh, mask.double(), ww)


def resize_loss_mask(loss_mask: torch.Tensor, hw: Sequence[int]) -> torch.Tensor:
    """Area-resize a (B, 1, Hm, Wm) coverage mask in [0, 1] to (B, 1, H, W): each output is the exact area-weighted
    mean over its pixel (F.interpolate(mode="area") for divisible sizes), in the mask's float dtype."""
    out = _area_resize(loss_mask, hw, "resize_loss_mask")
    dtype = loss_mask.dtype if loss_mask.is_floating_point() else torch.float32
    return out.clamp_(0.0, 1.0).to(dtype)


def token_keep_mask(loss_mask: torch.Tensor, grid_hw: Sequence[int]) -> torch.Tensor:
    """(B, Ht * Wt) bool, row-major: True for the tokens of an (Ht, Wt) grid more than half covered (+1e-6, so an
    exactly half-covered token is never kept) by `loss_mask` (B, 1, Hm, Wm) in [0, 1], at any resolution."""
    return (_area_resize(loss_mask, grid_hw, "token_keep_mask") > 0.5 + 1e-6).flatten(1)
