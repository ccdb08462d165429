"""Pluggable FID feature extractors: nn.Modules with `name`, `dim` and
forward(uint8 (B, 3, H, W)) -> float32 (B, dim), the torch-fidelity input convention."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np
import torch
import torch.nn as nn

from evaluation.frechet import FeatureStats

FEATURE_NAMES = ("toy_classifier", "inception")
# The weights torch-fidelity's FeatureExtractorInceptionV3 downloads when given no path
# (TF Inception-v3 2015-12-05 converted to PyTorch; FID-compatible with the ADM/TF numbers).
INCEPTION_URL = ("https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/"
                 "weights-inception-2015-12-05-6726825d.pth")
DOWNLOAD_TIMEOUT_S = 30


def inception_cache_path() -> Path:
    """Where torch-fidelity caches the weights: torch.hub's load_state_dict_from_url location,
    <torch hub dir>/checkpoints/ (default ~/.cache/torch/hub/checkpoints; moved by $TORCH_HOME)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(INCEPTION_URL)


def _download_inception_weights() -> Path:
    path = inception_cache_path()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # fail fast instead of hanging on a dead network
    try:
        torch.hub.download_url_to_file(INCEPTION_URL, str(path), progress=False)
    except Exception as e:
        raise RuntimeError(
            f"Could not download the Inception-v3 FID weights ({path.name}) from {INCEPTION_URL}: {e!r}.\n"
            f"Without network access, download that file on another machine and either pass its path with "
            f"eval.inception_weights=/path/to/{path.name} (fid.py: inception_weights=...), or copy it to "
            f"{path} (the torch hub cache torch-fidelity uses; set TORCH_HOME to move it). "
            f"For the built-in data, eval.features=toy_classifier needs no download.") from e
    finally:
        socket.setdefaulttimeout(old_timeout)
    return path


class InceptionFeatures(nn.Module):
    """2048-d pool features of torch-fidelity's TF-compatible Inception-v3 (resizes to 299 inside)."""

    name = "inception"
    dim = 2048

    def __init__(self, weights_path: Optional[Union[str, Path]] = None):
        super().__init__()
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        if weights_path is not None:
            weights_path = Path(weights_path).expanduser()
            if not weights_path.is_file():
                raise FileNotFoundError(f"Inception weights file not found: {weights_path} "
                                        f"(set by eval.inception_weights / inception_weights)")
        else:
            weights_path = _download_inception_weights()
        try:
            self.net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"],
                                                   feature_extractor_weights_path=str(weights_path))
        except Exception as e:  # unreadable file, or a state_dict of another architecture
            raise RuntimeError(f"{weights_path} is not usable as torch-fidelity Inception-v3 weights (expected "
                               f"{os.path.basename(INCEPTION_URL)} from {INCEPTION_URL}): {e}") from e

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)[0]


class ToyClassifierFeatures(nn.Module):
    """Penultimate-layer features of the offline toy-shapes classifier (evaluation.toy_classifier)."""

    name = "toy_classifier"

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.classifier = classifier
        self.dim = classifier.embed.out_features

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier.features(images).float()


def resolve_device(device: Union[str, torch.device]) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def build_feature_extractor(name: str, *, inception_weights: Optional[Union[str, Path]] = None,
                            cache_dir: Union[str, Path] = ".cache", device: Union[str, torch.device] = "cpu",
                            resolution: int = 32) -> nn.Module:
    """A frozen extractor in eval mode on `device` ("auto": CUDA if available).

    `resolution` picks the toy classifier trained at that image size (Inception resizes itself)."""
    if name == "inception":
        extractor = InceptionFeatures(inception_weights)
    elif name == "toy_classifier":
        from evaluation.toy_classifier import load_or_train_toy_classifier

        extractor = ToyClassifierFeatures(load_or_train_toy_classifier(cache_dir, resolution=resolution))
    else:
        raise ValueError(f"Unknown feature extractor eval.features={name!r}; choose one of {FEATURE_NAMES}")
    return extractor.to(resolve_device(device)).eval().requires_grad_(False)


def extractor_device(extractor: nn.Module) -> torch.device:
    return next(extractor.parameters()).device


@torch.no_grad()
def extract_features(extractor: nn.Module,
                     images: Union[torch.Tensor, np.ndarray, Iterable[Union[torch.Tensor, np.ndarray]]],
                     batch_size: int = 250, device: Optional[Union[str, torch.device]] = None,
                     stats: Optional[FeatureStats] = None) -> FeatureStats:
    """Feature statistics of uint8 (N, 3, H, W) images: one tensor/array or an iterable of batches."""
    device = extractor_device(extractor) if device is None else resolve_device(device)
    batches = images
    if isinstance(images, (torch.Tensor, np.ndarray)):
        batches = (images[i:i + batch_size] for i in range(0, len(images), batch_size))
    stats = FeatureStats() if stats is None else stats
    for batch in batches:
        stats.update(extractor(torch.as_tensor(batch).to(device)))
    return stats
