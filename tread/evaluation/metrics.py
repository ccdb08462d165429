"""The ADM metric suite (FID, sFID, Inception Score, precision, recall) plus KID, in PyTorch, following
openai/guided-diffusion's evaluator.py and torch-fidelity 0.4.0 (KID); docs/evaluation.md has the details.

    acc = FeatureAccumulator(extractor, metrics); acc.add(images, seeds) ...; acc.gather()
    scores = compute_metrics(acc, load_reference_full(ref, extractor, need=metrics), metrics)
"""
from __future__ import annotations

import math
import warnings
from typing import Iterable, Optional, Union

import numpy as np
import torch
import torch.nn as nn

from tread.encoders.features import extractor_device, forward_features
from tread.evaluation.frechet import FeatureStats, frechet_distance
from tread.schema.metric_names import METRICS, ROW_METRICS, TOY_METRICS, check_metrics, without_toy
from tread.evaluation.reference import Reference
from tread.utils.device import resolve_device
from tread.utils.distributed import all_gather_rows

ArrayLike = Union[torch.Tensor, np.ndarray]
FEATURE_METRICS = without_toy(METRICS)   # the defaults: what a feature network's accumulator can give


def _as_tensor(x: ArrayLike, dtype: torch.dtype, device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    x = torch.as_tensor(x)
    return x.to(device=x.device if device is None else device, dtype=dtype)


# ----------------------------------------------------------------------------- Inception Score

def inception_score(logits: ArrayLike, split_size: int = 5000) -> float:
    """Inception Score as ADM's compute_inception_score: per split of `split_size` consecutive rows,
    exp(mean_i KL(p_i || mean_j p_j)) with p = softmax(logits), averaged over splits; float64 from log_softmax."""
    logp = torch.log_softmax(_as_tensor(logits, torch.float64), dim=1)
    if logp.ndim != 2 or len(logp) == 0:
        raise ValueError(f"inception_score needs (N >= 1, classes) logits, got shape {tuple(logp.shape)}")
    if split_size < 1:
        raise ValueError(f"split_size={split_size} must be >= 1")
    scores = []
    for i in range(0, len(logp), split_size):
        part = logp[i:i + split_size]
        p = part.exp()
        log_mean = torch.log(p.mean(0, keepdim=True))
        kl = torch.where(p > 0, p * (part - log_mean), torch.zeros_like(p)).sum(1).mean()
        scores.append(math.exp(kl.item()))
    return float(np.mean(scores))


# ----------------------------------------------------------------------------- precision / recall

def _pairwise_sq_dists(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances max(|u|^2 - 2 u.v + |v|^2, 0), as ADM's _batch_pairwise_distances, in the
    features' dtype (float32)."""
    d = a.pow(2).sum(1, keepdim=True) - 2.0 * (a @ b.T) + b.pow(2).sum(1)[None]
    return d.clamp_min_(0)


def manifold_radii(feats: ArrayLike, k: int = 3, row_batch: int = 10000, col_batch: int = 10000,
                   device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """(N,) squared distance of every row to its k-th nearest other row in the same set (ADM's
    ManifoldEstimator.manifold_radii): k=3 is the 3rd other point."""
    x = _as_tensor(feats, torch.float32, device)
    n = len(x)
    if n < k + 1:
        raise ValueError(f"k={k} nearest neighbours need at least {k + 1} feature rows, got {n}")
    radii = torch.empty(n, dtype=x.dtype, device=x.device)
    for r0 in range(0, n, row_batch):
        rows = x[r0:r0 + row_batch]
        d = torch.cat([_pairwise_sq_dists(rows, x[c0:c0 + col_batch]) for c0 in range(0, n, col_batch)], dim=1)
        radii[r0:r0 + len(rows)] = d.kthvalue(k + 1, dim=1).values
    return radii


@torch.no_grad()
def precision_recall(ref_feats: ArrayLike, sample_feats: ArrayLike, k: int = 3, row_batch: int = 10000,
                     col_batch: int = 10000, device: Optional[Union[str, torch.device]] = None
                     ) -> tuple[float, float]:
    """Improved precision and recall (Kynkaanniemi et al. 2019) as ADM's ManifoldEstimator: precision = fraction
    of samples inside some reference ball, recall = of reference points inside some sample ball, each ball's
    radius^2 the k-th neighbour distance in its own set (`<=` as ADM), in blocks of rows."""
    device = torch.as_tensor(ref_feats).device if device is None else resolve_device(device)
    ref = _as_tensor(ref_feats, torch.float32, device)
    sam = _as_tensor(sample_feats, torch.float32, device)
    if ref.ndim != 2 or sam.ndim != 2 or ref.shape[1] != sam.shape[1]:
        raise ValueError(f"precision/recall need (N, D) features of one D, got {tuple(ref.shape)} and "
                         f"{tuple(sam.shape)}")
    for what, x in (("reference", ref), ("sample", sam)):
        if len(x) < k + 1:
            raise ValueError(f"precision/recall with k={k} need at least {k + 1} {what} rows, got {len(x)}")
    radii_ref = manifold_radii(ref, k, row_batch, col_batch)
    radii_sam = manifold_radii(sam, k, row_batch, col_batch)
    ref_in = torch.zeros(len(ref), dtype=torch.bool, device=device)   # -> recall
    sam_in = torch.zeros(len(sam), dtype=torch.bool, device=device)   # -> precision
    for r0 in range(0, len(ref), row_batch):
        r1 = r0 + row_batch
        for c0 in range(0, len(sam), col_batch):
            c1 = c0 + col_batch
            d = _pairwise_sq_dists(ref[r0:r1], sam[c0:c1])            # (refs, samples)
            ref_in[r0:r1] |= (d <= radii_sam[None, c0:c1]).any(1)
            sam_in[c0:c1] |= (d <= radii_ref[r0:r1, None]).any(0)
    return sam_in.double().mean().item(), ref_in.double().mean().item()


# ----------------------------------------------------------------------------- KID

def _unbiased_mmd2(k_xx: torch.Tensor, k_xy: torch.Tensor, k_yy: torch.Tensor) -> float:
    m = k_xx.shape[0]
    sum_xx = k_xx.sum() - k_xx.diagonal().sum()
    sum_yy = k_yy.sum() - k_yy.diagonal().sum()
    return ((sum_xx + sum_yy) / (m * (m - 1)) - 2.0 * k_xy.sum() / (m * m)).item()


@torch.no_grad()
def kid(ref_feats: ArrayLike, sample_feats: ArrayLike, subsets: int = 100, subset_size: int = 1000,
        degree: int = 3, gamma: Optional[float] = None, coef0: float = 1.0, seed: int = 0,
        device: Optional[Union[str, torch.device]] = None) -> tuple[float, float]:
    """Kernel Inception Distance as torch-fidelity's kid_features_to_metric: (mean, std) of the unbiased MMD^2 with
    the polynomial kernel over `subsets` random subsets of m = subset_size rows (deterministic in `seed`;
    m clamped to the smaller set), float64 kernels."""
    device = torch.as_tensor(ref_feats).device if device is None else resolve_device(device)
    x_all = _as_tensor(ref_feats, torch.float64, device)
    y_all = _as_tensor(sample_feats, torch.float64, device)
    if x_all.ndim != 2 or y_all.ndim != 2 or x_all.shape[1] != y_all.shape[1]:
        raise ValueError(f"kid needs (N, D) features of one D, got {tuple(x_all.shape)} and {tuple(y_all.shape)}")
    m = min(subset_size, len(x_all), len(y_all))
    if m < 2:
        raise ValueError(f"kid needs at least 2 reference and 2 sample rows, got {len(x_all)} and {len(y_all)}")
    gamma = 1.0 / x_all.shape[1] if gamma is None else gamma
    rng = np.random.RandomState(seed)
    mmds = np.zeros(subsets)
    for i in range(subsets):
        x = x_all[torch.from_numpy(rng.choice(len(x_all), m, replace=False)).to(device)]
        y = y_all[torch.from_numpy(rng.choice(len(y_all), m, replace=False)).to(device)]

        def kernel(a, b):
            return (a @ b.T * gamma + coef0) ** degree

        mmds[i] = _unbiased_mmd2(kernel(x, x), kernel(x, y), kernel(y, y))
    return float(np.mean(mmds)), float(np.std(mmds))


# ----------------------------------------------------------------------------- feature accumulation

class FeatureAccumulator:
    """Collects what `metrics` need from generated images, batch by batch, on one or many processes: float64 stats
    of pool / spatial features and float32 CPU rows (pool, logits) with their integer indices. After gather(),
    `pool_rows`, `logits` and `indices` hold every rank's rows sorted by index and `n` is the total."""

    def __init__(self, extractor: nn.Module, metrics: Iterable[str] = FEATURE_METRICS,
                 device: Optional[Union[str, torch.device]] = None):
        self.extractor = extractor
        self.metrics = check_metrics(metrics)
        self.device = extractor_device(extractor) if device is None else resolve_device(device)
        need = set(self.metrics)
        self.keep_pool_rows = bool(need & set(ROW_METRICS))
        self.keep_logits = "is" in need
        self.need_spatial = "sfid" in need
        # Pre-sized, so a rank that added nothing still joins the all-reduce.
        self.pool_stats = FeatureStats(extractor.dim, self.device) if "fid" in need else None
        self.spatial_stats = None
        if self.need_spatial:
            if getattr(extractor, "spatial_dim", None) is None:
                raise TypeError(f"sfid needs spatial features, which extractor '{extractor.name}' does not give")
            self.spatial_stats = FeatureStats(extractor.spatial_dim, self.device)
        if self.keep_logits and getattr(extractor, "num_logits", None) is None:
            raise TypeError(f"is (Inception Score) needs logits, which extractor '{extractor.name}' does not give")
        self._pool_rows: list[torch.Tensor] = []
        self._logit_rows: list[torch.Tensor] = []
        self._indices: list[torch.Tensor] = []
        self._local_n = 0
        self.image_size: Optional[tuple[int, int]] = None
        self.gathered = False
        self.pool_rows: Optional[torch.Tensor] = None
        self.logits: Optional[torch.Tensor] = None
        self.indices: Optional[torch.Tensor] = None
        self._n: Optional[int] = None

    @property
    def n(self) -> int:
        """Images added: on this rank before gather(), on all ranks after it."""
        return self._local_n if self._n is None else self._n

    @torch.no_grad()
    def add(self, images: ArrayLike, indices: Optional[Iterable[int]] = None) -> "FeatureAccumulator":
        """Add uint8 (B, 3, H, W) images with their global integer indices (default: consecutive numbers on
        this process, which is only right on a single process)."""
        if self.gathered:
            raise RuntimeError("FeatureAccumulator.add after gather(): make a new accumulator")
        images = torch.as_tensor(images)
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"FeatureAccumulator.add expects uint8 (B, 3, H, W) images, got {images.dtype} "
                             f"{tuple(images.shape)}")
        b = len(images)
        if indices is None:
            indices = range(self._local_n, self._local_n + b)
        if isinstance(indices, torch.Tensor):
            idx = indices.detach().to("cpu", torch.int64).reshape(-1)
        else:
            idx = torch.from_numpy(np.asarray(indices if isinstance(indices, np.ndarray) else list(indices),
                                              dtype=np.int64).reshape(-1))
        if len(idx) != b:
            raise ValueError(f"FeatureAccumulator.add got {b} images but {len(idx)} indices")
        if b == 0:
            return self
        size = (int(images.shape[2]), int(images.shape[3]))
        if self.image_size is None:
            self.image_size = size
        elif size != self.image_size:
            raise ValueError(f"image size changed from {self.image_size} to {size}")
        feats = forward_features(self.extractor, images.to(extractor_device(self.extractor)),
                                 spatial=self.need_spatial, logits=self.keep_logits)
        if self.pool_stats is not None:
            self.pool_stats.update(feats["pool"].to(self.device))
        if self.spatial_stats is not None:
            self.spatial_stats.update(feats["spatial"].to(self.device))
        if self.keep_pool_rows:
            self._pool_rows.append(feats["pool"].detach().float().cpu())
        if self.keep_logits:
            self._logit_rows.append(feats["logits"].detach().float().cpu())
        self._indices.append(idx)
        self._local_n += b
        return self

    def gather(self) -> "FeatureAccumulator":
        """Combine all ranks (a collective over torch.distributed; without a process group of more than one
        rank it only sorts): stats all-reduced, rows all-gathered and sorted by index on every rank.
        Idempotent; call it on every rank, before compute_metrics."""
        if self.gathered:
            return self
        if self.pool_stats is not None:
            self.pool_stats.all_reduce()
        if self.spatial_stats is not None:
            self.spatial_stats.all_reduce()
        parts = [torch.cat(self._indices) if self._indices else torch.zeros(0, dtype=torch.int64)]
        if self.keep_pool_rows:
            parts.append(torch.cat(self._pool_rows) if self._pool_rows else torch.zeros(0, self.extractor.dim))
        if self.keep_logits:
            parts.append(torch.cat(self._logit_rows) if self._logit_rows
                         else torch.zeros(0, self.extractor.num_logits))
        parts = all_gather_rows(parts)
        indices, order = torch.sort(parts[0], stable=True)
        if len(indices) > 1 and bool((indices[1:] == indices[:-1]).any()):
            dup = int(indices[1:][indices[1:] == indices[:-1]][0])
            raise ValueError(f"index {dup} was added more than once: pass every image's own global index "
                             f"(e.g. its seed) to FeatureAccumulator.add")
        self.indices = indices
        rest = [p[order] for p in parts[1:]]
        if self.keep_pool_rows:
            self.pool_rows = rest.pop(0)
        if self.keep_logits:
            self.logits = rest.pop(0)
        self._n = len(indices)
        self._pool_rows, self._logit_rows, self._indices = [], [], []
        self.gathered = True
        return self


# ----------------------------------------------------------------------------- all metrics

def _fid_from(stats: FeatureStats, mu: Optional[np.ndarray], sigma: Optional[np.ndarray], metric: str,
              ref_keys: str, reference) -> float:
    if mu is None or sigma is None:
        raise ValueError(f"{metric} needs the reference's {ref_keys} (or its arr_0 images to compute them), "
                         f"which {_ref_name(reference)} lacks: load it with "
                         f"load_reference_full(..., need=[..., '{metric}']) or rebuild it with "
                         f"`python fid.py mode=ref source=... out=...`")
    if stats.n < 2:
        raise ValueError(f"{metric} needs at least 2 samples, got {stats.n}")
    return frechet_distance(stats.mean(), stats.cov(), mu, sigma)


def _ref_name(reference) -> str:
    return f"reference {reference.path}" if getattr(reference, "path", None) else "the reference"


def _check_samples(samples: FeatureAccumulator, reference: Reference, metrics: tuple[str, ...]) -> None:
    """The samples hold what `metrics` need, with the reference's features; gathers them (a collective) and
    warns when the image sizes of samples and reference differ."""
    missing = [m for m in metrics if m not in samples.metrics]
    if missing:
        raise ValueError(f"metrics {missing} were not collected: build FeatureAccumulator(extractor, metrics=...) "
                         f"with them (it has {list(samples.metrics)})")
    name = samples.extractor.name
    if getattr(reference, "feature", None) and reference.feature != name:
        raise ValueError(f"{_ref_name(reference)} holds '{reference.feature}' features but the samples have "
                         f"'{name}' features")
    samples.gather()
    ref_res, sam_res = getattr(reference, "resolution", None), samples.image_size
    if ref_res is not None and sam_res is not None and tuple(ref_res) != tuple(sam_res):
        warnings.warn(f"samples are {sam_res[0]}x{sam_res[1]} images but {_ref_name(reference)} is for "
                      f"{ref_res[0]}x{ref_res[1]} images: the metrics are not comparable with published numbers")


def _row_metrics(samples: FeatureAccumulator, reference: Reference, metrics: tuple[str, ...], pr_k: int,
                 kid_subsets: int, kid_subset_size: int, seed: int) -> dict[str, float]:
    """precision/recall and kid (those in `metrics`) of the sample pool rows against the reference images'."""
    row_metrics = [m for m in ROW_METRICS if m in metrics]
    if not row_metrics:
        return {}
    what = " and ".join(row_metrics)
    if reference.pool_rows is None:
        raise ValueError(f"{what} need the reference images' features, but {_ref_name(reference)} has no "
                         f"arr_0 images (or they were not loaded: load_reference_full(..., need=[..., "
                         f"'{row_metrics[0]}'])); ADM reference batches keep 10K images in arr_0, and "
                         f"`python fid.py mode=ref ... store_images=10000` stores them")
    ref_rows = torch.as_tensor(reference.pool_rows)
    out: dict[str, float] = {}
    if {"precision", "recall"} & set(metrics):
        need = pr_k + 1
        for what_rows, count in (("samples", samples.n), ("reference images", len(ref_rows))):
            if count < need:
                raise ValueError(f"precision/recall with k={pr_k} need at least {need} {what_rows}, got {count}")
        precision, recall = precision_recall(ref_rows, samples.pool_rows, k=pr_k, device=samples.device)
        if "precision" in metrics:
            out["precision"] = precision
        if "recall" in metrics:
            out["recall"] = recall
    if "kid" in metrics:
        for what_rows, count in (("samples", samples.n), ("reference images", len(ref_rows))):
            if count < 2:
                raise ValueError(f"kid needs at least 2 {what_rows}, got {count}")
        out["kid"], out["kid_std"] = kid(ref_rows, samples.pool_rows, subsets=kid_subsets,
                                         subset_size=kid_subset_size, seed=seed, device=samples.device)
    return out


def compute_metrics(samples: FeatureAccumulator, reference: Reference, metrics: Iterable[str] = FEATURE_METRICS,
                    is_split_size: int = 5000, pr_k: int = 3, kid_subsets: int = 100, kid_subset_size: int = 1000,
                    seed: int = 0) -> dict[str, float]:
    """{"fid", "sfid", "is", "precision", "recall", "kid", "kid_std"} (those requested) and "num_samples", against
    `reference`'s statistics and pool rows. Gathers `samples` first if not done (then call it on every rank)."""
    metrics = check_metrics(metrics)
    if set(metrics) & set(TOY_METRICS):
        raise ValueError(f"metrics {[m for m in metrics if m in TOY_METRICS]} are not computed from '"
                         f"{samples.extractor.name}' features: tread/evaluation/toy_checks.py (ToyScorer) scores them")
    _check_samples(samples, reference, metrics)
    out: dict[str, float] = {}
    if "fid" in metrics:
        out["fid"] = _fid_from(samples.pool_stats, reference.mu, reference.sigma, "fid", "mu/sigma", reference)
    if "sfid" in metrics:
        out["sfid"] = _fid_from(samples.spatial_stats, reference.mu_s, reference.sigma_s, "sfid", "mu_s/sigma_s",
                                reference)
    if "is" in metrics:
        if samples.n < 1:
            raise ValueError("is (Inception Score) needs at least 1 sample, got 0")
        out["is"] = inception_score(samples.logits, is_split_size)
    out.update(_row_metrics(samples, reference, metrics, pr_k, kid_subsets, kid_subset_size, seed))
    out["num_samples"] = samples.n
    return out
