"""An independent evaluator for the built-in toy_shapes data, sharing no network with the toy FID: fd_ae,
class_acc and the training-free colour_acc / shape_acc (docs/evaluation.md, "An independent evaluator").
Only for identity-decoded toy_shapes data with eval.features=toy_classifier.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import numpy as np
import torch

from tread.data.builtin.toy import TOY_COLOURS, TOY_SHAPES, ensure_toy_autoencoder, ensure_toy_pixel_mlp
from tread.encoders.toy_autoencoder import AUTOENCODER_SEED, AutoencoderFeatures, load_net
from tread.evaluation.extractors import reference_cache_path
from tread.schema.metric_names import TOY_METRICS
from tread.evaluation.metrics import FeatureAccumulator, compute_metrics
from tread.evaluation.reference import load_reference_full, reference_for_dataset
from tread.utils.distributed import all_reduce_sum
from tread.utils.errors import UserError

CHECKS = ("class_acc", "shape_acc", "colour_acc")
FG_DISTANCE = 0.25        # a foreground pixel is at least this far (RGB in [0, 1]) from the background
CENTRES, SIZES = np.linspace(-0.18, 0.18, 7), np.linspace(0.5, 0.66, 4)   # generate_toy_shapes' jitter ranges


class ToyMetricError(UserError):
    """eval.metrics asks for a toy check where it does not apply."""


def check_toy_metrics(metrics: Iterable[str], features: str, meta: Mapping[str, Any], bucketed: bool = False,
                      key: str = "eval.metrics") -> None:
    """The toy metrics in `metrics` need eval.features=toy_classifier and identity-decoded toy_shapes data (one
    resolution); else ToyMetricError naming the key, its value and what is allowed."""
    asked = [m for m in metrics if m in TOY_METRICS]
    if not asked:
        return
    builtin = (meta.get("builtin") or {}).get("name")
    decode = (meta.get("decode") or {"type": "identity"}).get("type")
    why = (f"features={features}" if features != "toy_classifier" else
           f"data {builtin or meta.get('source', 'not built-in')!r}" if builtin != "toy_shapes" or bucketed else
           f"decode type {decode!r}" if decode != "identity" else None)
    if why:
        raise ToyMetricError(f"{key}={list(metrics)}: {asked} are checks of the built-in toy_shapes data, allowed only "
                             f"with features=toy_classifier on identity-decoded data=toy (got {why}); drop them or "
                             f"use fid, sfid, is, precision, recall, kid, fdd")


# ----------------------------------------------------------------------------- generator-parameter checks

def foreground(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (B, 3, H, W) -> (pixels in [0, 1] as (B, H*W, 3), each pixel's RGB distance to the background
    (B, H*W)); the background: the median colour of the image's border pixels."""
    x = images.float().div(255).flatten(2).transpose(1, 2)                      # (B, HW, 3)
    h, w = images.shape[-2:]
    border = torch.zeros(h, w, dtype=torch.bool)
    border[[0, -1], :], border[:, [0, -1]] = True, True
    bg = x[:, border.flatten()].median(dim=1).values                            # (B, 3)
    return x, (x - bg[:, None]).norm(dim=2)


def fg_mask(dist: torch.Tensor) -> torch.Tensor:
    """(B, HW) bool: pixels beyond half the shape's distance from the background (the 98th percentile of the
    distance), and at least FG_DISTANCE away."""
    far = torch.quantile(dist, 0.98, dim=1, keepdim=True)
    return dist > torch.clamp(0.5 * far, min=FG_DISTANCE)


def colour_predictions(images: torch.Tensor) -> torch.Tensor:
    """(B,) the class whose base colour (TOY_COLOURS) is nearest the mean colour of the sample's core foreground
    (pixels at >= 80 % of the 98th-percentile distance from the background); -1 when there is none."""
    x, dist = foreground(images)
    far = torch.quantile(dist, 0.98, dim=1, keepdim=True)
    core = (dist >= 0.8 * far) & (far >= FG_DISTANCE)
    mean = (x * core[..., None]).sum(1) / core.sum(1, keepdim=True).clamp_min(1)
    pred = torch.cdist(mean, torch.from_numpy(TOY_COLOURS)).argmin(1)
    return torch.where(core.any(1), pred, torch.full_like(pred, -1))


@lru_cache(maxsize=4)
def shape_templates(resolution: int) -> tuple[torch.Tensor, torch.Tensor]:
    """((T, R*R) float 0/1 masks, (T,) class) of every class's shape (coverage > 0.5) drawn as
    generate_toy_shapes draws it, over a 7 x 7 grid of centres and 4 sizes spanning its jitter ranges."""
    coords = (np.arange(resolution, dtype=np.float32) + 0.5 - resolution / 2) / resolution * 2
    cx, cy, r = (a.reshape(-1, 1, 1).astype(np.float32) for a in np.meshgrid(CENTRES, CENTRES, SIZES))
    x, y = coords[None, None, :] - cx, coords[None, :, None] - cy
    masks = [shape(x, y, r, 2 / resolution) > 0.5 for shape in TOY_SHAPES]       # each (G, R, R)
    labels = np.repeat(np.arange(len(TOY_SHAPES)), len(r))
    return torch.from_numpy(np.concatenate(masks).reshape(len(labels), -1).astype(np.float32)), \
        torch.from_numpy(labels)


def shape_predictions(images: torch.Tensor) -> torch.Tensor:
    """(B,) the class of the shape template with the highest IoU with the sample's foreground mask (fg_mask)."""
    templates, labels = shape_templates(int(images.shape[-1]))
    mask = fg_mask(foreground(images)[1]).float()
    inter = mask @ templates.T
    iou = inter / (mask.sum(1, keepdim=True) + templates.sum(1) - inter).clamp_min(1)
    return labels[iou.argmax(1)]


# ----------------------------------------------------------------------------- in-training scoring

class ToyAccumulator:
    """What the toy metrics need from the samples of one evaluation: fd_ae's feature statistics and the counts of
    correct class / shape / colour predictions (per-rank until score())."""

    def __init__(self, scorer: "ToyScorer"):
        self.scorer = scorer
        self.features = FeatureAccumulator(scorer.extractor, ("fid",), device=scorer.device) \
            if scorer.extractor is not None else None
        self.counts = torch.zeros(1 + len(CHECKS), dtype=torch.float64)     # n, then correct per check

    @torch.no_grad()
    def add(self, images: torch.Tensor, labels: torch.Tensor, indices: Any) -> None:
        """uint8 (B, 3, H, W) samples, their (B,) conditioning labels and global indices."""
        if self.features is not None:
            self.features.add(images, indices)
        cpu, labels = images.cpu(), labels.cpu()
        self.counts[0] += len(labels)
        for i, check in enumerate(CHECKS, 1):
            if check in self.scorer.metrics:
                self.counts[i] += (self.scorer.predict(check, cpu) == labels).sum().item()


class ToyScorer:
    """fd_ae, class_acc, shape_acc, colour_acc (those in `metrics`) for in-training evaluation: the networks
    (trained and cached in cache_dir first when missing) and fd_ae's reference (the FID reference's images,
    features cached as <dataset>_toy_autoencoder_s<seed>.npz), made once."""

    def __init__(self, metrics: Iterable[str], dataset: Any, cache_dir: str | Path, accelerator: Any, decode: dict,
                 resolution: int, max_images: Optional[int] = None):
        self.metrics = tuple(m for m in metrics if m in TOY_METRICS)
        self.device = accelerator.device
        self.extractor = self.mlp = path = None
        with accelerator.main_process_first():                # the first process trains and caches them
            if "class_acc" in self.metrics:
                self.mlp = load_net("toy_pixel_mlp", ensure_toy_pixel_mlp(cache_dir, resolution))
            if "fd_ae" in self.metrics:
                ae = load_net("toy_autoencoder", ensure_toy_autoencoder(cache_dir, resolution))
                self.extractor = AutoencoderFeatures(ae, AUTOENCODER_SEED).to(self.device).requires_grad_(False)
                path = reference_cache_path(cache_dir, dataset, self.extractor.name, max_images)
                reference_for_dataset(dataset, self.extractor, path, max_images=max_images, decode_kwargs=decode)
        self.reference = load_reference_full(path, self.extractor) if path is not None else None

    def predict(self, check: str, images: torch.Tensor) -> torch.Tensor:
        """(B,) predicted classes of uint8 (B, 3, H, W) CPU images by `check` (class_acc / shape_acc / colour_acc)."""
        if check == "class_acc":
            return self.mlp(images).argmax(1)
        return shape_predictions(images) if check == "shape_acc" else colour_predictions(images)

    def accumulator(self) -> ToyAccumulator:
        return ToyAccumulator(self)

    def score(self, acc: ToyAccumulator) -> dict[str, float]:
        """The metrics over every rank's samples (a collective: call it on every process)."""
        counts = all_reduce_sum(acc.counts.to(self.device)).cpu()
        out = {check: counts[i].item() / max(counts[0].item(), 1) for i, check in enumerate(CHECKS, 1)
               if check in self.metrics}
        if acc.features is not None:
            out["fd_ae"] = compute_metrics(acc.features, self.reference, ("fid",))["fid"]
        return {m: out[m] for m in self.metrics}
