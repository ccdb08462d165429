"""What every training dataset tells about itself (LatentDataset, WebDatasetLatents, BucketedDataset): the
contract training, evaluation and sampling read instead of probing a dataset's attributes."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Protocol, Sequence


class DatasetInfo(Protocol):
    root: Path                          # where it lives (a directory; WebDataset: the shards' location)

    @property
    def meta(self) -> dict[str, Any]: ...          # the validated meta.json (a bucketed dataset: the shared part)

    @property
    def channels(self) -> int: ...

    @property
    def num_classes(self) -> int: ...

    @property
    def conditioning(self) -> Optional[dict[str, Any]]: ...   # text, loss masks, references, first frames

    @property
    def video(self) -> Optional[dict[str, Any]]: ...          # clips: {frames, frame_stride, fps, ...}; None: images

    @property
    def buckets(self) -> Optional[Sequence[Any]]: ...         # bucketed data: one Bucket per latent shape; else None

    @property
    def parts(self) -> Sequence["DatasetInfo"]: ...           # its single-shape datasets (itself, or one per bucket)

    stores_repa_features: bool                                # read_repa_features() can read stored REPA targets

    def __getitems__(self, indices: Sequence[int]) -> tuple: ...   # a batch: (latents, labels[, extras])

    def __len__(self) -> int: ...
