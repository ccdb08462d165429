"""REPA targets stored beside the latents (docs/data.md "REPA features"): a frozen encoder's patch features of each
training image, computed at precompute time, with their meta "repa_features" record (whose digest names the
encoder's weights as loaded) and the checks that a run's encoder matches them."""
from __future__ import annotations

import hashlib
from typing import Any, Mapping, Optional

import numpy as np
import torch
import torch.nn as nn

from tread.encoders.patch import PatchEncoder


def encoder_digest(encoder: nn.Module) -> str:
    """sha256 over the encoder's state dict (each tensor's name, dtype, shape and bytes, in name order): the same
    for the same network on any device and from any file it was loaded from."""
    digest = hashlib.sha256()
    for name, tensor in sorted(encoder.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{list(tensor.shape)}|".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def encoder_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 images (B, H, W, 3) -> the encoders' input (B, 3, H, W) float in [-1, 1]."""
    return images.permute(0, 3, 1, 2).float() / 127.5 - 1


@torch.no_grad()
def image_features(encoder: PatchEncoder, images: np.ndarray) -> np.ndarray:
    """uint8 images (B, H, W, 3) -> the encoder's patch features (B, dim, h, w) float32, on the encoder's device."""
    device = next(encoder.parameters()).device
    return encoder(encoder_input(torch.from_numpy(np.ascontiguousarray(images)).to(device))).float().cpu().numpy()


def encoder_meta(name: str, encoder: PatchEncoder, weights: Optional[str], resolution: int) -> dict[str, Any]:
    """meta "repa_features" but the grid (the features' own): `encoder` (name, weights) on `resolution` px images."""
    return {"encoder": name, "digest": encoder_digest(encoder), "dim": int(encoder.dim), "weights": weights,
            "resolution": int(resolution)}


def features_mismatch(stored: Optional[Mapping[str, Any]], name: str, encoder: PatchEncoder) -> Optional[str]:
    """Why the stored features (meta "repa_features", None: none stored) are not `encoder`'s (None: they are)."""
    if stored is None:
        return "the data stores no REPA features (meta.json has no 'repa_features')"
    if stored["encoder"] != name:
        return f"the data's REPA features are encoder {stored['encoder']!r}'s, not {name!r}'s"
    if int(stored["dim"]) != int(encoder.dim):
        return f"the data's REPA features are {stored['dim']} wide, the encoder's {encoder.dim}"
    digest = encoder_digest(encoder)
    if stored["digest"] != digest:
        return (f"the data's REPA features were made by other {name} weights (digest {stored['digest'][:12]}..., "
                f"{stored.get('weights')!r}) than this run's ({digest[:12]}...)")
    return None
