"""The configs of sample.py (configs/sample.yaml) and fid.py (configs/fid.yaml): `check_sample`, `check_fid`."""
from __future__ import annotations

from typing import Literal, Optional, Union

from omegaconf import DictConfig

from schema.base import ConfigError, Flag, PositiveInt, check, key
from schema.sampling import DecodeSettings, MetricSettings, SamplingSettings, check_guidance
from schema.train import Paths
from schema.tree import container

Seeds = Union[None, int, str, list[int]]
SEEDS = "null (0..num_samples-1), 'a-b', '1,5,7' or a list of integers"
MODES = ("ref", "calc", "bench")


class SampleConfig(SamplingSettings, DecodeSettings):
    """sample.py"""

    checkpoint: str = key("a run directory, checkpoints/step_XXXXXXX directory or its model.pt")
    use_ema: Flag
    num_samples: int = key("a positive integer (used when seeds is null)", ge=1)
    seeds: Seeds = key(SEEDS)
    classes: Optional[list[int]] = key("null (seed i gets class i mod K) or a non-empty list of class ids",
                                       min_length=1)
    batch_size: int = key("a positive integer", ge=1)
    device: str = key("auto, cpu, cuda or cuda:N")
    out_dir: Optional[str] = key("null (<run dir>/samples/sample_<time>) or a directory")
    grid_nrow: Optional[int] = key("null (the number of classes) or a positive integer", ge=1)


class FidConfig(SamplingSettings, DecodeSettings, MetricSettings):
    """fid.py"""

    mode: Literal[MODES] = key("ref (build a reference), calc (metrics of images) or bench (sample and score "
                               "checkpoints)")
    cache_dir: str = key("a directory (the toy classifier is trained there once)")
    device: str = key("auto, cpu, cuda or cuda:N")
    batch_size: int = key("a positive integer (images per feature batch)", ge=1)
    is_split_size: PositiveInt
    pr_k: PositiveInt
    kid_subsets: PositiveInt
    kid_subset_size: PositiveInt
    metric_seed: int = key("an integer")
    source: Optional[str] = key("null or an image folder, samples .npz or latent dataset directory (mode=ref)")
    out: Optional[str] = key("null or the reference .npz to write (mode=ref)")
    max_images: Optional[int] = key("null or a positive integer", ge=1)
    store_images: int = key("an integer >= 0 (reference images kept as arr_0; ADM keeps 10000)", ge=0)
    images: Optional[str] = key("null or an image folder / .npz of generated images (mode=calc)")
    ref: Optional[str] = key("null or a reference .npz (calc, bench)")
    out_json: Optional[str] = key("null or a JSON file for the metrics (mode=calc)")
    checkpoints: Union[None, str, list[str]] = key("null or run dirs / checkpoint dirs / model.pt files / globs")
    num_samples: int = key("a positive integer (images per checkpoint, used when seeds is null)", ge=1)
    seeds: Seeds = key(SEEDS)
    sample_batch_size: int = key("a positive integer (images per sampling batch, per process)", ge=1)
    use_ema: Flag
    out_dir: str = key("a directory (metrics.jsonl, metrics.csv and samples)")
    keep_npz: Flag
    skip_existing: Flag
    paths: Paths = key("the paths group")


NEEDS = {"ref": ("source", "out"), "calc": ("images", "ref"), "bench": ("checkpoints", "ref")}
WHAT = {"source": "image folder | samples .npz | latent dataset dir", "out": "reference .npz to write",
        "images": "image folder | .npz of generated images", "ref": "reference .npz",
        "checkpoints": "run dir | checkpoint dir | model.pt | glob | list"}


def check_sample(cfg: Union[DictConfig, dict]) -> SampleConfig:
    s = check(SampleConfig, container(cfg), "")
    check_guidance(s, "")
    return s


def check_fid(cfg: Union[DictConfig, dict]) -> FidConfig:
    tree = container(cfg, required_ok=("mode",))
    mode = tree.get("mode")
    if mode not in MODES:
        raise ConfigError(f"mode={mode} is not valid: use mode=ref (build a reference), mode=calc (metrics of images "
                          f"against a reference) or mode=bench (sample and score checkpoints)")
    s = check(FidConfig, tree, "")
    check_guidance(s, "")
    for name in NEEDS[s.mode]:
        if getattr(s, name) is None:
            raise ConfigError(f"mode={s.mode} needs {name}=<{WHAT[name]}>")
    return s
