"""The built-in bucketed toy data (data=toy_buckets): toy_shapes (tread/data/builtin/toy.py) rendered at several image
sizes, one bucket each, as a bucketed dataset (tread/data/bucketed.py) with identity decoding (latents = pixels
in [-1, 1]), for aspect-ratio and multi-resolution training on a CPU without a VAE. Each bucket has its own seed
(seed + its position), so buckets hold different samples."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence, Union

import numpy as np

from tread.data.bucketed import is_bucketed, read_buckets_meta, write_bucketed_dataset
from tread.data.buckets import parse_buckets
from tread.data.meta import LatentDatasetError, LatentDatasetExistsError

from .toy import TOY_CLASS_NAMES, generate_toy_shapes


def ensure_toy_buckets(path: Union[str, os.PathLike], sizes: Sequence[str], num_per_class: Union[int, Sequence[int]],
                       seed: int = 0, loss_masks: bool = False) -> Path:
    """The dataset's directory, `path`/<digest of the parameters>, first writing toy_shapes at `sizes`
    (["WIDTHxHEIGHT", ...], one bucket each) with `num_per_class` images per class (one count for every bucket, or
    one per bucket) there unless it is there already (so other buckets never meet it); loss_masks: each bucket
    also stores the shapes' coverage as loss masks (loss_mask.npy at the bucket's image size)."""
    buckets = parse_buckets(",".join(sizes), "data.builtin_args.sizes")
    counts = [num_per_class] * len(buckets) if isinstance(num_per_class, int) else list(num_per_class)
    if len(counts) != len(buckets) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise LatentDatasetError(f"data.builtin_args.num_per_class={num_per_class!r}: allowed an integer >= 1, or "
                                 f"one per size in data.builtin_args.sizes ({len(buckets)})")
    params = {"name": "toy_shapes_buckets", "buckets": {b.name: int(n) for b, n in zip(buckets, counts)},
              "seed": int(seed), **({"loss_masks": True} if loss_masks else {})}
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(path).expanduser().absolute() / digest
    if is_bucketed(root):
        return _check_existing(root, params)
    parts = []
    for k, (bucket, n) in enumerate(zip(buckets, counts)):
        generated = generate_toy_shapes(n, (bucket.height, bucket.width), seed + k, loss_masks=bool(loss_masks))
        images, labels = generated[:2]
        crops = np.tile(np.array([bucket.height, bucket.width] * 2 + [0, 0], np.int32), (len(labels), 1))
        parts.append({"bucket": bucket, "latents": images.numpy(), "labels": labels.numpy(), "crops": crops,
                      "extras": {"loss_mask": generated[2].numpy()} if loss_masks else None})
    try:
        write_bucketed_dataset(root, parts, source=f"built-in toy_shapes in buckets {list(params['buckets'])} "
                               f"(tread/data/builtin/toy_buckets.py), seed {seed}", builtin=params,
                               num_classes=len(TOY_CLASS_NAMES), class_names=TOY_CLASS_NAMES, dtype="float16")
    except LatentDatasetExistsError:
        if not is_bucketed(root):
            raise
    return _check_existing(root, params)


def _check_existing(root: Path, params: dict) -> Path:
    found = read_buckets_meta(root).get("builtin")
    if found != params:
        raise LatentDatasetError(f"'{root}' already holds a bucketed dataset with builtin={found}, but {params} was "
                                 f"requested (data.builtin_args). Delete the directory to regenerate it, or point "
                                 f"data.path elsewhere.")
    return root
