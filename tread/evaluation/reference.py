"""References for the metrics: ADM-compatible .npz files (arr_0 images, optionally whole-dataset mu/sigma and
mu_s/sigma_s; ours add feature, num_images, source, resolution), read as they are and written by
ReferenceBuilder / build_reference / reference_for_dataset.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

import numpy as np
import torch
import torch.nn as nn
from PIL import Image
from tqdm.auto import tqdm

import tread.data as data_mod
from tread.encoders.features import extractor_device, forward_features
from tread.evaluation.extractors import extract_features
from tread.evaluation.frechet import FeatureStats
from tread.evaluation.images import (ImagesLike, as_frames, clip_frames, image_files, iter_image_folder,
                                     npz_images_shape, to_nhwc_uint8)
from tread.schema.metric_names import ROW_METRICS, check_metrics
from tread.utils.distributed import all_gather_rows, is_distributed
from tread.utils.errors import UserError
from tread.utils.io import atomic_write
from tread.utils.readers import iter_npz_batches, npz_names, read_npz

PathLike = Union[str, Path]


class ReferenceFileError(UserError, ValueError):
    """A reference .npz that cannot serve this evaluation (its features, resolution, statistics or images): one
    line naming the file, in every program (a ValueError too, as the metric code's other input errors)."""


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
        raise ReferenceFileError(f"reference {path} holds statistics of '{data['feature']}' features, but the evaluation "
                         f"uses '{extractor.name}': rebuild it with `python fid.py mode=ref features=...` "
                         f"or pick the matching features")


def load_reference(path: PathLike, extractor: nn.Module, batch_size: int = 250) -> tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) of the pool features: load_reference_full(path, extractor, need=("fid",)) -- stored mu/sigma
    if present (ADM reference batches have them), else computed from the arr_0 images."""
    ref = load_reference_full(path, extractor, batch_size, need=("fid",))
    return ref.mu, ref.sigma


# ----------------------------------------------------------------------------- ADM metric references

@dataclass
class Reference:
    """What the metrics compare samples against (load_reference_full): mu/sigma (FID) and mu_s/sigma_s (sFID) in
    float64, pool_rows (N, dim) float32 of the reference images (precision/recall/KID), num_images and the
    images' (H, W) resolution."""

    feature: str
    mu: Optional[np.ndarray] = None
    sigma: Optional[np.ndarray] = None
    mu_s: Optional[np.ndarray] = None
    sigma_s: Optional[np.ndarray] = None
    num_images: int = 0
    pool_rows: Optional[torch.Tensor] = None
    path: Optional[Path] = None
    resolution: Optional[tuple[int, int]] = None


_REF_HINT = "`python fid.py mode=ref source=<image folder | .npz | dataset dir> out={path}`"


def _resolution_of(path: Path, data: dict) -> Optional[tuple[int, int]]:
    """(H, W) from the optional 'resolution' key: the side of square images, or [H, W]."""
    if "resolution" not in data:
        return None
    r = np.asarray(data["resolution"]).reshape(-1)
    if r.size not in (1, 2) or not np.issubdtype(r.dtype, np.number) or not np.all((r >= 1) & (r == np.round(r))):
        raise ReferenceFileError(f"reference {path}: key 'resolution' is {r.tolist()} ({r.dtype}); expected the image size: "
                         f"one positive integer (square images) or [H, W]. Rebuild it with "
                         f"{_REF_HINT.format(path=path)}")
    return (int(r[0]), int(r[-1]))


def _check_resolution(path: Path, res: Optional[tuple[int, int]], extractor: nn.Module) -> None:
    """A feature network trained at one image size (the toy classifier) must not score another size."""
    side = getattr(extractor, "resolution", None)
    if res is not None and side is not None and res != (side, side):
        raise ReferenceFileError(f"reference {path} (key 'resolution') is for {res[0]}x{res[1]} images but the "
                         f"'{extractor.name}' features are for {side}x{side} images: rebuild the reference with "
                         f"{_REF_HINT.format(path=path)} from images of that size, or score images of its size")


def _load_stats(path: Path, data, files: set, keys: tuple[str, str], dim: Optional[int], extractor: nn.Module):
    mu_key, sigma_key = keys
    if mu_key not in files or sigma_key not in files:
        return None, None
    mu, sigma = data[mu_key].astype(np.float64), data[sigma_key].astype(np.float64)
    if dim is not None and (mu.shape != (dim,) or sigma.shape != (dim, dim)):
        raise ReferenceFileError(f"reference {path} has {mu_key} of shape {mu.shape} and {sigma_key} of shape "
                         f"{sigma.shape}, but '{extractor.name}' gives {dim}-d features there (statistics from "
                         f"another feature network?): rebuild it with {_REF_HINT.format(path=path)} features="
                         f"{extractor.name}")
    return mu, sigma


def read_reference_file(path: PathLike) -> tuple[dict[str, np.ndarray], set[str], Optional[tuple[int, ...]]]:
    """A reference .npz's other arrays, the names of all its arrays and its arr_0 shape (None without), all checked
    before any feature network loads. FileFormatError for an unreadable .npz, ValueError naming a bad key."""
    path = Path(path)
    files = set(npz_names(path, "reference"))
    data = read_npz(path, "reference", keys=files - {"arr_0"})
    _resolution_of(path, data)
    bad = [k for k in ("mu", "sigma", "mu_s", "sigma_s") if k in data and np.issubdtype(data[k].dtype, np.number)
           and not np.isfinite(data[k]).all()]
    if bad:
        raise ReferenceFileError(f"reference {path}: key '{bad[0]}' holds NaN or inf (non-finite feature statistics score "
                         f"nothing); rebuild it with {_REF_HINT.format(path=path)}")
    count = data.get("num_images")
    if count is not None and (count.size != 1 or not np.issubdtype(count.dtype, np.integer)):
        raise ReferenceFileError(f"reference {path}: key 'num_images' is {count.tolist()!r}; expected one integer (the "
                         f"images behind mu/sigma)")
    arr_shape = npz_images_shape(path, "reference") if "arr_0" in files else None
    return data, files, arr_shape


def _read_reference(path: Path, extractor: nn.Module) -> tuple[Reference, set]:
    """The Reference with what the npz stores (checked against `extractor`), and the npz's keys."""
    data, files, arr_shape = read_reference_file(path)
    _check_feature(path, data, extractor)
    resolution = _resolution_of(path, data)
    _check_resolution(path, resolution, extractor)
    mu, sigma = _load_stats(path, data, files, ("mu", "sigma"), extractor.dim, extractor)
    spatial_dim = getattr(extractor, "spatial_dim", None)
    mu_s, sigma_s = _load_stats(path, data, files, ("mu_s", "sigma_s"), spatial_dim, extractor)
    num_images = int(data["num_images"]) if "num_images" in files else None
    if arr_shape is not None and resolution is None:
        resolution = (int(arr_shape[1]), int(arr_shape[2]))
        _check_resolution(path, resolution, extractor)
    if num_images is None:
        num_images = int(arr_shape[0]) if arr_shape is not None else 0
    ref = Reference(feature=extractor.name, mu=mu, sigma=sigma, mu_s=mu_s, sigma_s=sigma_s,
                    num_images=num_images, path=path, resolution=resolution)
    return ref, files


def _add_image_features(ref: Reference, extractor: nn.Module, batch_size: int, want_pool: bool,
                        want_spatial: bool, want_rows: bool) -> None:
    """Fill in what is wanted from the features of the reference's arr_0 images: mu/sigma, mu_s/sigma_s and
    the float32 pool rows."""
    device = extractor_device(extractor)
    pool = FeatureStats(extractor.dim, device) if want_pool else None
    spatial = FeatureStats(extractor.spatial_dim, device) if want_spatial else None
    rows = []
    for batch in iter_npz_batches(ref.path, "arr_0", batch_size, "reference"):
        x = torch.from_numpy(np.ascontiguousarray(batch)).permute(0, 3, 1, 2).to(device)
        feats = forward_features(extractor, x, spatial=want_spatial, logits=False)
        if pool is not None:
            pool.update(feats["pool"])
        if spatial is not None:
            spatial.update(feats["spatial"])
        if want_rows:
            rows.append(feats["pool"].float().cpu())
    for what, stats in (("fid", pool), ("sfid", spatial)):
        if stats is not None and stats.n < 2:
            raise ReferenceFileError(f"{what}: reference {ref.path} has {stats.n} arr_0 images, need at least 2 for "
                             f"statistics")
    if pool is not None:
        ref.mu, ref.sigma = pool.mean(), pool.cov()
    if spatial is not None:
        ref.mu_s, ref.sigma_s = spatial.mean(), spatial.cov()
    if want_rows:
        ref.pool_rows = torch.cat(rows) if rows else torch.zeros(0, extractor.dim)


@torch.no_grad()
def load_reference_full(path: PathLike, extractor: nn.Module, batch_size: int = 250,
                        need: Iterable[str] = ("fid",)) -> Reference:
    """The reference for the metrics in `need`, from an npz as it is (ours or ADM's): stored statistics are used,
    whatever is missing is computed from the arr_0 images with `extractor`."""
    need = set(check_metrics(need))
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reference {path} not found; build it with {_REF_HINT.format(path=path)}")
    ref, files = _read_reference(path, extractor)
    want_pool = "fid" in need and ref.mu is None
    want_spatial = "sfid" in need and ref.mu_s is None
    want_rows = bool(need & set(ROW_METRICS))
    if not (want_pool or want_spatial or want_rows):
        return ref
    if "arr_0" not in files:
        lacking = ", ".join(w for w, on in (("mu/sigma (fid)", want_pool), ("mu_s/sigma_s (sfid)", want_spatial),
                                            ("reference images (precision/recall/kid)", want_rows)) if on)
        raise ReferenceFileError(f"reference {path} has no arr_0 images, so it cannot provide {lacking}: rebuild it "
                         f"with {_REF_HINT.format(path=path)} (it stores mu/sigma, mu_s/sigma_s and arr_0 "
                         f"images), or leave those metrics out")
    if want_spatial and getattr(extractor, "spatial_dim", None) is None:
        raise ValueError(f"sfid needs spatial features, which extractor '{extractor.name}' does not give")
    _add_image_features(ref, extractor, batch_size, want_pool, want_spatial, want_rows)
    return ref


def _to_nhwc_tensor(images: Union[np.ndarray, torch.Tensor], what: str = "images") -> torch.Tensor:
    x = torch.as_tensor(images)
    if x.dtype != torch.uint8 or x.ndim != 4 or x.shape[-1] != 3:
        raise ValueError(f"{what}: expected uint8 (N, H, W, 3) images, got {x.dtype} {tuple(x.shape)}")
    return x


class ReferenceBuilder:
    """Streams a (huge) dataset into an ADM-compatible reference npz, on one or many processes.

    add(images, indices) accumulates float64 statistics and keeps the images subset_indices selects (arr_0).
    Distributed: each process adds its share, all call all_reduce(), one calls save(); local=True: this process
    adds every image alone.
    """

    def __init__(self, extractor: nn.Module, total: int, store_images: Optional[int] = 10000, seed: int = 0,
                 local: bool = False):
        if getattr(extractor, "spatial_dim", None) is None or not hasattr(extractor, "forward_all"):
            raise TypeError(f"ReferenceBuilder needs an extractor with spatial features (forward_all, spatial_dim); "
                            f"'{getattr(extractor, 'name', type(extractor).__name__)}' has none")
        if total < 1:
            raise ValueError(f"ReferenceBuilder total={total} must be >= 1")
        if store_images is not None and store_images < 0:
            raise ValueError(f"store_images={store_images} must be >= 0 (or None: keep all)")
        self.extractor = extractor
        self.total = int(total)
        self.device = extractor_device(extractor)
        self.pool = FeatureStats(extractor.dim, self.device)
        self.spatial = FeatureStats(extractor.spatial_dim, self.device)
        self._keep = np.zeros(self.total, dtype=bool)
        if store_images is None or store_images > 0:
            self._keep[subset_indices(self.total, store_images, seed)] = True
        self.store_images = int(self._keep.sum())
        self.local = bool(local)
        self._images: list[np.ndarray] = []
        self._image_indices: list[np.ndarray] = []
        self.image_size: Optional[tuple[int, int]] = None
        self.reduced = False

    @property
    def n(self) -> int:
        """Images added (on all ranks after all_reduce())."""
        return self.pool.n

    @torch.no_grad()
    def add(self, images: Union[np.ndarray, torch.Tensor], indices: Iterable[int]) -> "ReferenceBuilder":
        """Add uint8 (B, H, W, 3) images (numpy or torch, any device) with their global indices."""
        if self.reduced:
            raise RuntimeError("ReferenceBuilder.add after all_reduce(): make a new builder")
        x = _to_nhwc_tensor(images, "ReferenceBuilder.add")
        idx = np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else list(indices), dtype=np.int64)
        idx = idx.reshape(-1)
        if len(idx) != len(x):
            raise ValueError(f"ReferenceBuilder.add got {len(x)} images but {len(idx)} indices")
        if len(x) == 0:
            return self
        if idx.min() < 0 or idx.max() >= self.total:
            raise ValueError(f"ReferenceBuilder indices must lie in [0, {self.total}), got {idx.min()}..{idx.max()}")
        size = (int(x.shape[1]), int(x.shape[2]))
        if self.image_size is None:
            self.image_size = size
        elif size != self.image_size:
            raise ValueError(f"image sizes differ: {self.image_size} earlier, {size} now (a reference needs one size)")
        feats = self.extractor.forward_all(x.to(self.device).permute(0, 3, 1, 2))
        self.pool.update(feats["pool"])
        self.spatial.update(feats["spatial"])
        keep = self._keep[idx]
        if keep.any():
            self._images.append(x[torch.from_numpy(keep).to(x.device)].cpu().numpy())
            self._image_indices.append(idx[keep])
        return self

    def _kept(self) -> tuple[np.ndarray, np.ndarray]:
        h, w = self.image_size or (0, 0)
        images = np.concatenate(self._images) if self._images else np.zeros((0, h, w, 3), np.uint8)
        indices = np.concatenate(self._image_indices) if self._image_indices else np.zeros(0, np.int64)
        return images, indices

    def all_reduce(self) -> "ReferenceBuilder":
        """Collective over torch.distributed ranks (no-op without a process group of more than one rank):
        statistics summed, kept images gathered (every rank then holds them all, ordered by index)."""
        if self.reduced:
            return self
        self.pool.all_reduce()
        self.spatial.all_reduce()
        if is_distributed():
            # Ranks that saw no image learn the image size from the others.
            sizes = all_gather_rows([torch.tensor([self.image_size or (0, 0)], dtype=torch.int64)])[0]
            seen = {tuple(int(v) for v in s.tolist()) for s in sizes} - {(0, 0)}
            if len(seen) > 1:
                raise ValueError(f"image sizes differ between processes: {sorted(seen)}")
            if seen and self.image_size is None:
                self.image_size = seen.pop()
            images, indices = self._kept()
            images, indices = all_gather_rows([torch.from_numpy(images), torch.from_numpy(indices)])
            self._images, self._image_indices = [images.numpy()], [indices.numpy()]
        self.reduced = True
        return self

    def save(self, out: PathLike, source: str, extra: Optional[dict] = None) -> Path:
        """Write the ADM-compatible reference npz atomically: arr_0 (kept images, by index), mu, sigma, mu_s,
        sigma_s, plus feature, num_images, source and resolution (the image side, for square images).
        After all_reduce() when distributed; call it on one rank."""
        if is_distributed() and not (self.reduced or self.local):
            raise RuntimeError("ReferenceBuilder.save in a distributed run: call all_reduce() on every rank first")
        if self.n < 2:
            raise ValueError(f"a reference needs at least 2 images, got {self.n}")
        images, indices = self._kept()
        order = np.argsort(indices, kind="stable")
        if len(np.unique(indices)) != len(indices):
            raise ValueError("some reference image index was added more than once")
        arrays = {"arr_0": images[order], "mu": self.pool.mean(), "sigma": self.pool.cov(),
                  "mu_s": self.spatial.mean(), "sigma_s": self.spatial.cov(),
                  "feature": np.array(self.extractor.name), "num_images": np.array(self.n),
                  "source": np.array(str(source))}
        h, w = self.image_size
        if h == w:
            arrays["resolution"] = np.array(h)
        arrays.update(extra or {})
        return atomic_write(out, lambda f: np.savez(f, **arrays))


# ----------------------------------------------------------------------------- building references

def _dataset_source(dataset) -> str:
    return str(dataset.root)


def _describe_decode(decode_kwargs: Optional[dict]) -> str:
    """A stable text of the decode options that change the images (objects by type name; batch_size, which
    does not, is left out), stored with a cached reference."""
    def text(v):
        return repr(v) if v is None or isinstance(v, (str, int, float, bool)) else type(v).__name__
    return ", ".join(f"{k}={text(v)}" for k, v in sorted((decode_kwargs or {}).items()) if k != "batch_size")


def _cached_reference_ok(path: Path, extractor: nn.Module, num_images: int, source: str, decode: str = "",
                         store_images: Optional[int] = 10000) -> bool:
    if not path.is_file():
        return False
    try:
        data, files, arr_shape = read_reference_file(path)
    except ValueError:            # FileFormatError (not an .npz) too
        return False  # damaged or foreign: rebuilt
    if not {"mu", "sigma", "mu_s", "sigma_s", "arr_0", "feature", "source", "num_images"} <= files:
        return False  # e.g. an older cache without sFID statistics or images: rebuild
    stored_decode = str(data["decode"]) if "decode" in files else ""
    kept = num_images if store_images is None else min(store_images, num_images)
    return (str(data["feature"]) == extractor.name and str(data["source"]) == source
            and int(data["num_images"]) == num_images and stored_decode == decode
            and data["mu"].shape == (extractor.dim,)
            and data["mu_s"].shape == (getattr(extractor, "spatial_dim", None),) and arr_shape[0] == kept)


def _latents(dataset, indices: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(dataset.__getitems__(indices.tolist())[0])   # batched read (one memmap fancy-index)


def _batches(dataset, indices: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """`indices` in chunks of batch_size, split where a bucketed dataset's bucket changes (a batch: one shape)."""
    cuts = set(range(0, len(indices), batch_size))
    if dataset.buckets is not None:
        buckets = np.array([dataset.bucket_of(int(i)) for i in indices])
        cuts |= set((np.flatnonzero(np.diff(buckets)) + 1).tolist())
    edges = sorted(cuts | {len(indices)})
    return [indices[a:b] for a, b in zip(edges, edges[1:])]


def square_images(images: torch.Tensor, side: int) -> torch.Tensor:
    """uint8 (B, H, W, 3) -> (B, side, side, 3): ADM's center crop (center_crop_arr) of each, for references of
    bucketed data (images of several shapes) against square samples."""
    if images.shape[1] == images.shape[2] == side:
        return images
    crops = [data_mod.center_crop_arr(Image.fromarray(im.cpu().numpy()), side) for im in images]
    return torch.from_numpy(np.stack(crops)).to(images.device)


@torch.no_grad()
def reference_for_dataset(dataset, extractor: nn.Module, out_path: PathLike, max_images: Optional[int] = None,
                          batch_size: int = 250, force: bool = False, decode_kwargs: Optional[dict] = None,
                          store_images: Optional[int] = 10000, square: Optional[int] = None) -> Path:
    """Decode the dataset's latents (video: every frame) to uint8 images and save an ADM-style reference to
    out_path, reusing a file that already holds all of it for the same features, dataset, count and decoding
    (unless force). `square`: center-crop each image to that side first (bucketed data)."""
    out_path, source = Path(out_path), _dataset_source(dataset) + (f" (center crops {square}px)" if square else "")
    indices = subset_indices(len(dataset), max_images)
    decode = _describe_decode(decode_kwargs)
    if not force and _cached_reference_ok(out_path, extractor, len(indices), source, decode, store_images):
        return out_path
    per_clip = clip_frames(dataset)        # video data: every frame of every clip is a reference image
    what = f"{len(indices)} clips, every frame" if per_clip > 1 else f"{len(indices)} images"
    print(f"Building reference statistics ({extractor.name}, {what}) -> {out_path}", flush=True)
    device = extractor_device(extractor)
    builder = ReferenceBuilder(extractor, len(indices) * per_clip, store_images, local=True)   # all on this process
    done = 0
    for chunk in tqdm(_batches(dataset, indices, batch_size), desc=f"reference ({extractor.name})", unit="batch",
                      dynamic_ncols=True, leave=False):
        x = _latents(dataset, chunk).to(device)
        x = data_mod.draw_latents(x, dataset.meta, mode="mean")
        images, idx = as_frames(data_mod.decode_to_uint8(x, dataset.meta, **(decode_kwargs or {})),
                                np.arange(done, done + len(x)), per_clip)
        builder.add(images if square is None else square_images(images, square), idx)
        done += len(x)
    return builder.save(out_path, source, extra={"decode": np.array(decode)})


def build_reference(out: PathLike, extractor: nn.Module, source: PathLike, *, max_images: Optional[int] = None,
                    store_images: Optional[int] = 10000, batch_size: int = 250,
                    decode_kwargs: Optional[dict] = None) -> Path:
    """An ADM-style reference npz from `source`: an image folder, an .npz with arr_0 images or a latent dataset
    directory; a fixed random subset of max_images if given, store_images of them kept as arr_0."""
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"reference source {source} does not exist")
    if (source / "meta.json").is_file():
        return reference_for_dataset(data_mod.LatentDataset(str(source)), extractor, out, max_images=max_images,
                                     batch_size=batch_size, force=True, decode_kwargs=decode_kwargs,
                                     store_images=store_images)
    if source.is_dir():
        total = len(image_files(source))
        chosen = subset_indices(total, max_images)
        batches = iter_image_folder(source, batch_size, chosen)
    elif source.suffix == ".npz":
        chosen = subset_indices(npz_images_shape(source, "source")[0], max_images)
        batches = _select_rows(iter_npz_batches(source, "arr_0", batch_size, "source"), chosen)
    else:
        raise ReferenceFileError(f"reference source {source} is neither an image folder, an .npz file nor a latent "
                         f"dataset directory (with meta.json)")
    builder = ReferenceBuilder(extractor, len(chosen), store_images)
    done = 0
    with tqdm(total=len(chosen), desc=f"reference ({extractor.name})", unit="img", dynamic_ncols=True,
              leave=False) as bar:
        for batch in batches:
            builder.add(batch, np.arange(done, done + len(batch)))
            done += len(batch)
            bar.update(len(batch))
    return builder.save(out, str(source))


def _select_rows(batches: Iterable[np.ndarray], chosen: np.ndarray) -> Iterator[np.ndarray]:
    """The rows of consecutive batches whose position is in the sorted array `chosen`."""
    start = 0
    for batch in batches:
        lo, hi = np.searchsorted(chosen, [start, start + len(batch)])
        if hi > lo:
            yield batch[chosen[lo:hi] - start]
        start += len(batch)
