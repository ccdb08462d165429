"""Image VAEs whose diffusers pipelines feed the transformer normalised latents ("model space"), not AutoencoderKL's
(raw - shift_factor) * scaling_factor: what each pipeline does, read in diffusers 0.42.1's source, and the same
here (tests/test_image_vaes.py compares each with the pipeline's own encoding):

- AutoencoderKLFlux2 (Flux2Pipeline, ErnieImagePipeline, the FLUX.3 modular blocks): the posterior mean
  (`retrieve_latents(..., sample_mode="argmax")`), 2 x 2 space-to-depth (`_patchify_latents`), then per patchified
  channel (z - bn.running_mean) / sqrt(bn.running_var + batch_norm_eps) (`_encode_vae_image`); the inverse before
  `vae.decode`. Stored here unpatchified, (32, h, w), with the 128 statistics and decode.patch_size 2: the families
  patchify as the pipelines do, so the transformer sees the pipeline's values.
- AutoencoderKLQwenImage (QwenImage pipelines, Krea2Pipeline) and AutoencoderKLQwenImage21 (QwenImage21Pipeline):
  3D VAEs, an image is one frame; (z - latents_mean) / latents_std per channel from the VAE's config.
- AutoencoderDC (SanaPipeline): a deterministic encoder (`.latent`, no posterior); z * scaling_factor.

AutoencoderKL and the video VAEs stay in tread/encoders/vae.py.
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from tread.encoders.errors import EncoderError
from tread.encoders.vae import (MODEL_SPACE_IMAGE_VAES, decode_in_batches, downsample_factor, from_model_space,
                                images_to_vae_input, latent_channels, to_model_space, vae_device_dtype)

ONE_FRAME = ("AutoencoderKLQwenImage", "AutoencoderKLQwenImage21")   # 3D VAEs: (B, 3, 1, H, W) in, (B, C, 1, h, w) out
NO_POSTERIOR = ("AutoencoderDC",)                                     # encode(x).latent: nothing to draw from


def _check(vae) -> str:
    name = type(vae).__name__
    if name not in MODEL_SPACE_IMAGE_VAES:
        raise EncoderError(f"{name} is not a model-space image VAE; allowed: {list(MODEL_SPACE_IMAGE_VAES)}")
    return name


def spatial_factor(vae) -> int:
    """Pixels per latent along each side: AutoencoderKLFlux2 as Flux2Pipeline's vae_scale_factor, the others from
    their spatial_compression_ratio; AutoencoderKL as downsample_factor."""
    if type(vae).__name__ in ("AutoencoderKL", "AutoencoderKLFlux2"):
        return downsample_factor(vae)
    return int(vae.spatial_compression_ratio)


def image_vae_info(vae) -> dict:
    """The meta "decode" fields (less "vae" / "subfolder") of a loaded model-space image VAE: class, the
    normalisation (to_model_space's info), patch_size and spatial_factor."""
    name, config = _check(vae), vae.config
    info = {"type": "vae", "class": name, "scaling_factor": None, "shift_factor": None, "latents_mean": None,
            "latents_std": None, "patch_size": None, "spatial_factor": spatial_factor(vae)}
    if name == "AutoencoderKLFlux2":
        sides = list(config.patch_size) if isinstance(config.patch_size, (list, tuple)) else [config.patch_size] * 2
        if len(set(sides)) != 1:
            raise EncoderError(f"AutoencoderKLFlux2 patch_size {sides} is not square; the FLUX.2 pipelines patchify "
                               f"2 x 2")
        var = vae.bn.running_var.detach().double().cpu()
        info.update(latents_mean=[float(v) for v in vae.bn.running_mean.detach().double().cpu()],
                    latents_std=[float(v) for v in torch.sqrt(var + float(config.batch_norm_eps))],
                    patch_size=int(sides[0]))
    elif name in ONE_FRAME:
        info.update(latents_mean=[float(v) for v in config.latents_mean],
                    latents_std=[float(v) for v in config.latents_std])
    else:
        info["scaling_factor"] = float(config.scaling_factor)
    return info


@torch.no_grad()
def image_posterior(vae, images: Union[torch.Tensor, np.ndarray]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Images (uint8 (B, H, W, 3) or float (B, 3, H, W) in [-1, 1]) -> raw float32 (posterior mean, posterior std)
    (B, C, h, w) on the VAE's device; std is None for a deterministic encoder (AutoencoderDC)."""
    name = _check(vae)
    device, dtype = vae_device_dtype(vae)
    x = images_to_vae_input(images).to(device=device, dtype=dtype)
    if name in NO_POSTERIOR:
        return vae.encode(x).latent.float(), None
    dist = vae.encode(x[:, :, None] if name in ONE_FRAME else x).latent_dist
    mean, std = dist.mean.float(), dist.std.float()
    return (mean[:, :, 0], std[:, :, 0]) if name in ONE_FRAME else (mean, std)


def encode_model_space(vae, images: Union[torch.Tensor, np.ndarray], info: dict) -> torch.Tensor:
    """Images -> the posterior mean (B, C, h, w), float32, normalised per `info` (image_vae_info) as the pipeline's
    `_encode_vae_image` does."""
    return to_model_space(image_posterior(vae, images)[0], info)


def decode_model_space(vae, latents: torch.Tensor, info: dict, batch_size: int = 32) -> torch.Tensor:
    """Model-space latents (B, C, h, w) -> uint8 images (B, H, W, 3) on the latents' device, `batch_size` at a time:
    the pipeline's inverse normalisation, then vae.decode (a one-frame clip for the 3D VAEs)."""
    name = _check(vae)
    channels = latent_channels(vae)
    if latents.ndim != 4 or latents.shape[1] != channels:
        raise EncoderError(f"{name} takes (B, {channels}, h, w) latents, got shape {list(latents.shape)}: the data "
                           f"and the VAE do not match")

    def decode(z: torch.Tensor) -> torch.Tensor:
        return vae.decode(z[:, :, None]).sample[:, :, 0] if name in ONE_FRAME else vae.decode(z).sample

    return decode_in_batches(vae, from_model_space(latents, info), batch_size, decode)
