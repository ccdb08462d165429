"""Reference statistics (.npz with mu/sigma, ADM-compatible) and FID of a set of images against them."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
import torch.nn as nn

from evaluation.features import extract_features, extractor_device
from evaluation.frechet import FeatureStats, frechet_distance
from evaluation.images import ImagesLike, atomic_write, to_nhwc_uint8

PathLike = Union[str, Path]


def subset_indices(total: int, max_images: Optional[int], seed: int = 0) -> np.ndarray:
    """All indices, or a fixed random subset of max_images (sorted): datasets are often stored
    class by class, so taking the first N would skew the statistics."""
    if max_images is None or max_images >= total:
        return np.arange(total)
    return np.sort(np.random.default_rng(seed).choice(total, size=max_images, replace=False))


def compute_stats(extractor: nn.Module, images: ImagesLike, batch_size: int = 250,
                  device: Optional[Union[str, torch.device]] = None) -> FeatureStats:
    """Feature statistics of uint8 (N, H, W, 3) images (device: the extractor's by default)."""
    images = to_nhwc_uint8(images)
    batches = (torch.from_numpy(images[i:i + batch_size]).permute(0, 3, 1, 2)
               for i in range(0, len(images), batch_size))
    return extract_features(extractor, batches, device=device)


def save_reference(path: PathLike, stats: FeatureStats, extractor_name: str,
                   images: Optional[ImagesLike] = None, extra: Optional[dict] = None) -> Path:
    """npz with mu, sigma, feature (extractor name), num_images, optionally the images as arr_0
    and `extra` arrays (e.g. the source dataset)."""
    arrays = {**stats.to_npz_dict(), "feature": np.array(extractor_name), "num_images": np.array(stats.n),
              **(extra or {})}
    if images is not None:
        arrays["arr_0"] = to_nhwc_uint8(images)
    return atomic_write(path, lambda f: np.savez(f, **arrays))


def _check_feature(path: Path, data, extractor: nn.Module) -> None:
    if "feature" in data and str(data["feature"]) != extractor.name:
        raise ValueError(f"reference {path} holds statistics of '{data['feature']}' features, but the evaluation "
                         f"uses '{extractor.name}': rebuild it with `python fid.py mode=ref features=...` "
                         f"or pick the matching features")


def load_reference(path: PathLike, extractor: nn.Module, batch_size: int = 250) -> tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) from an npz: its mu/sigma if present (ADM reference batches have them), else
    computed with `extractor` from its arr_0 images."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reference statistics {path} not found; build them with "
                                f"`python fid.py mode=ref source=<image folder|.npz|dataset dir> out={path}`")
    with np.load(path) as data:
        _check_feature(path, data, extractor)
        if "mu" in data and "sigma" in data:
            mu, sigma = data["mu"].astype(np.float64), data["sigma"].astype(np.float64)
            if mu.shape != (extractor.dim,):
                raise ValueError(f"reference {path} has {mu.shape[0]}-d statistics but '{extractor.name}' "
                                 f"features are {extractor.dim}-d (statistics from another feature network?)")
            return mu, sigma
        if "arr_0" not in data:
            raise ValueError(f"reference {path} has neither mu/sigma nor arr_0 images (keys: {list(data.keys())})")
        images = data["arr_0"]
    stats = compute_stats(extractor, to_nhwc_uint8(images, f"arr_0 in {path}"), batch_size)
    return stats.mean(), stats.cov()


def _dataset_source(dataset) -> str:
    return str(getattr(dataset, "root", getattr(dataset, "path", type(dataset).__name__)))


def _cached_reference_ok(path: Path, extractor: nn.Module, num_images: int, source: str) -> bool:
    if not path.is_file():
        return False
    with np.load(path) as data:
        return (str(data.get("feature", "")) == extractor.name and str(data.get("source", "")) == source
                and int(data.get("num_images", -1)) == num_images)


def _latents(dataset, indices: np.ndarray) -> torch.Tensor:
    if hasattr(dataset, "__getitems__"):  # batched read (LatentDataset: one memmap fancy-index)
        return torch.as_tensor(dataset.__getitems__(indices.tolist())[0])
    return torch.stack([torch.as_tensor(dataset[int(j)][0]) for j in indices])


@torch.no_grad()
def reference_for_dataset(dataset, extractor: nn.Module, out_path: PathLike, max_images: Optional[int] = None,
                          batch_size: int = 250, force: bool = False) -> Path:
    """Decode the dataset's latents to uint8 images and save their reference statistics to out_path.
    Reuses out_path (unless force) if it holds stats of the same features, dataset and image count."""
    from data import decode_to_uint8

    out_path, source = Path(out_path), _dataset_source(dataset)
    indices = subset_indices(len(dataset), max_images)
    if not force and _cached_reference_ok(out_path, extractor, len(indices), source):
        return out_path
    print(f"Building reference statistics ({extractor.name}, {len(indices)} images) -> {out_path}", flush=True)
    device = extractor_device(extractor)
    batches = (decode_to_uint8(_latents(dataset, indices[i:i + batch_size]).to(device), dataset.meta)
               .permute(0, 3, 1, 2) for i in range(0, len(indices), batch_size))
    stats = extract_features(extractor, batches, device=device)
    return save_reference(out_path, stats, extractor.name, extra={"source": np.array(source)})


def fid_against_reference(extractor: nn.Module, images: ImagesLike, ref_path: PathLike,
                          batch_size: int = 250) -> float:
    """FID of uint8 NHWC images against a reference npz."""
    mu_ref, sigma_ref = load_reference(ref_path, extractor, batch_size)
    stats = compute_stats(extractor, images, batch_size)
    return frechet_distance(stats.mean(), stats.cov(), mu_ref, sigma_ref)
