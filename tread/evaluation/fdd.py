"""FDD: the Fréchet distance between DINOv2 features of generated and reference images (Stein et al. 2023,
"Exposing flaws of generative model evaluation metrics"), the metric SPRINT and recent DiT work report beside FID.

It is FID's computation with another feature network: the samples' DINOv2 CLS features (encoders.features.
DinoFeatures: 224 px bicubic, ImageNet normalisation) against the reference's, the same FeatureAccumulator and
Fréchet distance, and a reference built from the dataset and cached per weights digest, as the main metrics'
is. The weights are local only (eval.dinov2_weights); offline, a missing folder is one clear error.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

from tread.encoders.features import build_dino_features
from tread.evaluation.metrics import FeatureAccumulator, compute_metrics
from tread.evaluation.reference import load_reference_full, reference_for_dataset

FDD = "fdd"


def without_fdd(metrics: Iterable[str]) -> tuple[str, ...]:
    """The metrics the main feature network computes (all but fdd)."""
    return tuple(m for m in metrics if m != FDD)


class FddScorer:
    """FDD for in-training evaluation: the DINOv2 network and the dataset's DINOv2 reference, made once."""

    def __init__(self, weights: Optional[str], dataset: Any, cache_dir: str | Path, accelerator: Any,
                 decode: dict, max_images: Optional[int] = None, square: Optional[int] = None):
        self.device = accelerator.device
        self.extractor = build_dino_features(weights, "eval.dinov2_weights", self.device)
        self.ref_path = Path(cache_dir) / "references" / f"{dataset.root.name}_{self.extractor.name}.npz"
        with accelerator.main_process_first():   # the first process builds and caches it
            reference_for_dataset(dataset, self.extractor, self.ref_path, max_images=max_images, decode_kwargs=decode,
                                  square=square)
        self.reference = load_reference_full(self.ref_path, self.extractor, need=("fid",))

    def accumulator(self) -> FeatureAccumulator:
        return FeatureAccumulator(self.extractor, ("fid",), device=self.device)

    def score(self, samples: FeatureAccumulator) -> float:
        """FDD of the gathered samples (a collective: call it on every process)."""
        return compute_metrics(samples, self.reference, ("fid",))["fid"]
