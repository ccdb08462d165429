"""Streaming Gaussian feature statistics and the Fréchet distance between two of them (FID, sFID)."""
from __future__ import annotations

from typing import Optional, Union

import numpy as np
import scipy.linalg
import torch

from tread.utils.distributed import all_reduce_sum, is_distributed

ArrayLike = Union[torch.Tensor, np.ndarray]


class FeatureStats:
    """Running n, sum and sum of outer products of (B, D) features in float64, on the device of the first batch;
    mean()/cov() return float64 numpy arrays."""

    def __init__(self, dim: Optional[int] = None, device: Union[str, torch.device] = "cpu"):
        self.n = 0
        self.sum: Optional[torch.Tensor] = None
        self.outer: Optional[torch.Tensor] = None
        if dim is not None:  # pre-sized: lets a rank with no samples still join all_reduce()
            self._init(dim, torch.device(device))

    def _init(self, dim: int, device: torch.device) -> None:
        self.sum = torch.zeros(dim, dtype=torch.float64, device=device)
        self.outer = torch.zeros(dim, dim, dtype=torch.float64, device=device)

    @property
    def dim(self) -> Optional[int]:
        return None if self.sum is None else self.sum.numel()

    def update(self, feats: ArrayLike) -> "FeatureStats":
        x = torch.as_tensor(feats).detach()
        if x.ndim != 2:
            raise ValueError(f"FeatureStats.update expects (B, D) features, got shape {tuple(x.shape)}")
        if self.sum is None:
            self._init(x.shape[1], x.device)
        elif x.shape[1] != self.dim:
            raise ValueError(f"feature dim changed: accumulated {self.dim}, got {x.shape[1]}")
        x = x.to(self.sum.device, torch.float64)
        self.n += x.shape[0]
        self.sum += x.sum(0)
        self.outer += x.T @ x
        return self

    def merge(self, other: "FeatureStats") -> "FeatureStats":
        """Add another accumulator's samples into this one (same result as one long stream)."""
        if other.sum is None:
            return self
        if self.sum is None:
            self._init(other.dim, other.sum.device)
        elif other.dim != self.dim:
            raise ValueError(f"cannot merge {other.dim}-d stats into {self.dim}-d stats")
        self.n += other.n
        self.sum += other.sum.to(self.sum.device)
        self.outer += other.outer.to(self.outer.device)
        return self

    def all_reduce(self) -> "FeatureStats":
        """Sum the accumulators over all torch.distributed ranks (no-op when not distributed)."""
        if not is_distributed():
            return self
        if self.sum is None:
            raise RuntimeError("FeatureStats.all_reduce on a rank without features: construct with dim=...")
        count = torch.tensor([float(self.n)], dtype=torch.float64, device=self.sum.device)
        packed = all_reduce_sum(torch.cat([count, self.sum, self.outer.flatten()]))
        d = self.dim
        self.n = int(round(packed[0].item()))
        self.sum = packed[1:1 + d].clone()
        self.outer = packed[1 + d:].view(d, d).clone()
        return self

    def mean(self) -> np.ndarray:
        if self.n < 1:
            raise ValueError("FeatureStats has no samples")
        return (self.sum / self.n).cpu().numpy()

    def cov(self) -> np.ndarray:
        """Unbiased covariance (ddof=1), as np.cov(x, rowvar=False)."""
        if self.n < 2:
            raise ValueError(f"need at least 2 samples for a covariance, have {self.n}")
        mu = self.sum / self.n
        cov = (self.outer - self.n * torch.outer(mu, mu)) / (self.n - 1)
        return cov.cpu().numpy()

    def to_npz_dict(self) -> dict:
        return {"mu": self.mean(), "sigma": self.cov()}


def _trace_sqrt_product(sigma1: np.ndarray, sigma2: np.ndarray) -> float:
    """tr sqrtm(S1 S2) for symmetric PSD S1, S2 as sum_i sqrt(lambda_i(S1^1/2 S2 S1^1/2)) (similar matrices), from two
    symmetric eigendecompositions; tiny negative eigenvalues from round-off are clipped to 0."""
    w, u = np.linalg.eigh((sigma1 + sigma1.T) / 2)
    root1 = (u * np.sqrt(np.clip(w, 0, None))) @ u.T
    m = root1 @ sigma2 @ root1
    return float(np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0, None)).sum())


def frechet_distance(mu1: ArrayLike, sigma1: ArrayLike, mu2: ArrayLike, sigma2: ArrayLike,
                     eps: float = 1e-6, method: str = "eigh") -> float:
    """||mu1 - mu2||^2 + tr(S1 + S2 - 2 sqrtm(S1 S2)), in float64: method="sqrtm" is ADM / pytorch-fid's scipy
    recipe verbatim, the default "eigh" the same trace from eigendecompositions (_trace_sqrt_product)."""
    mu1, mu2 = (np.atleast_1d(np.asarray(m, dtype=np.float64)) for m in (mu1, mu2))
    sigma1, sigma2 = (np.atleast_2d(np.asarray(s, dtype=np.float64)) for s in (sigma1, sigma2))
    if mu1.shape != mu2.shape:
        raise ValueError(f"mean vectors differ in shape: {mu1.shape} vs {mu2.shape} "
                         "(statistics from different feature extractors?)")
    d = mu1.shape[0]
    for name, s in (("sigma1", sigma1), ("sigma2", sigma2)):
        if s.shape != (d, d):
            raise ValueError(f"{name} has shape {s.shape}, expected {(d, d)} to match the {d}-d means")
    if method not in ("eigh", "sqrtm"):
        raise ValueError(f"frechet_distance method={method!r}: use 'eigh' or 'sqrtm'")
    if not (np.isfinite(mu1).all() and np.isfinite(mu2).all() and np.isfinite(sigma1).all()
            and np.isfinite(sigma2).all()):
        raise ValueError("feature statistics contain NaN or inf (broken features or images?)")

    diff = mu1 - mu2
    if method == "eigh":
        tr_covmean = _trace_sqrt_product(sigma1, sigma2)
    else:
        covmean = scipy.linalg.sqrtm(sigma1 @ sigma2)
        if not np.isfinite(covmean).all():
            # Singular product: regularise both covariances slightly, as pytorch-fid does.
            offset = np.eye(d) * eps
            covmean = scipy.linalg.sqrtm((sigma1 + offset) @ (sigma2 + offset))
        if np.iscomplexobj(covmean):
            # Numerical error gives tiny imaginary parts; large ones mean the statistics are broken.
            max_imag = np.max(np.abs(np.diagonal(covmean).imag))
            if max_imag > 1e-3:
                raise ValueError(f"sqrtm(sigma1 @ sigma2) has a large imaginary component ({max_imag:.3g})")
            covmean = covmean.real
        tr_covmean = float(np.trace(covmean))
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * tr_covmean)
