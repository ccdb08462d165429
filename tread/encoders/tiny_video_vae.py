"""A tiny AutoencoderKLWan fitted briefly to given clips: an offline stand-in for Wan's VAE in the video worked
example, recording per-channel latents_mean / latents_std as Wan's VAE does (docs/video.md, "Video VAEs").
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence, Union

import torch

from tread.utils.io import PathLike

LATENT_CHANNELS = 4
SPATIAL_FACTOR, TEMPORAL_FACTOR = 2, 2   # clips of 1 + 2k frames of H x W -> 1 + k latent frames of H/2 x W/2
LOGVAR_INIT = -8.0      # initial posterior log-variance (std 0.018): samples start close to the mean


def tiny_video_vae(seed: int = 0):
    """The untrained tiny AutoencoderKLWan: 8 and 16 channels, halving each side and the frame count (after the
    first frame), so 1 + 2k frames of H x W become 1 + k latent frames of H/2 x W/2 with 4 channels."""
    from diffusers import AutoencoderKLWan  # deferred: diffusers takes seconds to import

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 2], num_res_blocks=1,
                           temperal_downsample=[True], latents_mean=[0.0] * LATENT_CHANNELS,
                           latents_std=[1.0] * LATENT_CHANNELS, scale_factor_temporal=TEMPORAL_FACTOR,
                           scale_factor_spatial=SPATIAL_FACTOR)
    with torch.no_grad():
        vae.quant_conv.bias[LATENT_CHANNELS:] = LOGVAR_INIT        # (mean, logvar) channels of the posterior
    return vae


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """AutoencoderKLWan.decode(z).sample without its final clamp to [-1, 1]: raw (B, z_dim, T, h, w) latents ->
    (B, 3, 1 + 2 (T - 1), 2h, 2w), latent frame by latent frame through the decoder's causal cache as diffusers does."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for i in range(x.shape[2]):
        vae._conv_idx = [0]
        frames.append(vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                  first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(frames, 2)


def fit_tiny_video_vae(vae, clips: Union[torch.Tensor, Sequence[torch.Tensor]], steps: int, seed: int = 0,
                       batch_size: int = 4, lr: float = 3e-3, kl_weight: float = 1e-6) -> list[float]:
    """Fit `vae` to `clips` ((N, 3, F, H, W) in [-1, 1], or a list of such tensors taken in turn) for `steps` Adam
    steps, decoding through decode_unclamped, then record latents_mean / latents_std. Returns the MSE per step."""
    sets = [clips] if isinstance(clips, torch.Tensor) else list(clips)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(steps, 1))))
    losses = []
    vae.train()
    for step in range(steps):
        data = sets[step % len(sets)]
        batch = data[torch.randint(0, len(data), (batch_size,), generator=gen)]
        posterior = vae.encode(batch).latent_dist
        mse = (decode_unclamped(vae, posterior.sample(generator=gen)) - batch).pow(2).mean()
        loss = mse + kl_weight * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(mse.item())
    vae.eval()
    record_latent_stats(vae, sets)
    return losses


def record_latent_stats(vae, sets: Sequence[torch.Tensor], per_set: int = 64) -> None:
    """Set vae's config latents_mean / latents_std to the per-channel mean and std of the posterior means of (up to
    `per_set` clips of) each clip tensor in `sets`, pooled."""
    with torch.no_grad():
        per_channel = torch.cat([vae.encode(data[i:i + 16]).latent_dist.mean.transpose(0, 1).flatten(1)
                                 for data in sets for i in range(0, min(len(data), per_set), 16)], 1)   # (C, ...)
    vae.register_to_config(latents_mean=per_channel.mean(1).tolist(), latents_std=per_channel.std(1).tolist())


def save_tiny_video_vae(out: PathLike, clips: Union[torch.Tensor, Sequence[torch.Tensor]], steps: int = 300,
                        seed: int = 0) -> tuple[Path, list[float]]:
    """The tiny video VAE fitted to `clips` (a tensor or a list, fit_tiny_video_vae) for `steps` steps, saved with
    save_pretrained at `out`; (out, losses)."""
    vae = tiny_video_vae(seed)
    losses = fit_tiny_video_vae(vae, clips, steps, seed) if steps else []
    out = Path(out).expanduser().absolute()
    vae.save_pretrained(out)
    return out, losses
