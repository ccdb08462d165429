"""Latent datasets (on-disk format, built-in toy data) and deterministic, resumable loading."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .latents import (LatentDataset, LatentDatasetError, LatentDatasetExistsError, check_decodable, decode_to_uint8,
                      draw_latents, latent_kind, model_shape, read_meta, write_latent_dataset)
from .loader import LatentLoader, ShardedBatchSampler
from .toy import TOY_CLASS_NAMES, ensure_toy_dataset, generate_toy_shapes

BUILTINS = {"toy_shapes": ensure_toy_dataset}  # data.builtin name -> builder(path, **data.builtin_args)

__all__ = ["BUILTINS", "LatentDataset", "LatentDatasetError", "LatentDatasetExistsError", "LatentLoader",
           "ShardedBatchSampler", "TOY_CLASS_NAMES", "build_dataset", "check_decodable", "decode_to_uint8", "draw_latents",
           "ensure_toy_dataset", "latent_kind", "model_shape",
           "generate_toy_shapes", "read_meta", "write_latent_dataset"]


def build_dataset(data_cfg: Mapping[str, Any]) -> LatentDataset:
    """The dataset `data_cfg` (the data: config group) describes, building a built-in one first if needed."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        path = data_cfg.get("path")
    except MissingMandatoryValue:  # path: ??? in the config
        path = None
    if not path:
        raise LatentDatasetError("data.path is not set: pass data.path=/path/to/dataset (a directory with "
                                 "meta.json, latents.npy, labels.npy), or use the built-in data (data=toy).")
    path = Path(str(path)).expanduser().absolute()
    builtin = data_cfg.get("builtin")
    if builtin is not None:
        if builtin not in BUILTINS:
            raise LatentDatasetError(f"unknown data.builtin={builtin!r}; allowed: {sorted(BUILTINS)} or null "
                                     f"(use the dataset at data.path as is)")
        BUILTINS[builtin](path, **dict(data_cfg.get("builtin_args") or {}))
    return LatentDataset(path, expected_channels=data_cfg.get("channels"),
                         expected_resolution=data_cfg.get("resolution"),
                         expected_num_classes=data_cfg.get("num_classes"))
