"""FVD: the Fréchet distance between VideoMAE features of generated and real clips (tread/encoders/videomae.py says
why VideoMAE and not I3D). The reference is built from real clips: by scripts/precompute_latents.py --fvd-out while
it encodes them, or by fid.py mode=ref fvd_out=...; training scores it when eval.metrics holds fvd.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import numpy as np
import torch

from tread.data.video import clip_tree, probe_clip, read_clip
from tread.encoders.videomae import VideoFeatures, build_video_features
from tread.evaluation.frechet import FeatureStats, frechet_distance
from tread.evaluation.reference import ReferenceFileError, read_reference_file, save_reference
from tread.schema.train import Eval
from tread.utils.readers import iter_npz_batches, npz_array_info

FVD = "fvd"
REF_HINT = ("scripts/precompute_latents.py --videos <clips> ... --fvd-out REF.npz --videomae-weights DIR, or "
            "`python fid.py mode=ref source=<clips folder | videos .npz> fvd_out=REF.npz videomae_weights=DIR`")


def without_fvd(metrics: Iterable[str]) -> tuple[str, ...]:
    """The metrics the frame-level networks compute (all but fvd)."""
    return tuple(m for m in metrics if m != FVD)


def video_stats(extractor: VideoFeatures, videos: Iterable[Union[torch.Tensor, np.ndarray]],
                stats: Optional[FeatureStats] = None) -> FeatureStats:
    """Feature statistics of batches of uint8 (B, F, H, W, 3) videos (added to `stats` when given)."""
    stats = FeatureStats(extractor.dim) if stats is None else stats
    for batch in videos:
        batch = torch.as_tensor(batch)
        if len(batch):
            stats.update(extractor(batch).cpu())
    return stats


def save_fvd_reference(path: Union[str, Path], stats: FeatureStats, extractor: VideoFeatures, source: str) -> Path:
    """mu, sigma, feature (the VideoMAE digest name), num_images (clips) and the source, as an .npz."""
    if stats.n < 2:
        raise ValueError(f"an FVD reference needs at least 2 clips (a covariance), got {stats.n} from {source}")
    return save_reference(path, stats, extractor.name, extra={"source": np.array(source), "kind": np.array(FVD)})


@dataclass
class FvdReference:
    mu: np.ndarray
    sigma: np.ndarray
    num_clips: int
    path: Path


def load_fvd_reference(path: Union[str, Path], extractor: Optional[VideoFeatures] = None) -> FvdReference:
    """An FVD reference .npz (mu, sigma of VideoMAE features), checked against `extractor` (the same weights) when
    given; ReferenceFileError naming the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ReferenceFileError(f"FVD reference '{path}' does not exist; build one from real clips with {REF_HINT}")
    data, files, _ = read_reference_file(path)
    if not {"mu", "sigma"} <= files:
        raise ReferenceFileError(f"FVD reference '{path}' has no mu/sigma (keys: {sorted(files)}); build one with "
                                 f"{REF_HINT}")
    feature = str(data.get("feature", ""))
    if extractor is not None and feature != extractor.name:
        raise ReferenceFileError(f"FVD reference '{path}' holds '{feature}' features, but the evaluation uses "
                                 f"'{extractor.name}' (other VideoMAE weights): rebuild it with {REF_HINT}")
    mu, sigma = np.asarray(data["mu"], np.float64), np.asarray(data["sigma"], np.float64)
    if extractor is not None and mu.shape != (extractor.dim,):
        raise ReferenceFileError(f"FVD reference '{path}': mu has shape {mu.shape}, the features are "
                                 f"{extractor.dim}-d")
    return FvdReference(mu, sigma, int(data.get("num_images", 0)), path)


def fvd_score(stats: FeatureStats, ref: FvdReference) -> float:
    """The Fréchet distance of gathered clip statistics from the reference's."""
    return frechet_distance(stats.mean(), stats.cov(), ref.mu, ref.sigma)


class FvdScorer:
    """FVD for in-training evaluation: the VideoMAE network (eval.videomae_weights) and the reference of real clips
    (eval.fvd_reference), both checked when it is made (before training starts)."""

    def __init__(self, settings: Eval, accelerator: Any, frames: int):
        if frames < 2:
            raise ValueError(f"eval.metrics={list(settings.metrics)} asks for fvd, which scores videos; this data's "
                             f"samples are images (1 frame). Allowed: fvd with video data (data.frames > 1), or "
                             f"drop fvd")
        if not settings.fvd_reference:
            raise ValueError(f"eval.metrics={list(settings.metrics)} asks for fvd, which needs eval.fvd_reference="
                             f"<an FVD reference .npz of real clips>: build one with {REF_HINT}")
        load_fvd_reference(settings.fvd_reference)         # its format, before the network is loaded
        self.device = accelerator.device
        self.extractor = build_video_features(settings.videomae_weights, "eval.videomae_weights", self.device)
        self.reference = load_fvd_reference(settings.fvd_reference, self.extractor)

    def accumulator(self) -> FeatureStats:
        """Pre-sized statistics, so a rank that samples no clip still joins the all-reduce."""
        return FeatureStats(self.extractor.dim, self.device)

    def add(self, stats: FeatureStats, videos: torch.Tensor) -> None:
        """Add decoded uint8 (B, F, H, W, 3) videos."""
        video_stats(self.extractor, [videos], stats)

    def score(self, stats: FeatureStats) -> float:
        """FVD of every process's clips (a collective: call it on every process)."""
        return fvd_score(stats.all_reduce(), self.reference)


# ----------------------------------------------------------------------------- clips from files (fid.py)

def video_source(path: Union[str, Path], what: str) -> tuple[int, Callable[[int], Iterator[np.ndarray]]]:
    """(clip count, batches(batch_size) -> uint8 (B, F, H, W, 3) batches) of a videos .npz (arr_0, as sample.py's
    samples.npz) or a folder of clips (video files or frame folders, every frame of each, one clip per batch).
    ValueError naming `what` and the file for anything else, read from headers before any network loads."""
    path = Path(path).expanduser()
    if path.suffix == ".npz":
        shape, dtype = npz_array_info(path, "arr_0", what)
        if dtype != np.uint8 or len(shape) != 5 or shape[-1] != 3:
            raise ValueError(f"{what}={path}: arr_0 must be uint8 (N, F, H, W, 3) videos (sample.py's samples.npz of "
                             f"a video model), got {dtype} {tuple(shape)}")
        return int(shape[0]), lambda b: iter_npz_batches(path, "arr_0", b, what)
    if not path.is_dir():
        raise ValueError(f"{what}={path} is neither a folder of clips nor a videos .npz (arr_0 uint8 (N, F, H, W, 3))")
    clips, _ = clip_tree(path)
    if not clips:
        raise ValueError(f"{what}={path} holds no clip (video files or frame folders)")
    infos = [probe_clip(c) for c in clips]          # every header, before any network loads
    return len(clips), lambda b: (read_clip(c, i.num_frames)[None] for c, i in zip(clips, infos))


def build_fvd_reference(out: Union[str, Path], extractor: VideoFeatures, source: Union[str, Path],
                        batch_size: int = 16) -> FeatureStats:
    """The FVD reference of the clips at `source` (video_source) written to `out`."""
    count, batches = video_source(source, "source")
    stats = video_stats(extractor, batches(batch_size))
    save_fvd_reference(out, stats, extractor, f"{source} ({count} clips)")
    return stats


def score_fvd(extractor: VideoFeatures, videos: Union[str, Path], ref: FvdReference, batch_size: int = 16) -> float:
    """FVD of the clips at `videos` (video_source) against `ref`."""
    _, batches = video_source(videos, "images")
    return fvd_score(video_stats(extractor, batches(batch_size)), ref)
