"""The metric feature networks as evaluation uses them: one built by name with its files resolved (the toy
classifier trained into the cache directory first when it is not there), and the feature statistics of images.
The networks themselves are tread/encoders/features.py's."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np
import torch
import torch.nn as nn

from tread.data import ensure_toy_classifier
from tread.encoders.features import build_feature_extractor, check_feature_name, extractor_device
from tread.evaluation.frechet import FeatureStats
from tread.utils.device import resolve_device


def feature_extractor(name: str, *, cache_dir: Union[str, Path], resolution: int = 32,
                      inception_weights: Optional[Union[str, Path]] = None,
                      device: Union[str, torch.device] = "cpu") -> nn.Module:
    """The frozen metric network `name` on `device`: Inception from `inception_weights` (None: the hub cache), or the
    toy classifier for image side `resolution`, trained and cached in `cache_dir` first if needed."""
    toy = ensure_toy_classifier(cache_dir, resolution=resolution) if check_feature_name(name) == "toy_classifier" \
        else None
    return build_feature_extractor(name, inception_weights=inception_weights, toy_classifier=toy, device=device)


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


def reference_cache_path(cache_dir: Union[str, Path], dataset, extractor_name: str, max_images: Optional[int] = None,
                         square: Optional[int] = None, tag: str = "") -> Path:
    """Where an auto-built reference of `dataset` is cached: <cache_dir>/references/<dataset>_<tag><extractor>_<N>img
    [_sq<side>].npz, so references of other features, caps or crops never overwrite one another."""
    count = len(dataset) if max_images is None else min(len(dataset), max_images)
    crop = f"_sq{square}" if square else ""
    return Path(cache_dir) / "references" / f"{dataset.root.name}_{tag}{extractor_name}_{count}img{crop}.npz"
