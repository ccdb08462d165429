"""Image-to-video conditioning frames (`model.i2v`), as the diffusers image-to-video pipelines feed them.

The clean first-frame latents replace the noisy ones, get timestep 0, are force-kept by every route and left
out of the loss (docs/video.md, "Image-to-video (first frames)").
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

FIRST_FRAME, I2V_MASK = "first_frame", "i2v"
IMAGE_EMBEDS = "image_embeds"           # the first frame through the pipeline's image encoder (HunyuanVideo 1.5)
I2V_KEYS = (FIRST_FRAME, IMAGE_EMBEDS)  # the data's image-to-video inputs: passed on only with model.i2v


def conditioned(cond: Optional[Mapping[str, torch.Tensor]], batch: int, device: torch.device) -> Optional[torch.Tensor]:
    """(B,) bool: the samples whose first frames are given (cond["i2v"], default all), or None without
    cond["first_frame"]."""
    if not cond or cond.get(FIRST_FRAME) is None:
        return None
    use = cond.get(I2V_MASK)
    return torch.ones(batch, dtype=torch.bool, device=device) if use is None else use.to(device=device, dtype=torch.bool)


def condition_inputs(x: torch.Tensor, noise_level: torch.Tensor, first: torch.Tensor, use: torch.Tensor,
                     tokens_per_frame: int, frames_per_token: int = 1, given_level: float = 0.0,
                     per_frame: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pipeline's inputs at one step: x (B, C, T, H, W) noisy latents, noise_level (B,) or (B, N), first
    (B, C, Tc, H, W) clean latents, use (B,) bool. Returns (x with the `use` samples' first Tc frames replaced,
    (B, N) noise levels that are `given_level` on their tokens (Wan, LTX-Video: 0; Cosmos: its sigma_conditioning),
    (B, N) bool marking those tokens). per_frame (a (B,) noise_level only): the levels as (B, T') per token frame,
    the form a per-frame model (Cosmos) takes."""
    B, Tc = x.shape[0], first.shape[2]
    if tuple(first.shape[:2]) != tuple(x.shape[:2]) or tuple(first.shape[3:]) != tuple(x.shape[3:]) or \
            Tc > x.shape[2] or Tc % frames_per_token:
        raise ValueError(f"conditioning frames cond['first_frame'] {list(first.shape)} do not fit latents "
                         f"{list(x.shape)}: they need the latents' batch, channels and frame size, and at most their "
                         f"frames (a multiple of {frames_per_token}).")
    sel = use.view(B, 1, 1, 1, 1)
    x = torch.cat([torch.where(sel, first.to(x.dtype), x[:, :, :Tc]), x[:, :, Tc:]], dim=2)
    frames = x.shape[2] // frames_per_token
    n = frames * tokens_per_frame
    given = torch.zeros(B, n, dtype=torch.bool, device=x.device)
    given[:, :Tc // frames_per_token * tokens_per_frame] = True
    given &= use[:, None]
    if per_frame:
        if noise_level.dim() != 1:
            raise ValueError(f"per-frame conditioning takes one noise level per sample, got {tuple(noise_level.shape)}")
        at = given.view(B, frames, tokens_per_frame)[:, :, 0]
        level = noise_level[:, None].expand(B, frames)
    else:
        at, level = given, noise_level[:, None].expand(B, n) if noise_level.dim() == 1 else noise_level
    return x, torch.where(at, torch.full_like(level, given_level), level), given


def restore_frames(x: torch.Tensor, first: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
    """After the last step: the `use` samples' first frames of x (B, C, T, H, W) are the clean conditioning latents
    first (B, C, Tc, H, W), as the pipelines put them back."""
    Tc = first.shape[2]
    sel = use.to(torch.bool).view(-1, 1, 1, 1, 1)
    return torch.cat([torch.where(sel, first.to(x.dtype), x[:, :, :Tc]), x[:, :, Tc:]], dim=2)


def frame_loss_weight(loss: torch.Tensor, cond: Optional[Mapping[str, torch.Tensor]]) -> Optional[torch.Tensor]:
    """(B, 1, T, 1, 1) weights of an unreduced video loss (B, C, T, H, W): 0 on the conditioned samples' given
    frames, 1 elsewhere; None when no frame is given."""
    use = conditioned(cond, loss.shape[0], loss.device)
    if use is None or loss.dim() != 5:
        return None
    Tc = cond[FIRST_FRAME].shape[2]
    weight = torch.ones(loss.shape[0], 1, loss.shape[2], 1, 1, device=loss.device, dtype=loss.dtype)
    weight[:, :, :Tc] = (~use).to(loss.dtype).view(-1, 1, 1, 1, 1)
    return weight
