"""The VAE (diffusers AutoencoderKL) behind "vae"-decoded latent data: loading (cached, offline-aware),
encoding images to raw latents / posterior moments, and decoding model-space latents to uint8 pixels.

Conventions (tread/data/meta.py describes how a dataset records them):
    raw latents   what vae.encode() gives (mean or a draw of the posterior) and vae.decode() takes.
    model space   (raw - shift_factor) * scaling_factor; shift_factor is 0 for SD-VAE (FLUX's VAE has one).

Loading never hangs on a machine without network: a local directory is loaded as is; a hub id is looked
up in the local Hugging Face cache first, and only when it is not there (and HF_HUB_OFFLINE is unset and
the hub answers within a few seconds) downloaded. Failures raise EncoderError with the exact steps
to provide the weights.
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
HUB_PROBE_TIMEOUT_S = 3.0

_CACHE: dict[tuple[str, Optional[str], str, str], Any] = {}
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


def how_to_provide(name: str, subfolder: Optional[str] = None) -> str:
    """The steps that make VAE `name` loadable on an offline machine."""
    hub_id = name if _looks_like_hub_id(name) else DEFAULT_VAE
    sub = f" --include '{subfolder}/*'" if subfolder else ""
    local = f"/path/{hub_id.split('/')[-1]}"
    sub_py = f", subfolder='{subfolder}'" if subfolder else ""
    return (f"To provide it: on a machine with network run `hf download {hub_id}{sub} --local-dir {local}` "
            f"(older huggingface_hub: `huggingface-cli download ...` with the same arguments), or `python -c "
            f"\"from diffusers import AutoencoderKL; AutoencoderKL.from_pretrained('{hub_id}'{sub_py})"
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


def _fail(name: str, subfolder: Optional[str], reason: str) -> EncoderError:
    where = f"'{name}'" + (f" (subfolder '{subfolder}')" if subfolder else "")
    return EncoderError(f"cannot load the VAE {where}: {reason}. {how_to_provide(name, subfolder)}")


def _from_disk_or_hub(name: str, subfolder: Optional[str]):
    import warnings

    with warnings.catch_warnings():  # diffusers passes a deprecated argument to huggingface_hub
        warnings.filterwarnings("ignore", message=".*local_dir_use_symlinks.*", category=UserWarning)
        return _from_disk_or_hub_(name, subfolder)


def _from_disk_or_hub_(name: str, subfolder: Optional[str]):
    from diffusers import AutoencoderKL

    kwargs = {"subfolder": subfolder} if subfolder else {}
    local = _local_dir(name)
    if local is not None:
        try:
            return AutoencoderKL.from_pretrained(str(local), **kwargs)
        except Exception as err:  # noqa: BLE001 - any failure to read the directory is reported the same way
            raise _fail(name, subfolder, f"the directory '{local}' is not a loadable AutoencoderKL "
                                         f"({type(err).__name__}: {str(err).strip()[:300]})") from None
    try:
        return AutoencoderKL.from_pretrained(name, local_files_only=True, **kwargs)
    except (OSError, ValueError):
        pass  # not in the local cache
    if _hub_offline():
        raise _fail(name, subfolder, "it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set")
    if not _hub_reachable():
        raise _fail(name, subfolder, "it is not in the local Hugging Face cache and the hub cannot be reached "
                                     "(no network)")
    try:
        return AutoencoderKL.from_pretrained(name, **kwargs)
    except Exception as err:  # noqa: BLE001
        raise _fail(name, subfolder, f"download failed ({type(err).__name__}: {str(err).strip()[:300]})") from None


def load_vae(name_or_path: str, *, subfolder: Optional[str] = None, device: DeviceLike = "cpu",
             dtype: str = "float32"):
    """A diffusers AutoencoderKL in eval mode without gradients, cached per process.

    The cache key is (name, subfolder, device, dtype); a second device or dtype of an already loaded VAE is
    a copy of it, so the weights are read from disk (or the hub) once per process. Raises EncoderError
    naming the VAE and how to provide it when it cannot be loaded.
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise EncoderError(f"VAE name/path must be a non-empty string, got {name_or_path!r}")
    torch_dtype, dev = vae_dtype(dtype), resolve_device(device)
    local = Path(name_or_path).expanduser()
    name = str(local.absolute()) if local.is_dir() else name_or_path
    key = (name, subfolder or None, str(dev), dtype)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        same = [v for k, v in _CACHE.items() if k[:2] == key[:2]]
        vae = copy.deepcopy(same[0]) if same else _from_disk_or_hub(name, subfolder or None)
        # nn.Module.to: diffusers' override warns about fp32-only modules even when there are none
        vae = torch.nn.Module.to(vae, device=dev, dtype=torch_dtype).eval().requires_grad_(False)
        _CACHE[key] = vae
        return vae


def downsample_factor(vae) -> int:
    """Pixels per latent along each side (8 for SD-VAE)."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def _vae_device_dtype(vae) -> tuple[torch.device, torch.dtype]:
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
    """Images -> raw latents (no scaling or shift), float32 on the VAE's device.

    images: uint8 (B, H, W, 3) or float (B, 3, H, W) in [-1, 1]. kind: "moments" -> (B, 2C, h, w) =
    cat(mean, logvar) of the posterior; "mean" -> (B, C, h, w) mean; "sample" -> (B, C, h, w) one draw
    mean + std * eps with eps from `generator` (on the VAE's device; None: the global RNG).
    """
    if kind not in ENCODE_KINDS:
        raise ValueError(f"encode kind={kind!r}; allowed: {list(ENCODE_KINDS)}")
    device, dtype = _vae_device_dtype(vae)
    x = images_to_vae_input(images).to(device=device, dtype=dtype)
    dist = vae.encode(x).latent_dist
    mean, logvar = dist.mean.float(), dist.logvar.float()
    if kind == "moments":
        return torch.cat([mean, logvar], dim=1)
    if kind == "mean":
        return mean
    eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return mean + torch.exp(0.5 * logvar) * eps


@torch.no_grad()
def decode_raw_to_uint8(vae, raw: torch.Tensor, batch_size: int = 32) -> torch.Tensor:
    """Raw latents (B, C, h, w) -> uint8 (B, H, W, 3) on raw's device, decoded `batch_size` at a time."""
    if batch_size < 1:
        raise ValueError(f"decode batch_size must be >= 1, got {batch_size}")
    device, dtype = _vae_device_dtype(vae)
    if raw.ndim != 4 or raw.shape[1] != vae.config.latent_channels:
        raise EncoderError(f"the VAE takes (B, {vae.config.latent_channels}, h, w) latents, got shape "
                                 f"{list(raw.shape)}: the data and the VAE do not match")
    out = []
    for start in range(0, len(raw), batch_size):
        x = vae.decode(raw[start:start + batch_size].to(device=device, dtype=dtype)).sample.float()
        out.append(((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).to(raw.device))
    return torch.cat(out).contiguous()
