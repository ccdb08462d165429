"""Frozen patch-feature encoders for REPA (model.repa.encoder): images (B, 3, H, W) in [-1, 1] -> patch
features (B, dim, h, w), no gradients.

"dinov2" (a local Dinov2Model), "toy" (the toy classifier of REPA's own seed), and the controls "toy_random"
(untrained) and "toy_fid" (the FID network itself); docs/research.md describes them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from tread.encoders.dinov2 import DINO_SIZE, IMAGENET_MEAN, IMAGENET_STD, load_dinov2
from tread.encoders.errors import EncoderError
from tread.encoders.toy_classifier import DEFAULT_SEED, ToyClassifier, load_toy_classifier

ENCODERS = ("toy", "toy_random", "toy_fid", "dinov2")
REPA_TOY_SEED = 777              # another seed than the FID feature network's (toy_classifier.DEFAULT_SEED)
# The toy classifier file each trained toy encoder reads (ensure_toy_classifier(..., seed=...) builds it).
TOY_ENCODER_SEEDS = {"toy": REPA_TOY_SEED, "toy_fid": DEFAULT_SEED}


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

    def flops(self, side: int) -> float:
        """Forward FLOPs (multiply-add = 2; matmuls and convolutions, as torch's FlopCounterMode counts them) of one
        (3, side, side) image, on a dry run of a zero image on the encoder's device."""
        image = torch.zeros(1, 3, side, side, device=next(self.parameters()).device)
        with FlopCounterMode(display=False) as counter:
            self(image)
        return float(counter.get_total_flops())


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


def random_toy_classifier(resolution: int, seed: int = REPA_TOY_SEED) -> ToyClassifier:
    """An untrained ToyClassifier for `resolution` px images, initialised after torch.manual_seed(seed) (the
    global RNG is restored afterwards), in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ToyClassifier(resolution=resolution).eval()


def build_patch_encoder(name: str, *, weights: Optional[Union[str, Path]] = None,
                        device: Union[str, torch.device] = "cpu", resolution: int = 32) -> PatchEncoder:
    """The frozen REPA encoder `name` on `device`, from `weights` (the toy classifier's file, or a Dinov2Model folder
    for "dinov2"); "toy_random" needs no file, only the image side `resolution`."""
    if name in TOY_ENCODER_SEEDS:
        if weights is None:
            raise EncoderError(f"model.repa.encoder={name} needs the toy classifier's file (weights=PATH; "
                               f"tread.data.ensure_toy_classifier(cache_dir, resolution, "
                               f"seed={TOY_ENCODER_SEEDS[name]}) builds it)")
        encoder: PatchEncoder = ToyPatchEncoder(load_toy_classifier(weights))
    elif name == "toy_random":
        encoder = ToyPatchEncoder(random_toy_classifier(int(resolution)))
    elif name == "dinov2":
        encoder = DinoPatchEncoder(load_dinov2(weights, "model.repa.encoder_weights"))
    else:
        raise EncoderError(f"model.repa.encoder={name!r} is unknown; allowed: {', '.join(ENCODERS)}.")
    return encoder.freeze().to(device)
