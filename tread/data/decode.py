"""Decoding model-space latents to uint8 pixels as a dataset's meta describes it (identity data directly, VAE data
with the VAE named in meta.json or a local override), and the start-up check that this will work. Video data
(latents (B, C, T, H, W)) decodes to clips (B, F, H', W', 3): identity clips frame by frame, video VAE data
(decode.class a video VAE) with tread.encoders.vae.decode_video."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from tread.encoders.errors import EncoderError
from tread.encoders.image_vaes import decode_model_space
from tread.encoders.vae import (MODEL_SPACE_IMAGE_VAES, VIDEO_VAE_CLASSES, decode_raw_to_uint8, decode_video,
                                from_model_space, latent_channels, load_vae, pixels_to_uint8,
                                vae_dtype as check_dtype)

from .meta import DECODE_TYPES, LatentDatasetError, latent_kind, model_shape, shift_factor

DECODE_RULES = ("ours", "paper")   # eval/sample/fid decode_rule: ours | the paper code's FID decode


def _vae_location(decode: Mapping[str, Any], vae: Optional[str]) -> tuple[str, Optional[str]]:
    """(VAE name/path, subfolder) to load: meta's, or the `vae` override. An override directory that holds
    the VAE itself (config.json at its top) ignores meta's subfolder; a copy of a whole model repo keeps it."""
    subfolder = decode.get("subfolder") or None
    if vae is None:
        return decode["vae"], subfolder
    if subfolder and (Path(vae).expanduser() / "config.json").is_file():
        subfolder = None
    return str(vae), subfolder


def _load_decoder(meta: Mapping[str, Any], vae: Optional[str], vae_dtype: str, device: Any):
    decode = meta["decode"]
    name, subfolder = _vae_location(decode, vae)
    try:
        return load_vae(name, subfolder=subfolder, device=device, dtype=vae_dtype,
                        cls=decode.get("class") or "AutoencoderKL")
    except EncoderError as err:
        raise LatentDatasetError(f"data meta decode.type='vae', vae={decode.get('vae')!r}"
                                 f"{'' if vae is None else f' (overridden by vae={vae!r})'}: {err} Training needs "
                                 f"the VAE only for in-training evaluation: without it, turn that off with "
                                 f"eval.every_steps=0 eval.at_end=false.") from None


def paper_decode_to_uint8(vae, raw: torch.Tensor, batch_size: int = 32) -> torch.Tensor:
    """decode_rule=paper: raw latents (B, C, h, w) -> uint8 (B, H, W, 3) as the paper code's FID decode does it: the
    VAE's weights in bf16 (load it so), decoding under the device's default autocast (CUDA: fp16, as its
    torch.cuda.amp.autocast(); CPU: bf16), then (x + 1) / 2 clamped to [0, 1], times 255, truncated to uint8."""
    device = next(vae.parameters()).device
    out = []
    for start in range(0, len(raw), batch_size):
        with torch.no_grad(), torch.autocast(device.type):
            x = vae.decode(raw[start:start + batch_size].to(device=device, dtype=torch.bfloat16)).sample
        x = ((x.float() + 1) / 2).clamp(0, 1)
        out.append((x * 255).to(torch.uint8).permute(0, 2, 3, 1).to(raw.device))
    return torch.cat(out).contiguous()


def decode_to_uint8(latents: torch.Tensor, meta: Mapping[str, Any], *, vae: Optional[str] = None,
                    vae_dtype: str = "float32", batch_size: int = 32, rule: str = "ours") -> torch.Tensor:
    """Model-space latents (B, C, H, W) -> uint8 images (B, H', W', 3) on the latents' device, per meta["decode"];
    video latents (B, C, T, H, W) -> uint8 clips (B, F, H', W', 3).

    identity: pixels = latents / latent_scale. vae: latents / latent_scale + shift_factor decoded by decode.vae (or
    the local directory `vae`) in `vae_dtype`, `batch_size` at a time; rule="paper" (eval.decode_rule) decodes
    AutoencoderKL data as the paper code does (paper_decode_to_uint8, in bfloat16). Video VAE data and model-space
    image VAE data (decode.class one of MODEL_SPACE_IMAGE_VAES) decode latents / latent_scale as model space with
    decode_video / decode_model_space; check_decodable refuses rule="paper" for them. The VAE is loaded once per process.
    """
    decode = meta.get("decode") or {"type": "identity"}
    if decode.get("type") == "vae" and decode.get("class") in VIDEO_VAE_CLASSES + MODEL_SPACE_IMAGE_VAES:
        model = _load_decoder(meta, vae, vae_dtype, latents.device)
        decoder = decode_video if decode["class"] in VIDEO_VAE_CLASSES else decode_model_space
        return decoder(model, latents.float() / float(meta.get("latent_scale", 1.0)), decode, batch_size=batch_size)
    if decode.get("type") == "vae":
        model = _load_decoder(meta, vae, "bfloat16" if rule == "paper" else vae_dtype, latents.device)
        raw = latents.float() / float(meta.get("latent_scale", 1.0)) + shift_factor(meta)
        if rule == "paper":
            return paper_decode_to_uint8(model, raw, batch_size=batch_size)
        return decode_raw_to_uint8(model, raw, batch_size=batch_size)
    if decode.get("type") != "identity":
        raise LatentDatasetError(f"meta decode.type={decode.get('type')!r} is unknown; allowed: {list(DECODE_TYPES)}")
    if latents.ndim not in (4, 5) or latents.shape[1] not in (1, 3):
        raise LatentDatasetError(f"identity decoding needs (B, C, H, W) or (B, C, T, H, W) latents with C = 1 or 3 "
                                 f"(pixels), got shape {list(latents.shape)}; data with other channel counts needs a "
                                 f"decoder (meta decode.type='vae')")
    images = pixels_to_uint8(latents.float() / float(meta.get("latent_scale", 1.0)))  # [-1, 1] -> [0, 255]
    return images.expand(*images.shape[:-1], 3).contiguous() if images.shape[-1] == 1 else images.contiguous()


def check_decodable(meta: Mapping[str, Any], *, vae: Optional[str] = None, vae_dtype: str = "float32",
                    batch_size: int = 32, device: Any = "cpu", rule: str = "ours") -> None:
    """Raise LatentDatasetError now (at start-up, not after hours of training) if this data cannot be decoded to
    pixels; VAE data loads the VAE (cached for decode_to_uint8 on `device`) and checks its latent channels. Same
    keyword arguments as decode_to_uint8, plus `device`."""
    decode = meta.get("decode") or {"type": "identity"}
    if decode.get("type") != "vae":
        decode_to_uint8(torch.zeros(1, *model_shape(meta)), meta)
        return
    if rule not in DECODE_RULES:
        raise LatentDatasetError(f"decode_rule={rule!r} is unknown; allowed: {list(DECODE_RULES)}")
    if rule == "paper" and (decode.get("class") or "AutoencoderKL") != "AutoencoderKL":
        raise LatentDatasetError(f"decode_rule='paper' is the paper code's decode of AutoencoderKL latents, but this "
                                 f"data's VAE is {decode.get('class')} (meta decode.class); use decode_rule=ours")
    check_dtype(vae_dtype)
    if batch_size < 1:
        raise LatentDatasetError(f"VAE decode batch size is {batch_size}; it must be >= 1")
    model = _load_decoder(meta, vae, "bfloat16" if rule == "paper" else vae_dtype, device)
    c = model_shape(meta)[0]
    if latent_channels(model) != c:
        name, _ = _vae_location(decode, vae)
        raise LatentDatasetError(f"the data has {c}-channel latents (meta.json shape {meta['shape']}, latent_kind "
                                 f"{latent_kind(meta)!r}) but the VAE '{name}' takes {latent_channels(model)} "
                                 f"channels: the data was encoded with another VAE")
    if decode.get("class") in VIDEO_VAE_CLASSES + MODEL_SPACE_IMAGE_VAES:
        try:                # the normalisation fits the latents (statistics per channel, the patch divides the grid)
            from_model_space(torch.zeros(1, *model_shape(meta)), decode)
        except EncoderError as err:
            raise LatentDatasetError(f"meta.json decode does not fit the data's latents (shape {meta['shape']}): "
                                     f"{err}") from None
