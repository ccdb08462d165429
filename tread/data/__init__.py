"""Latent datasets: the on-disk format, its readers and writers, and deterministic, resumable loading; the built-in
toy data (tread.data.builtin); precomputing (tread.data.precompute, imported by its users only). docs/data.md."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .bucketed import BucketedDataset, BucketedWriter, is_bucketed, make_sampler, write_bucketed_dataset
from .buckets import Bucket, BucketError, assign_bucket, derive_buckets, fit_crop, parse_buckets
from .builtin import BUILTINS, TOY_CLASS_NAMES, ensure_toy_classifier, ensure_toy_dataset, generate_toy_shapes
from .decode import check_decodable, decode_to_uint8
from .images import ImageFolderError, center_crop_arr, list_image_folder
from .info import DatasetInfo
from .integrity import check_dataset, check_integrity, record_integrity
from .loader import BucketBatchSampler, LatentLoader, PhasedSampler, ShardedBatchSampler
from .meta import (COND_KEYS, EXTRA_KEYS, LatentDatasetError, LatentDatasetExistsError, draw_latents,
                   has_model_conditioning, latent_kind, model_shape, read_meta, shift_factor)
from .reader import LatentDataset
from .wds import WebDatasetLatents
from .writer import LatentDatasetWriter, write_latent_dataset

FORMATS = ("latents", "wds")  # data.format: our directory format | WebDataset tar shards (TREAD/MaskDiT latents)
# What data.format=wds reads from the data config, which is their one source (configs/data/imagenet256_wds.yaml)
WDS_KEYS = ("num_classes", "latent_scale", "latent_kind", "latent_draw", "vae", "index_dir")

__all__ = ["Bucket", "DatasetInfo", "BucketBatchSampler", "BucketError", "BucketedDataset", "BucketedWriter", "PhasedSampler",
           "assign_bucket", "derive_buckets", "fit_crop", "is_bucketed", "make_sampler", "parse_buckets",
           "write_bucketed_dataset", "BUILTINS", "FORMATS", "WDS_KEYS", "LatentDataset", "LatentDatasetError", "LatentDatasetExistsError",
           "LatentLoader", "ShardedBatchSampler", "TOY_CLASS_NAMES", "build_dataset", "check_decodable",
           "decode_to_uint8", "draw_latents", "ensure_toy_classifier", "ensure_toy_dataset", "latent_kind",
           "model_shape", "LatentDatasetWriter", "shift_factor", "ImageFolderError", "center_crop_arr",
           "list_image_folder", "generate_toy_shapes", "read_meta", "write_latent_dataset", "WebDatasetLatents",
           "COND_KEYS", "EXTRA_KEYS", "has_model_conditioning", "check_dataset", "check_integrity",
           "record_integrity"]


def build_dataset(spec: Mapping[str, Any]) -> DatasetInfo:
    """The dataset `spec` (the data: config group) describes, building a built-in one first if needed: data.format
    "latents" (default: LatentDataset, or BucketedDataset for a "tread-buckets" folder) or "wds" (WebDatasetLatents).
    """
    from omegaconf.errors import MissingMandatoryValue

    fmt = spec.get("format") or "latents"
    if fmt not in FORMATS:
        raise LatentDatasetError(f"unknown data.format={fmt!r}; allowed: {list(FORMATS)} ('latents': a directory "
                                 f"with meta.json, latents.npy, labels.npy; 'wds': WebDataset .tar shards)")
    try:
        path = spec.get("path")
    except MissingMandatoryValue:  # path: ??? in the config
        path = None
    if not path:
        if fmt == "wds":
            raise LatentDatasetError("data.path is not set: pass data.path=/path/to/shards (a directory of .tar "
                                     "shards, one .tar, or a quoted brace pattern such as "
                                     "'data.path=\"/data/imagenet-{000000..000127}.tar\"').")
        raise LatentDatasetError("data.path is not set: pass data.path=/path/to/dataset (a directory with "
                                 "meta.json, latents.npy, labels.npy), or use the built-in data (data=toy).")
    if fmt == "wds":
        return _build_wds(spec, path)
    path = Path(str(path)).expanduser().absolute()
    builtin = spec.get("builtin")
    if builtin is not None:
        if builtin not in BUILTINS:
            raise LatentDatasetError(f"unknown data.builtin={builtin!r}; allowed: {sorted(BUILTINS)} or null "
                                     f"(use the dataset at data.path as is)")
        path = BUILTINS[builtin](path, **dict(spec.get("builtin_args") or {}))   # where the builder put it
    if is_bucketed(path):
        dataset = BucketedDataset(path, expected_channels=spec.get("channels"),
                                  expected_num_classes=spec.get("num_classes"))
    else:
        dataset = LatentDataset(path, expected_channels=spec.get("channels"),
                                expected_resolution=spec.get("resolution"),
                                expected_num_classes=spec.get("num_classes"))
    _check_draw(dataset, spec.get("latent_draw") or "sample")
    return dataset


def _check_draw(dataset: Any, draw: str) -> None:
    """data.latent_draw on our directory format: moments data is drawn per read (sample); plain latents are read
    as stored (sample or stored). The other choices are the WebDataset reader's (data.format=wds)."""
    moments = latent_kind(dataset.meta) == "moments"
    if draw == "mean" or (moments and draw != "sample"):
        kind, allowed = ("moments", "sample") if moments else ("plain latents", "sample or stored")
        raise LatentDatasetError(f"data.latent_draw={draw} is not allowed for '{dataset.root}' ({kind}, "
                                 f"data.format=latents); allowed: {allowed} (mean and stored moments: data.format=wds)")



def _build_wds(spec: Mapping[str, Any], path: Any) -> WebDatasetLatents:
    """The WebDataset shards at `path`, read as the data config's WDS_KEYS say (the config is their one source:
    a key left out is an error here, as it is in the schema, never a default)."""
    if spec.get("builtin") is not None:
        raise LatentDatasetError(f"data.builtin={spec.get('builtin')!r} cannot be used with data.format=wds "
                                 f"(built-in data uses the 'latents' format); set data.builtin=null")
    missing = [k for k in WDS_KEYS if k not in spec]
    if missing:
        raise LatentDatasetError(f"data.format=wds needs data.{', data.'.join(missing)} in the data config; "
                                 f"configs/data/imagenet256_wds.yaml sets them (data=imagenet256_wds)")
    shards = path if isinstance(path, str) else [str(p) for p in path]
    return WebDatasetLatents(
        shards, num_classes=spec["num_classes"], latent_scale=spec["latent_scale"],
        latent_kind=spec["latent_kind"], latent_draw=spec["latent_draw"], vae=spec["vae"],
        index_dir=spec["index_dir"],
        expected_channels=spec.get("channels"), expected_resolution=spec.get("resolution"),
        expected_num_classes=spec["num_classes"])
