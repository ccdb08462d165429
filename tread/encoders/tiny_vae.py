"""A tiny AutoencoderKL (downsampling 2, 4 latent channels, 0.17 M parameters) fitted briefly to given images:
an offline stand-in for a real VAE in the bucketed worked example (Makefile `example-buckets`), so precompute runs
its real VAE path and the decoded samples show what was learned. scripts/tiny_vae.py writes one."""
from __future__ import annotations

from pathlib import Path

import torch

from tread.utils.io import PathLike


def tiny_vae(seed: int = 0):
    """The untrained tiny AutoencoderKL (two encoder blocks: each side halves once)."""
    from diffusers import AutoencoderKL  # deferred: diffusers takes seconds to import

    torch.manual_seed(seed)
    return AutoencoderKL(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                         norm_num_groups=8, sample_size=32)


def fit_tiny_vae(vae, images: torch.Tensor, steps: int, seed: int = 0, batch_size: int = 32, lr: float = 2e-3,
                 kl_weight: float = 1e-6) -> list[float]:
    """Fit `vae` to `images` (N, 3, H, W) in [-1, 1] for `steps` Adam steps (MSE + a small KL), then set scaling_factor
    to 1 / std of the posterior means (unit-variance model space). Returns the loss every step."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    losses = []
    vae.train()
    for _ in range(steps):
        batch = images[torch.randint(0, len(images), (batch_size,), generator=gen)]
        posterior = vae.encode(batch).latent_dist
        loss = (vae.decode(posterior.sample(generator=gen)).sample - batch).pow(2).mean() + \
            kl_weight * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    vae.eval()
    with torch.no_grad():
        std = vae.encode(images[:256]).latent_dist.mean.std()
    vae.register_to_config(scaling_factor=float(1.0 / std))
    return losses


def save_tiny_vae(out: PathLike, images: torch.Tensor, steps: int = 300, seed: int = 0) -> tuple[Path, list[float]]:
    """The tiny VAE fitted to `images` for `steps` steps, saved with save_pretrained at `out`; (out, losses)."""
    vae = tiny_vae(seed)
    losses = fit_tiny_vae(vae, images, steps, seed) if steps else []
    out = Path(out).expanduser().absolute()
    vae.save_pretrained(out)
    return out, losses
