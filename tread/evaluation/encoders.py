"""Frozen patch-feature encoders for REPA (model.repa.encoder): images (B, 3, H, W) in [-1, 1] -> patch features
(B, dim, h, w), no gradients.

* "dinov2": a local transformers Dinov2Model (model.repa.encoder_weights, a save_pretrained folder): the last
  layer's patch tokens (CLS and register tokens dropped) on the patch grid, for 224 px inputs (ImageNet mean and
  std, bicubic resize), as REPA uses them.
* "toy": for the built-in data, the project's offline toy classifier (tread/evaluation/toy_classifier.py) trained with
  its own seed (REPA_TOY_SEED), NOT the network whose features the toy FID uses (that would align the model with
  the evaluator itself): its last convolutional feature map (128 channels at 1/4 of the image side).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from tread.evaluation.toy_classifier import load_or_train_toy_classifier
from tread.utils.errors import UserError

ENCODERS = ("toy", "dinov2")
REPA_TOY_SEED = 777              # another seed than the FID feature network's (toy_classifier.DEFAULT_SEED)
DINO_SIZE = 224
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class EncoderError(UserError):
    """A REPA encoder that cannot be built (unknown name, missing or unloadable local weights)."""


class PatchEncoder(nn.Module):
    """Base: frozen, eval mode; subclasses set `dim` and implement `features`."""

    dim: int

    def freeze(self) -> "PatchEncoder":
        return self.eval().requires_grad_(False)

    def train(self, mode: bool = True) -> "PatchEncoder":   # stays in eval mode (batch norm statistics frozen)
        return super().train(False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.features(images.float())

    def features(self, images: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ToyPatchEncoder(PatchEncoder):
    """The toy classifier's trunk up to its last conv block (before pooling)."""

    LAST_CONV = 14    # index in classifier.trunk of the ReLU ending the 5th conv block

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.classifier = classifier
        self.dim = classifier.trunk[self.LAST_CONV - 2].out_channels
        self.resolution = int(classifier.resolution)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        x = images
        if x.shape[-2:] != (self.resolution, self.resolution):
            x = F.interpolate(x, size=(self.resolution, self.resolution), mode="bilinear", antialias=True,
                              align_corners=False)
        return self.classifier.trunk[:self.LAST_CONV + 1](x)


class DinoPatchEncoder(PatchEncoder):
    """A transformers Dinov2Model's last-layer patch tokens on its patch grid."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.dim = int(model.config.hidden_size)
        self.patch = int(model.config.patch_size)
        self.skip = 1 + int(getattr(model.config, "num_register_tokens", 0) or 0)   # CLS (+ registers)
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        """The last layer's tokens (B, 1 + registers + patches, dim) of images in [-1, 1]: resized to 224 px
        (bicubic) and normalised with ImageNet's mean and std."""
        x = F.interpolate((images + 1) / 2, size=(DINO_SIZE, DINO_SIZE), mode="bicubic", align_corners=False)
        return self.model(pixel_values=(x - self.mean) / self.std).last_hidden_state

    def features(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.tokens(images)[:, self.skip:]
        side = DINO_SIZE // self.patch
        return tokens.transpose(1, 2).reshape(tokens.shape[0], self.dim, side, side)


class DinoFeatures(nn.Module):
    """FDD's feature network (Stein et al. 2023): the DINOv2 CLS token of uint8 (B, 3, H, W) images (the
    metric extractors' input convention, tread/evaluation/features.py). `name` carries a digest of the weights, so
    cached reference statistics are never reused for other weights."""

    def __init__(self, model: nn.Module, weights: Union[str, Path]):
        super().__init__()
        self.encoder = DinoPatchEncoder(model)
        self.dim = self.spatial_dim = self.encoder.dim
        self.name = f"dinov2_{weights_digest(weights)}"

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_all(images)["pool"]

    @torch.no_grad()
    def forward_all(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """pool: the CLS token (FDD's features); spatial: the mean patch token (what a cached reference keeps
        beside it; no metric reads it)."""
        tokens = self.encoder.tokens(images.float() / 127.5 - 1).float()
        return {"pool": tokens[:, 0], "spatial": tokens[:, self.encoder.skip:].mean(dim=1)}


def weights_digest(folder: Union[str, Path]) -> str:
    """A short digest of a weights folder's files (names, sizes and modification times)."""
    files = sorted(p for p in Path(folder).expanduser().resolve().rglob("*") if p.is_file())
    text = "|".join(f"{p.name}:{p.stat().st_size}:{int(p.stat().st_mtime)}" for p in files)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def load_dinov2(weights: Optional[Union[str, Path]], key: str) -> nn.Module:
    """A local Dinov2Model (no download); one EncoderError naming `key` when it is missing or does not load."""
    how = ("save one on a machine with network: `from transformers import Dinov2Model; "
           "Dinov2Model.from_pretrained('facebook/dinov2-base').save_pretrained('DIR')`, copy DIR here and set "
           f"{key}=DIR")
    if not weights:
        raise EncoderError(f"{key} is not set; DINOv2 weights are read from a local folder only: {how}.")
    if not (Path(weights).expanduser() / "config.json").is_file():
        raise EncoderError(f"{key}={str(weights)!r} is not a saved Dinov2Model folder (no config.json there): {how}.")
    from transformers import Dinov2Model    # optional heavy import, only for DINOv2 runs
    try:
        return Dinov2Model.from_pretrained(str(Path(weights).expanduser()), local_files_only=True)
    except (OSError, ValueError) as err:
        raise EncoderError(f"{key}={str(weights)!r} does not load as a Dinov2Model ({err}): {how}.") from None


def build_dino_features(weights: Optional[Union[str, Path]], key: str, device: Union[str, torch.device] = "cpu"
                        ) -> DinoFeatures:
    """FDD's frozen DINOv2 feature network from a local folder (`key` names the config key in errors)."""
    return DinoFeatures(load_dinov2(weights, key), weights).eval().requires_grad_(False).to(device)


def build_patch_encoder(name: str, *, weights: Optional[str] = None, cache_dir: Union[str, Path] = ".cache",
                        device: Union[str, torch.device] = "cpu", resolution: int = 32) -> PatchEncoder:
    """The frozen REPA encoder `name` on `device`; `resolution` is the data's image side (the toy encoder is
    trained at it, once, and cached in `cache_dir`)."""
    if name == "toy":
        encoder: PatchEncoder = ToyPatchEncoder(load_or_train_toy_classifier(cache_dir, resolution=resolution,
                                                                             seed=REPA_TOY_SEED))
    elif name == "dinov2":
        encoder = DinoPatchEncoder(load_dinov2(weights, "model.repa.encoder_weights"))
    else:
        raise EncoderError(f"model.repa.encoder={name!r} is unknown; allowed: {', '.join(ENCODERS)}.")
    return encoder.freeze().to(device)
