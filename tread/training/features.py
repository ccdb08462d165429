"""The optional parts of training, registered once: a new one is its own file and one entry in FEATURES. Their
order is the order of their draws on the training stream (caption dropout, then first frames)."""
from __future__ import annotations

from typing import Optional

from tread.data.info import DatasetInfo
from tread.schema.train import TrainConfig
from tread.training.caption_dropout import CaptionDropout
from tread.training.feature import Feature
from tread.training.first_frames import FirstFrames
from tread.training.guard import NonFiniteGuard
from tread.training.repa_alignment import RepaAlignment
from tread.training.setup import TrainingParts

FEATURES = (CaptionDropout, FirstFrames, NonFiniteGuard, RepaAlignment)


def build_features(config: TrainConfig, parts: TrainingParts, dataset: Optional[DatasetInfo]) -> list[Feature]:
    """The features this run's config turns on (`dataset`: its data; None for the benchmark's synthetic batches)."""
    built = (feature.build(config, parts, dataset) for feature in FEATURES)
    return [f for f in built if f is not None]
