"""The VAE (diffusers AutoencoderKL, or a video VAE): loading (cached, offline-aware), encoding to raw latents
or posterior moments, and decoding model-space latents, (raw - shift_factor) * scaling_factor, to uint8 pixels.

Loading never hangs without network: local folders first, then the local hub cache, and a download only when
the hub answers within seconds; failures raise EncoderError with the steps to provide the weights.
"""
from __future__ import annotations

import copy
import os
import socket
import threading
from pathlib import Path
from typing import Any, Optional, Union
from urllib.parse import urlparse

import numpy as np
import torch

from tread.encoders.errors import EncoderError
from tread.utils.device import DeviceLike, resolve_device

DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
VAE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENCODE_KINDS = ("moments", "sample", "mean")
# diffusers classes of video VAEs (clips (B, 3, F, H, W) <-> latents (B, C, T, h, w)); load_vae's `cls`
# Kandinsky 5's video pipelines use AutoencoderKLHunyuanVideo (HunyuanVideo 1.0's), LTX-2's AutoencoderKLLTX2Video
VIDEO_VAE_CLASSES = ("AutoencoderKLWan", "AutoencoderKLLTXVideo", "AutoencoderKLHunyuanVideo15",
                     "AutoencoderKLHunyuanVideo", "AutoencoderKLLTX2Video")
LTX_VAES = ("AutoencoderKLLTXVideo", "AutoencoderKLLTX2Video")   # statistics in buffers, compression as attributes
# image VAEs whose pipelines feed the transformer normalised latents (tread/encoders/image_vaes.py): FLUX.2's (FLUX.2,
# ERNIE-Image, FLUX.3), Qwen-Image's (Qwen-Image, Krea 2), Qwen-Image 2.1's and Sana's deep-compression autoencoder
MODEL_SPACE_IMAGE_VAES = ("AutoencoderKLFlux2", "AutoencoderKLQwenImage", "AutoencoderKLQwenImage21", "AutoencoderDC")
IMAGE_VAE_CLASSES = ("AutoencoderKL",) + MODEL_SPACE_IMAGE_VAES
VAE_CLASSES = IMAGE_VAE_CLASSES + VIDEO_VAE_CLASSES
HUB_PROBE_TIMEOUT_S = 3.0

_CACHE: dict[tuple[str, Optional[str], str, str, str], Any] = {}
_LOCK = threading.Lock()


def clear_vae_cache() -> None:
    """Forget every loaded VAE (tests; freeing memory)."""
    with _LOCK:
        _CACHE.clear()


def vae_dtype(name: str) -> torch.dtype:
    """"float32" | "bfloat16" | "float16" -> torch dtype; anything else raises naming the allowed values."""
    if name not in VAE_DTYPES:
        raise EncoderError(f"VAE dtype {name!r} is not supported; allowed: {list(VAE_DTYPES)}")
    return VAE_DTYPES[name]


def how_to_provide(name: str, subfolder: Optional[str] = None, cls: str = "AutoencoderKL") -> str:
    """The steps that make VAE `name` (of diffusers class `cls`) loadable on an offline machine."""
    hub_id = name if _looks_like_hub_id(name) else DEFAULT_VAE
    sub = f" --include '{subfolder}/*'" if subfolder else ""
    local = f"/path/{hub_id.split('/')[-1]}"
    sub_py = f", subfolder='{subfolder}'" if subfolder else ""
    return (f"To provide it: on a machine with network run `hf download {hub_id}{sub} --local-dir {local}` "
            f"(older huggingface_hub: `huggingface-cli download ...` with the same arguments), or `python -c "
            f"\"from diffusers import {cls}; {cls}.from_pretrained('{hub_id}'{sub_py})"
            f".save_pretrained('{local}')\"`; copy that directory here and pass it with vae={local} (sample.py, "
            f"fid.py), eval.vae={local} (training) or --vae {local} (scripts/precompute_latents.py). "
            f"Alternatively put the model into this machine's Hugging Face cache (HF_HOME).")


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return (len(parts) == 2 and all(parts) and not name.startswith((".", "~", "/"))
            and not any(c.isspace() or c == "\\" for c in name))


def _local_dir(name: str) -> Optional[Path]:
    """The local directory `name` names, None for a hub id; raises if it looks like a path but is missing."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path.absolute()
    if path.exists():
        raise EncoderError(f"VAE path '{name}' is a file; expected a diffusers AutoencoderKL directory "
                                 f"(config.json + weights, as written by save_pretrained). {how_to_provide(name)}")
    if not _looks_like_hub_id(name):
        raise EncoderError(f"VAE directory '{name}' does not exist (and it is not a hub id like "
                                 f"'{DEFAULT_VAE}'). {how_to_provide(name)}")
    return None


def _hub_offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return bool(constants.HF_HUB_OFFLINE) or env in {"1", "ON", "YES", "TRUE"}


def _hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """A quick TCP probe of the hub endpoint (huggingface_hub itself retries for ~25 s without network).
    With a proxy configured a direct probe says nothing, so the download is simply attempted."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=timeout):
            return True
    except OSError:
        return False


def _fail(name: str, subfolder: Optional[str], reason: str, cls: str = "AutoencoderKL") -> EncoderError:
    where = f"'{name}'" + (f" (subfolder '{subfolder}')" if subfolder else "")
    return EncoderError(f"cannot load the VAE {where}: {reason}. {how_to_provide(name, subfolder, cls)}")


def _from_disk_or_hub(name: str, subfolder: Optional[str], cls: str = "AutoencoderKL"):
    import warnings

    with warnings.catch_warnings():  # diffusers passes a deprecated argument to huggingface_hub
        warnings.filterwarnings("ignore", message=".*local_dir_use_symlinks.*", category=UserWarning)
        return _from_disk_or_hub_(name, subfolder, cls)


def _from_disk_or_hub_(name: str, subfolder: Optional[str], cls: str):
    import diffusers  # deferred: diffusers takes seconds to import

    AutoencoderKL = getattr(diffusers, cls)  # noqa: N806 - the class named by `cls` (AutoencoderKL by default)
    kwargs = {"subfolder": subfolder} if subfolder else {}
    local = _local_dir(name)
    if local is not None:
        try:
            return AutoencoderKL.from_pretrained(str(local), **kwargs)
        except Exception as err:  # noqa: BLE001 - any failure to read the directory is reported the same way
            raise _fail(name, subfolder, f"the directory '{local}' is not a loadable {cls} "
                                         f"({type(err).__name__}: {str(err).strip()[:300]})", cls) from None
    try:
        return AutoencoderKL.from_pretrained(name, local_files_only=True, **kwargs)
    except (OSError, ValueError):
        pass  # not in the local cache
    if _hub_offline():
        raise _fail(name, subfolder, "it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set", cls)
    if not _hub_reachable():
        raise _fail(name, subfolder, "it is not in the local Hugging Face cache and the hub cannot be reached "
                                     "(no network)", cls)
    try:
        return AutoencoderKL.from_pretrained(name, **kwargs)
    except Exception as err:  # noqa: BLE001
        raise _fail(name, subfolder, f"download failed ({type(err).__name__}: {str(err).strip()[:300]})", cls) from None


def load_vae(name_or_path: str, *, subfolder: Optional[str] = None, device: DeviceLike = "cpu",
             dtype: str = "float32", cls: str = "AutoencoderKL"):
    """A diffusers VAE of class `cls` (VAE_CLASSES) in eval mode without gradients, cached per process by (name,
    subfolder, device, dtype, cls); raises EncoderError naming the VAE and how to provide it."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise EncoderError(f"VAE name/path must be a non-empty string, got {name_or_path!r}")
    if cls not in VAE_CLASSES:
        raise EncoderError(f"VAE class {cls!r} is not supported; allowed: {list(VAE_CLASSES)}")
    torch_dtype, dev = vae_dtype(dtype), resolve_device(device)
    local = Path(name_or_path).expanduser()
    name = str(local.absolute()) if local.is_dir() else name_or_path
    key = (name, subfolder or None, str(dev), dtype, cls)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        same = [v for k, v in _CACHE.items() if k[:2] == key[:2] and k[4] == cls]
        vae = copy.deepcopy(same[0]) if same else _from_disk_or_hub(name, subfolder or None, cls)
        # nn.Module.to: diffusers' override warns about fp32-only modules even when there are none
        vae = torch.nn.Module.to(vae, device=dev, dtype=torch_dtype).eval().requires_grad_(False)
        _CACHE[key] = vae
        return vae


def latent_channels(vae) -> int:
    """Channels of the VAE's latents (AutoencoderKLWan calls them z_dim)."""
    return int(vae.config.get("z_dim", None) or vae.config.latent_channels)


def downsample_factor(vae) -> int:
    """Pixels per latent along each side (8 for SD-VAE)."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def vae_device_dtype(vae) -> tuple[torch.device, torch.dtype]:
    p = next(vae.parameters())
    return p.device, p.dtype


def images_to_vae_input(images: Union[torch.Tensor, np.ndarray]) -> torch.Tensor:
    """uint8 (B, H, W, 3) NHWC images -> float32 (B, 3, H, W) in [-1, 1]; float (B, 3, H, W) passes as is."""
    x = torch.from_numpy(np.ascontiguousarray(images)) if isinstance(images, np.ndarray) else images
    if x.dtype == torch.uint8:
        if x.ndim != 4 or x.shape[-1] != 3:
            raise ValueError(f"uint8 images must be (B, H, W, 3), got shape {list(x.shape)}")
        return x.permute(0, 3, 1, 2).float() / 127.5 - 1.0
    if not x.is_floating_point() or x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"images must be uint8 (B, H, W, 3) or float (B, 3, H, W) in [-1, 1], got {x.dtype} "
                         f"{list(x.shape)}")
    return x.float()


@torch.no_grad()
def encode(vae, images: Union[torch.Tensor, np.ndarray], *, kind: str = "moments",
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Images (uint8 (B, H, W, 3) or float (B, 3, H, W) in [-1, 1]) -> raw float32 latents on the VAE's device.

    kind: "moments" -> (B, 2C, h, w) cat(mean, logvar); "mean" -> (B, C, h, w); "sample" -> one draw, eps from
    `generator` (None: the global RNG).
    """
    if kind not in ENCODE_KINDS:
        raise ValueError(f"encode kind={kind!r}; allowed: {list(ENCODE_KINDS)}")
    device, dtype = vae_device_dtype(vae)
    x = images_to_vae_input(images).to(device=device, dtype=dtype)
    dist = vae.encode(x).latent_dist
    mean, logvar = dist.mean.float(), dist.logvar.float()
    if kind == "moments":
        return torch.cat([mean, logvar], dim=1)
    if kind == "mean":
        return mean
    eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return mean + torch.exp(0.5 * logvar) * eps


def pixels_to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1], channels on dim 1 ((B, C, H, W) or (B, C, F, H, W)) -> uint8, channels last."""
    return ((x.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, *range(2, x.ndim), 1)


@torch.no_grad()
def decode_in_batches(vae, raw: torch.Tensor, batch_size: int, decode) -> torch.Tensor:
    """Raw latents -> uint8 pixels, channels last, on raw's device: `decode(z)` (pixels in [-1, 1]) on the VAE's
    device and dtype, `batch_size` latents at a time."""
    if batch_size < 1:
        raise ValueError(f"decode batch_size must be >= 1, got {batch_size}")
    device, dtype = vae_device_dtype(vae)
    out = [pixels_to_uint8(decode(raw[start:start + batch_size].to(device=device, dtype=dtype))).to(raw.device)
           for start in range(0, len(raw), batch_size)]
    return torch.cat(out).contiguous()


def decode_raw_to_uint8(vae, raw: torch.Tensor, batch_size: int = 32) -> torch.Tensor:
    """Raw latents (B, C, h, w) -> uint8 (B, H, W, 3) on raw's device, decoded `batch_size` at a time."""
    if raw.ndim != 4 or raw.shape[1] != vae.config.latent_channels:
        raise EncoderError(f"the VAE takes (B, {vae.config.latent_channels}, h, w) latents, got shape "
                                 f"{list(raw.shape)}: the data and the VAE do not match")
    return decode_in_batches(vae, raw, batch_size, lambda z: vae.decode(z).sample)


# ----------------------------------------------------------------------------- video VAEs
#
# Model space = what the family's diffusers pipeline feeds its transformer, one formula for all (absent = neutral):
#     model = (raw - shift_factor - latents_mean) * scaling_factor / latents_std      (per channel, dim 1)
# Wan (WanPipeline):                  (raw - latents_mean) / latents_std          (config latents_mean / latents_std)
# LTX-Video (LTXPipeline._normalize_latents): (raw - latents_mean) * scaling_factor / latents_std  (the VAE's buffers)
# LTX-2 (LTX2Pipeline._normalize_latents): the same, AutoencoderKLLTX2Video's buffers
# HunyuanVideo 1.5 (its pipelines):   raw * scaling_factor
# Kandinsky 5 (Kandinsky5I2VPipeline; its decode: latents / scaling_factor): raw * scaling_factor, AutoencoderKLHunyuanVideo

def check_frame_count(frames: int, temporal_factor: int) -> None:
    """Raise EncoderError unless a clip of `frames` pixel frames suits a VAE of this temporal factor: frames =
    1 + k * temporal_factor (the first frame alone, then temporal_factor frames per latent frame)."""
    k = temporal_factor
    if isinstance(frames, bool) or not isinstance(frames, (int, np.integer)) or frames < 1 or (frames - 1) % k:
        near = 1 + max(0, (int(frames) - 1) // k) * k if isinstance(frames, (int, np.integer)) else 1
        raise EncoderError(f"a clip of {frames!r} frames does not suit a VAE of temporal factor {k}: allowed "
                           f"1 + k * {k} frames (1, {1 + k}, {1 + 2 * k}, ...), e.g. {near} or {near + k}")


def _video_factors(vae) -> tuple[int, int]:
    """(temporal, spatial) compression of a video VAE, from its architecture."""
    config = vae.config
    if type(vae).__name__ == "AutoencoderKLWan":
        stages = len(config.dim_mult) - 1
        return 2 ** sum(map(bool, config.temperal_downsample[:stages])), 2 ** stages * (config.patch_size or 1)
    if type(vae).__name__ in LTX_VAES:
        return int(vae.temporal_compression_ratio), int(vae.spatial_compression_ratio)
    return int(config.temporal_compression_ratio), int(config.spatial_compression_ratio)


def _floats(values) -> Optional[list[float]]:
    return None if values is None else [float(v) for v in torch.as_tensor(values).flatten().tolist()]


def video_vae_info(vae) -> dict:
    """The decode fields of a loaded video VAE (meta "decode" less "vae" / "subfolder"): class, scaling and shift
    factors, latents_mean / latents_std (None when absent), temporal and spatial factors."""
    name = type(vae).__name__
    if name not in VIDEO_VAE_CLASSES:
        raise EncoderError(f"{name} is not a video VAE; allowed: {list(VIDEO_VAE_CLASSES)}")
    config = vae.config
    if name == "AutoencoderKLWan":
        scale, mean, std = None, _floats(config.latents_mean), _floats(config.latents_std)
    elif name in LTX_VAES:
        scale, mean, std = float(config.scaling_factor), _floats(vae.latents_mean), _floats(vae.latents_std)
    else:
        scale, mean, std = float(config.scaling_factor), None, None
    temporal, spatial = _video_factors(vae)
    return {"type": "vae", "class": name, "scaling_factor": scale, "shift_factor": None, "latents_mean": mean,
            "latents_std": std, "temporal_factor": temporal, "spatial_factor": spatial}


def _normalisation(info: dict, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(shift + mean, std) shaped to broadcast over `like` (channels on dim 1; with decode.patch_size p > 1, over
    `like` viewed as (B, C, h / p, p, w / p, p), see _patched), and the scaling factor."""
    c, p = like.shape[1], int(info.get("patch_size") or 1)
    # p > 1: one statistic per channel of the p x p space-to-depth latents, channel c * p * p + i * p + j for the
    # pixel (i, j) of each p x p cell (FLUX.2's _patchify_latents order)
    count, view = (c * p * p, (1, c, 1, p, 1, p)) if p > 1 else (c, (1, c) + (1,) * (like.ndim - 2))

    def per_channel(key: str, neutral: float) -> torch.Tensor:
        values = info.get(key)
        t = torch.full((count,), neutral) if values is None else torch.as_tensor(values, dtype=torch.float32)
        if t.numel() != count:
            raise EncoderError(f"decode.{key} has {t.numel()} values but the latents have {c} channels"
                               + (f" ({count} after the {p} x {p} patchify of decode.patch_size)" if p > 1 else ""))
        return t.view(view).to(like.device, torch.float32)

    offset = per_channel("latents_mean", 0.0) + float(info.get("shift_factor") or 0.0)
    return offset, per_channel("latents_std", 1.0), float(info.get("scaling_factor") or 1.0)


def _patched(x: torch.Tensor, info: dict) -> torch.Tensor:
    """x (B, C, h, w) viewed as (B, C, h / p, p, w / p, p) for decode.patch_size p > 1; x itself otherwise."""
    p = int(info.get("patch_size") or 1)
    if p == 1:
        return x
    if x.ndim != 4 or x.shape[2] % p or x.shape[3] % p:
        raise EncoderError(f"latents of shape {list(x.shape)} do not patchify by decode.patch_size {p}: (B, C, h, w) "
                           f"with h and w multiples of {p} expected")
    b, c, h, w = x.shape
    return x.reshape(b, c, h // p, p, w // p, p)


def to_model_space(raw: torch.Tensor, info: dict) -> torch.Tensor:
    """Raw latents (B, C, ...) -> model space (float32), per `info` (video_vae_info, image_vae_info, meta "decode")."""
    patched = _patched(raw.float(), info)
    offset, std, scale = _normalisation(info, raw)
    return ((patched - offset) * scale / std).reshape(raw.shape)


def from_model_space(latents: torch.Tensor, info: dict) -> torch.Tensor:
    """Model-space latents (B, C, ...) -> raw latents the VAE decodes (float32); the inverse of to_model_space."""
    patched = _patched(latents.float(), info)
    offset, std, scale = _normalisation(info, latents)
    return (patched * std / scale + offset).reshape(latents.shape)


def _check_clips(vae, clips: torch.Tensor) -> tuple[int, int]:
    temporal, spatial = _video_factors(vae)
    if clips.ndim != 5 or clips.shape[1] != 3 or not clips.is_floating_point():
        raise EncoderError(f"clips must be float (B, 3, F, H, W) in [-1, 1], got {clips.dtype} {list(clips.shape)}")
    check_frame_count(int(clips.shape[2]), temporal)
    if clips.shape[3] % spatial or clips.shape[4] % spatial:
        raise EncoderError(f"clip frames of {clips.shape[4]}x{clips.shape[3]} (WxH) do not suit {type(vae).__name__}: "
                           f"width and height must be multiples of its spatial factor {spatial}")
    return temporal, spatial


@torch.no_grad()
def encode_video(vae, clips: torch.Tensor, kind: str = "mean",
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Clips float (B, 3, F, H, W) in [-1, 1] -> raw float32 latents (B, C, 1 + (F - 1) / temporal_factor, H / s,
    W / s); kind "mean": the posterior mean, "sample": one draw with eps from `generator`."""
    if kind not in ("mean", "sample"):
        raise ValueError(f"encode_video kind={kind!r}; allowed: ['mean', 'sample']")
    _check_clips(vae, clips)
    device, dtype = vae_device_dtype(vae)
    step = _clips_per_call(vae, len(clips))
    dists = [vae.encode(clips[i:i + step].to(device=device, dtype=dtype)).latent_dist for i in range(0, len(clips), step)]
    mean = torch.cat([d.mean.float() for d in dists])
    if kind == "mean":
        return mean
    eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return mean + torch.cat([d.std.float() for d in dists]) * eps


def _clips_per_call(vae, wanted: int) -> int:
    """Clips one encode / decode call takes: 1 for AutoencoderKLHunyuanVideo15, whose attention mask (diffusers
    0.42) does not broadcast over a batch of more than one clip; else `wanted`."""
    return 1 if type(vae).__name__ == "AutoencoderKLHunyuanVideo15" else max(1, wanted)


def decode_video(vae, latents: torch.Tensor, info: dict, batch_size: int = 1) -> torch.Tensor:
    """Model-space latents (B, C, T, h, w) -> uint8 clips (B, 1 + (T - 1) * temporal_factor, H, W, 3), `batch_size`
    clips at a time; timestep-conditioned LTX VAEs decode at timestep 0, as LTXPipeline."""
    channels = latent_channels(vae)
    if latents.ndim != 5 or latents.shape[1] != channels:
        raise EncoderError(f"{type(vae).__name__} takes (B, {channels}, T, h, w) latents, got shape "
                           f"{list(latents.shape)}: the data and the VAE do not match")
    timestep = vae.config.get("timestep_conditioning", False)

    def decode(z: torch.Tensor) -> torch.Tensor:
        extra = {"temb": torch.zeros(len(z), device=z.device, dtype=z.dtype)} if timestep else {}
        return vae.decode(z, **extra).sample

    if batch_size < 1:
        raise ValueError(f"decode batch_size must be >= 1, got {batch_size}")
    return decode_in_batches(vae, from_model_space(latents, info), _clips_per_call(vae, batch_size), decode)
