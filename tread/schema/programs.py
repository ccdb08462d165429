"""The configs of sample.py (configs/sample.yaml) and fid.py (configs/fid.yaml): `check_sample`, `check_fid`."""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from omegaconf import DictConfig
from pydantic import Field

from tread.schema.metric_names import METRICS
from tread.schema.base import SEED_LIMIT, ConfigError, Flag, PositiveInt, check, check_dirs, key, show
from tread.schema.sampling import (NEGATIVE_PROMPT, PROMPTS, TEXT_ENCODERS, DecodeSettings, MetricSettings, Prompt,
                             SamplingSettings, check_guidance)
from tread.schema.train import Paths
from tread.schema.tree import container
from tread.utils.device import cuda_count, why_unavailable

SAMPLE_SEED_LIMIT = 2 ** 63      # a sample's seed seeds its own torch.Generator (64 bits)
# Images one launch samples (seeds it names): 20x ADM's 50K. The seed list alone of 10**11 seeds would need
# terabytes (a MemoryError long after start); sample.py keeps every image in memory too.
MAX_SEEDS = 1_000_000
SampleSeed = Annotated[int, Field(ge=0, lt=SAMPLE_SEED_LIMIT)]
Seeds = Union[None, SampleSeed, str, Annotated[list[SampleSeed], Field(min_length=1)]]
SEEDS = "null (0..num_samples-1), 'a-b', '1,5,7' or a non-empty list of integers >= 0"
SEED_PART = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
MODES = ("ref", "calc", "bench")
Device = Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?)$")]
DEVICES = "auto, cpu, cuda or cuda:N"


class SampleConfig(SamplingSettings, DecodeSettings):
    """sample.py"""

    checkpoint: str = key("a run directory, checkpoints/step_XXXXXXX directory or a file in it")
    use_ema: Flag
    num_samples: int = key("a positive integer (used when seeds is null)", ge=1)
    seeds: Seeds = key(SEEDS)
    classes: Optional[list[int]] = key("null (seed i gets class i mod K) or a non-empty list of class ids",
                                       min_length=1)
    batch_size: int = key("a positive integer", ge=1)
    device: Device = key(DEVICES)
    out_dir: Optional[str] = key("null (<run dir>/samples/sample_<time>) or a directory")
    grid_nrow: Optional[int] = key("null (the number of classes; with prompts, the seeds per prompt) or a positive "
                                   "integer", ge=1)
    prompts: Optional[list[Prompt]] = key(f"null (the training data's text or classes) or {PROMPTS}", min_length=1)
    prompts_file: Optional[str] = key("null or a UTF-8 text file with one prompt per line (empty lines skipped)")
    negative_prompt: str = key(NEGATIVE_PROMPT)
    text_encoders: Optional[str] = key(f"null (the checkpoint's model.text_encoders) or {TEXT_ENCODERS}")


class FidConfig(SamplingSettings, DecodeSettings, MetricSettings):
    """fid.py"""

    mode: Literal[MODES] = key("ref (build a reference), calc (metrics of images) or bench (sample and score "
                               "checkpoints)")
    cache_dir: str = key("a directory (the toy classifier is trained there once)")
    device: Device = key(DEVICES + "; bench: each process takes its own GPU")
    batch_size: int = key("a positive integer (images per feature batch)", ge=1)
    is_split_size: PositiveInt
    pr_k: PositiveInt
    kid_subsets: PositiveInt
    kid_subset_size: PositiveInt
    metric_seed: int = key("an integer in [0, 2**32) (KID subsets)", ge=0, lt=SEED_LIMIT)
    source: Optional[str] = key("null or an image folder, samples .npz or latent dataset directory (mode=ref)")
    out: Optional[str] = key("null or the reference .npz to write (mode=ref)")
    max_images: Optional[int] = key("null or a positive integer", ge=1)
    store_images: int = key("an integer >= 0 (reference images kept as arr_0; ADM keeps 10000)", ge=0)
    images: Optional[str] = key("null or an image folder / .npz of generated images (mode=calc)")
    ref: Optional[str] = key("null or a reference .npz (calc, bench)")
    fdd_out: Optional[str] = key("null or an FDD (DINOv2) reference .npz to write from the same images (mode=ref)",
                                 default=None)
    fdd_ref: Optional[str] = key("null or an FDD reference .npz (mode=calc with fdd in metrics)", default=None)
    fvd_out: Optional[str] = key("null or an FVD (VideoMAE) reference .npz to write from the clips at source "
                                 "(mode=ref, alone)", default=None)
    fvd_ref: Optional[str] = key("null or an FVD reference .npz (mode=calc metrics=[fvd])", default=None)
    out_json: Optional[str] = key("null or a JSON file for the metrics (mode=calc)")
    checkpoints: Union[None, str, list[str]] = key("null or run dirs / checkpoint dirs / files in them / globs")
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
        "checkpoints": "run dir | checkpoint dir | a file in it | glob | list"}


def check_sample(cfg: Union[DictConfig, dict]) -> SampleConfig:
    s = check(SampleConfig, container(cfg), "")
    check_guidance(s, "")
    check_seeds(s.seeds, num_samples=s.num_samples)
    check_device(s.device)
    check_prompt_keys(s)
    check_dirs({"out_dir": s.out_dir})
    return s


def check_prompt_keys(s: SampleConfig) -> None:
    """prompts / prompts_file: one of them at most, and not with classes (prompts replace classes)."""
    if s.prompts is not None and s.prompts_file is not None:
        raise ConfigError(f"prompts={show(s.prompts)} and prompts_file={show(s.prompts_file)} are both set; allowed: "
                          f"one of them (or neither).")
    if (s.prompts is not None or s.prompts_file is not None) and s.classes is not None:
        raise ConfigError(f"classes={show(s.classes)} cannot be combined with prompts: prompts condition a text model, "
                          f"classes a class-conditional one; allowed: classes=null with prompts.")


def check_fid(cfg: Union[DictConfig, dict]) -> FidConfig:
    tree = container(cfg, required_ok=("mode",))
    mode = tree.get("mode")
    if mode not in MODES:
        raise ConfigError(f"mode={mode} is not valid: use mode=ref (build a reference), mode=calc (metrics of images "
                          f"against a reference) or mode=bench (sample and score checkpoints)")
    s = check(FidConfig, tree, "")
    check_fdd_keys(s)
    check_fvd_keys(s)
    check_guidance(s, "")
    check_seeds(s.seeds, num_samples=s.num_samples if s.mode == "bench" else None)
    check_device(s.device)
    for name in NEEDS[s.mode]:
        if getattr(s, name) is None and not fdd_alone(s, name) and not fvd_alone(s, name):
            raise ConfigError(f"mode={s.mode} needs {name}=<{WHAT[name]}>")
    check_dirs({"cache_dir": s.cache_dir, **({"out_dir": s.out_dir} if s.mode == "bench" else {})},
               files={"ref": {"out": s.out, "fdd_out": s.fdd_out, "fvd_out": s.fvd_out}, "calc": {"out_json": s.out_json},
                      "bench": {}}[s.mode])
    return s


def fdd_alone(s: FidConfig, name: str) -> bool:
    """FDD alone needs no main reference: mode=ref with only fdd_out, mode=calc with metrics=[fdd]."""
    return (name == "out" and s.fdd_out is not None) or (name == "ref" and s.mode == "calc" and
                                                         list(s.metrics) == ["fdd"])


def fvd_alone(s: FidConfig, name: str) -> bool:
    """FVD runs alone: mode=ref with fvd_out needs no out, mode=calc metrics=[fvd] no ref."""
    return (name == "out" and s.fvd_out is not None) or (name == "ref" and s.mode == "calc" and
                                                         list(s.metrics) == ["fvd"])


def check_fvd_keys(s: FidConfig) -> None:
    """fvd scores clips, not images: alone in calc (with fvd_ref), fvd_out alone in ref; both need VideoMAE weights;
    bench does not compute it."""
    how = ("(nothing is downloaded: save MCG-NJU/videomae-base with transformers' save_pretrained on a machine with "
           "network)")
    if "fvd" in s.metrics and (s.mode != "calc" or list(s.metrics) != ["fvd"]):
        raise ConfigError(f"metrics={list(s.metrics)} with mode={s.mode}: fvd scores clips, so it runs alone, as "
                          f"mode=calc metrics=[fvd] images=<videos .npz | clips folder> fvd_ref=<FVD reference .npz>.")
    if s.mode == "calc" and "fvd" in s.metrics and (s.fvd_ref is None or not s.videomae_weights):
        raise ConfigError(f"metrics=[fvd] needs fvd_ref=<an FVD reference .npz> (got {show(s.fvd_ref)}) and "
                          f"videomae_weights=<a local VideoMAEModel folder> (got {show(s.videomae_weights)}) {how}.")
    if s.fvd_out is not None and (s.mode != "ref" or s.out is not None or s.fdd_out is not None):
        raise ConfigError(f"fvd_out={show(s.fvd_out)} writes an FVD reference of clips, alone: allowed with mode=ref "
                          f"and out=null, fdd_out=null (got mode={s.mode}, out={show(s.out)}, "
                          f"fdd_out={show(s.fdd_out)}).")
    if s.fvd_out is not None and not s.videomae_weights:
        raise ConfigError(f"fvd_out={show(s.fvd_out)} writes an FVD reference, which needs videomae_weights=<a local "
                          f"VideoMAEModel folder> {how}.")


def check_fdd_keys(s: FidConfig) -> None:
    """fdd (metrics) and fdd_out need DINOv2 weights; calc's fdd needs fdd_ref; bench does not compute fdd."""
    if s.mode == "bench" and "fdd" in s.metrics:
        raise ConfigError(f"metrics={list(s.metrics)}: mode=bench does not compute fdd; allowed here: "
                          f"{[m for m in METRICS if m != 'fdd']}. Score its samples.npz (keep_npz=true) with "
                          f"mode=calc metrics=[fdd] fdd_ref=<FDD reference .npz>.")
    if s.mode == "calc" and "fdd" in s.metrics and s.fdd_ref is None:
        raise ConfigError(f"metrics={list(s.metrics)} asks for fdd, which needs fdd_ref=<an FDD reference .npz> "
                          f"(mode=ref source=<real images> fdd_out=... builds one).")
    if s.mode == "ref" and s.fdd_out is not None and not s.dinov2_weights:
        raise ConfigError(f"fdd_out={show(s.fdd_out)} writes an FDD reference, which needs dinov2_weights=<a local "
                          f"Dinov2Model folder> (nothing is downloaded: save facebook/dinov2-large with "
                          f"transformers' save_pretrained on a machine with network).")


def check_seeds(seeds: Any, name: str = "seeds", num_samples: Optional[int] = None) -> None:
    """A seeds string: comma-separated integers >= 0 and ranges a-b with a <= b (null and lists are typed), naming
    at most MAX_SEEDS seeds; seeds=null stands for num_samples seeds (when given)."""
    if seeds is None and num_samples is not None and num_samples > MAX_SEEDS:
        raise ConfigError(f"num_samples={num_samples} is more than {MAX_SEEDS} images (seeds=null: one seed each); "
                          f"allowed: at most {MAX_SEEDS}. Split the work over several launches (seeds='a-b').")
    if not isinstance(seeds, str):
        return
    parts = [SEED_PART.match(part) for part in seeds.split(",")]
    if not all(parts) or any(p.group(2) is not None and int(p.group(1)) > int(p.group(2)) for p in parts) or \
            any(int(n) >= SAMPLE_SEED_LIMIT for p in parts for n in p.groups() if n is not None):
        raise ConfigError(f"{name}={show(seeds)} is not allowed; allowed: {SEEDS} (ranges a-b with a <= b, "
                          f"every seed below 2**63).")
    count = sum(int(p.group(2)) - int(p.group(1)) + 1 if p.group(2) is not None else 1 for p in parts)
    if count > MAX_SEEDS:
        raise ConfigError(f"{name}={show(seeds)} names {count} seeds; allowed: at most {MAX_SEEDS} seeds (images) "
                          f"in one launch. Split the work over several launches (e.g. {name}='0-{MAX_SEEDS - 1}').")


def check_device(device: str, name: str = "device") -> None:
    """A CUDA device that this machine has (the form was checked by the schema)."""
    have = why_unavailable(device)
    if have:
        count = cuda_count()
        allowed = f"auto, cpu, cuda or cuda:N with N < {count}" if count else "auto or cpu"
        raise ConfigError(f"{name}={device} is not available: this machine has {have}; allowed: {allowed}.")
