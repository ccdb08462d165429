"""DINOv2 from a local transformers folder (never downloaded), its input conventions and a digest of its weights.
REPA's patch encoder (tread/encoders/patch.py) and FDD's feature network (tread/encoders/features.py) load it."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open

from tread.encoders.errors import EncoderError

DINO_SIZE = 224                  # DINOv2's input side: images are resized to it (bicubic)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
REPA_DINOV2 = "facebook/dinov2-base"     # REPA's encoder (ViT-B/14)
FDD_DINOV2 = "facebook/dinov2-large"     # FDD is defined on ViT-L/14 (Stein et al. 2023; dgm-eval's default)
FDD_WIDTH, FDD_DEPTH = 1024, 24          # ViT-L/14's hidden size and number of blocks


def weights_digest(folder: Union[str, Path]) -> str:
    """A short digest of a weights folder's files (names, sizes and modification times)."""
    files = sorted(p for p in Path(folder).expanduser().resolve().rglob("*") if p.is_file())
    text = "|".join(f"{p.name}:{p.stat().st_size}:{int(p.stat().st_mtime)}" for p in files)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def how_to_provide(key: str, model_id: str) -> str:
    """The offline steps that make DINOv2 weights loadable with `key`."""
    return (f"save one on a machine with network: `from transformers import Dinov2Model; "
            f"Dinov2Model.from_pretrained('{model_id}').save_pretrained('DIR')`, copy DIR here and set {key}=DIR")


def load_dinov2(weights: Optional[Union[str, Path]], key: str, model_id: str = REPA_DINOV2) -> nn.Module:
    """A local Dinov2Model (no download); one EncoderError naming `key` (and how to save `model_id`) when it is
    missing or does not load."""
    how = how_to_provide(key, model_id)
    check_dinov2_folder(weights, key, model_id)
    from transformers import Dinov2Model    # optional heavy import, only for DINOv2 runs
    try:
        return Dinov2Model.from_pretrained(str(Path(weights).expanduser()), local_files_only=True)
    except (OSError, ValueError, SafetensorError) as err:
        raise EncoderError(f"{key}={str(weights)!r} does not load as a Dinov2Model ({err}): {how}.") from None


def check_dinov2_folder(weights: Optional[Union[str, Path]], key: str, model_id: str = REPA_DINOV2) -> None:
    """One EncoderError naming `key` unless `weights` is a saved Dinov2Model folder whose config.json is there and
    whose safetensors files open (their headers read, not the weights): cheap, so callers check before any work."""
    check_weights_folder(weights, key, "DINOv2", "Dinov2Model", how_to_provide(key, model_id))


def check_weights_folder(weights: Optional[Union[str, Path]], key: str, what: str, cls: str, how: str) -> None:
    """One EncoderError naming `key` unless `weights` is a saved transformers `cls` folder (`what` weights) whose
    config.json is there and whose safetensors files open (headers only)."""
    if not weights:
        raise EncoderError(f"{key} is not set; {what} weights are read from a local folder only: {how}.")
    if not (Path(weights).expanduser() / "config.json").is_file():
        raise EncoderError(f"{key}={str(weights)!r} is not a saved {cls} folder (no config.json there): {how}.")
    broken = broken_safetensors(Path(weights).expanduser())
    if broken is not None:
        raise EncoderError(f"{key}={str(weights)!r}: '{broken[0]}' is not a whole safetensors file ({broken[1]}; "
                           f"truncated or corrupt copy?): {how}.")


def broken_safetensors(folder: Path) -> Optional[tuple[Path, str]]:
    """(file, why) for the first .safetensors file in `folder` whose header does not open (a truncated or corrupt
    copy: its header, tensor table and size are checked, the weights not read); None when all open."""
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt"):
                pass
        except (SafetensorError, OSError) as err:
            return file, str(err)
    return None


def fdd_pixels(images: torch.Tensor, side: int = DINO_SIZE) -> torch.Tensor:
    """uint8 (B, 3, H, W) images -> float32 (B, 3, side, side) DINOv2 input as dgm-eval makes it (side 224):
    antialiased bicubic resize (no crop), / 255, ImageNet mean and std. FVD's VideoMAE frames are made the same way."""
    x = images.float()
    for size in ((x.shape[-2], side), (side, side)):                      # PIL: the width pass, then the height
        if tuple(x.shape[-2:]) != size:                                   # pass, each rounded to uint8
            x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).clamp(0, 255).round()
    mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
    return (x / 255 - mean) / std


def fdd_architecture_note(model: nn.Module) -> Optional[str]:
    """A one-line note when `model` is not ViT-L/14 (FDD's definition), else None."""
    cfg = model.config
    width, depth, patch = int(cfg.hidden_size), int(cfg.num_hidden_layers), int(cfg.patch_size)
    if (width, depth, patch) == (FDD_WIDTH, FDD_DEPTH, 14):
        return None
    return (f"note: FDD is defined on DINOv2 ViT-L/14 ({FDD_DINOV2}: width {FDD_WIDTH}, {FDD_DEPTH} blocks); these "
            f"weights are width {width}, {depth} blocks, patch {patch}: their FDD is not comparable with published "
            f"FDD numbers")
