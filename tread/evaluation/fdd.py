"""FDD: the Fréchet distance between DINOv2 features of generated and reference images (Stein et al. 2023), FID's
computation with another feature network. The reference should hold real images' features; without one it is
built from VAE reconstructions in its own cache file (docs/evaluation.md, "FDD as defined").
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

from tread.encoders.features import build_dino_features
from tread.evaluation.metrics import FeatureAccumulator, compute_metrics
from tread.evaluation.extractors import reference_cache_path
from tread.evaluation.reference import Reference, load_reference_full, read_reference_file, reference_for_dataset
from tread.schema.train import Eval

FDD = "fdd"


def without_fdd(metrics: Iterable[str]) -> tuple[str, ...]:
    """The metrics the main feature network computes (all but fdd)."""
    return tuple(m for m in metrics if m != FDD)


def fdd_cache_path(cache_dir: str | Path, dataset: Any, extractor_name: str, max_images: Optional[int],
                   square: Optional[int] = None) -> Path:
    """<cache_dir>/references/<dataset>_fdd_<extractor>_<N>img[_sq<side>].npz: the auto-built FDD reference of
    N dataset images (reference_cache_path), a file no FID reference shares."""
    return reference_cache_path(cache_dir, dataset, extractor_name, max_images, square, tag="fdd_")


def load_fdd_reference(path: str | Path, extractor) -> Reference:
    """An FDD reference .npz (mu/sigma or arr_0 images), checked against `extractor` (the same weights)."""
    return load_reference_full(path, extractor, need=("fid",))


class FddScorer:
    """FDD for in-training evaluation: the DINOv2 network and its reference (eval.fdd_reference, or built from
    the dataset's VAE reconstructions and cached), made once."""

    def __init__(self, settings: Eval, dataset: Any, cache_dir: str | Path, accelerator: Any, decode: dict,
                 square: Optional[int] = None):
        self.device = accelerator.device
        given = settings.fdd_reference
        if given and not Path(given).is_file():
            raise FileNotFoundError(f"eval.fdd_reference={given!r} does not exist; build one from real images with "
                                    f"`python fid.py mode=ref source=<images> fdd_out=REF.npz dinov2_weights=DIR`.")
        if given:
            read_reference_file(given)          # its format, before any network is loaded
        self.extractor = build_dino_features(settings.dinov2_weights, "eval.dinov2_weights", self.device)
        if given:
            self.ref_path = Path(given)
        else:
            max_images = settings.fdd_reference_max_images
            self.ref_path = fdd_cache_path(cache_dir, dataset, self.extractor.name, max_images, square)
            if accelerator.is_main_process:
                print(f"note: the FDD reference is built from VAE reconstructions of the dataset's latents, not real "
                      f"images ({self.ref_path}); eval.fdd_reference=<fid.py mode=ref fdd_out=...> gives FDD as "
                      f"defined", flush=True)
            with accelerator.main_process_first():   # the first process builds and caches it
                reference_for_dataset(dataset, self.extractor, self.ref_path, max_images=max_images,
                                      decode_kwargs=decode, square=square)
        self.reference = load_fdd_reference(self.ref_path, self.extractor)

    def accumulator(self) -> FeatureAccumulator:
        return FeatureAccumulator(self.extractor, ("fid",), device=self.device)

    def score(self, samples: FeatureAccumulator) -> float:
        """FDD of the gathered samples (a collective: call it on every process)."""
        return compute_metrics(samples, self.reference, ("fid",))["fid"]
