"""Settings shared by everything that samples (sample.py, fid.py mode=bench, in-training evaluation): the
sampler steps and guidance (CFG, inference routing, TREAD guidance, interval), how latents become
pixels, and which metrics to compute. configs/sampling/default.yaml and configs/decode/default.yaml hold
their defaults; sample.yaml, fid.yaml and eval/*.yaml include them."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from annotated_types import Len
from pydantic import Field

from tread.encoders.features import FEATURE_NAMES
from tread.encoders.vae import VAE_DTYPES
from tread.schema.metric_names import METRICS
from tread.schema.base import ConfigError, Number, Section, check, key, one_of

# Prompts in (sample.py prompts, eval.validation_prompts): tread/sampling/prompts.py encodes them.
Prompt = Annotated[str, Field(pattern=r"\S")]
PROMPTS = "a non-empty list of prompts (non-empty strings)"
NEGATIVE_PROMPT = ("a string: CFG's unconditional branch gets its text embeddings; empty: the null label's zero "
                   "text embeddings, as in training label dropout")
TEXT_ENCODERS = "a local diffusers pipeline folder with the family's text_encoder*/ and tokenizer*/ subfolders"


class SamplingSettings(Section):
    """the sampler's steps and guidance"""

    num_steps: Optional[int] = key("null (the checkpoint's diffusion.num_steps) or an integer >= 1", ge=1)
    cfg_scale: Number = key("a number >= 0 (classifier-free guidance scale; 1 = none)", ge=0)
    selection_ratio: Optional[Number] = key("null (dense sampling) or the main branch's selection ratio in [0, 1) "
                                            "(the fraction of tokens dropped, as routing.routes[i].selection_ratio)",
                                            ge=0, lt=1)
    route_spans: Optional[list[Annotated[list[int], Len(2, 2)]]] = key(
        "null (the checkpoint's route spans) or a non-empty list of [start, end] block indices", min_length=1)
    tread_scale: Number = key("a number (TREAD guidance weight; 1 = none)")
    tread_weak_selection_ratio: Number = key("a selection ratio in (0, 1) for the weak TREAD-guidance branch",
                                             gt=0, lt=1)
    guidance_interval: Optional[list[Number]] = key(
        "null or [lo, hi], two noise levels (EDM sigma, rectified-flow t) with 0 <= lo < hi", min_length=2, max_length=2)
    path_drop: bool = key("true or false (SPRINT models, model=sprint: CFG's unconditional branch skips the deep "
                          "span, path-drop guidance)", default=False)
    cfg_rule: Literal["any", "above_one"] = key("any (CFG for every cfg_scale != 1) or above_one (the paper code: "
                                                "only scales > 1, and 0 = unconditional)", default="any")
    tread_uncond: bool = key("true or false (the paper code's TREAD guidance: both routed branches with the null "
                             "label; needs cfg_scale=1)", default=False)
    class_labels: Literal["cycle", "random"] = key("cycle (seed i gets class i mod K) or random (each seed's class "
                                                   "drawn from its own generator after its noise, as the paper "
                                                   "code)", default="cycle")


class DecodeSettings(Section):
    """how latents become pixels"""

    vae: Optional[str] = key("null (the data's meta.json VAE) or a local VAE directory")
    vae_dtype: Literal[tuple(VAE_DTYPES)] = key(one_of(VAE_DTYPES))
    decode_batch_size: int = key("a positive integer (latents per VAE decode call)", ge=1)
    decode_rule: Literal["ours", "paper"] = key("ours (vae_dtype, rounded to uint8) or paper (the paper code: VAE in "
                                                "bf16 under autocast, truncated to uint8)", default="ours")


class MetricSettings(Section):
    """feature network and metrics"""

    features: Literal[FEATURE_NAMES] = key(one_of(FEATURE_NAMES))
    inception_weights: Optional[str] = key("null or a local Inception weights file (torch-fidelity format)")
    metrics: list[Literal[METRICS]] = key(f"a non-empty list of {one_of(METRICS)}", min_length=1)
    dinov2_weights: Optional[str] = key("null or a local transformers Dinov2Model folder (the fdd metric; e.g. "
                                        "facebook/dinov2-large saved with save_pretrained)", default=None)
    videomae_weights: Optional[str] = key("null or a local transformers VideoMAEModel folder (the fvd metric; e.g. "
                                          "MCG-NJU/videomae-base saved with save_pretrained)", default=None)


def check_guidance(s: SamplingSettings, prefix: str) -> None:
    """The rules between guidance keys (each key's own range is in SamplingSettings)."""
    if s.tread_scale != 1.0 and s.tread_weak_selection_ratio <= (s.selection_ratio or 0.0):
        raise ConfigError(f"{prefix}tread_weak_selection_ratio={s.tread_weak_selection_ratio} must be above the main "
                          f"branch's ratio ({prefix}selection_ratio={s.selection_ratio}): the weak branch drops more "
                          f"tokens.")
    if s.guidance_interval is not None and not 0.0 <= s.guidance_interval[0] < s.guidance_interval[1]:
        raise ConfigError(f"{prefix}guidance_interval={list(s.guidance_interval)} is not allowed; allowed: "
                          f"[lo, hi] with 0 <= lo < hi.")
    if s.tread_uncond and s.cfg_scale != 1.0:
        raise ConfigError(f"{prefix}tread_uncond=true (the paper code's unconditional TREAD guidance) replaces "
                          f"classifier-free guidance; allowed with it: {prefix}cfg_scale=1 (got {s.cfg_scale}); set "
                          f"the guidance weight with {prefix}tread_scale.")
    if s.path_drop and s.cfg_scale == 1.0:
        raise ConfigError(f"{prefix}path_drop=true needs classifier-free guidance ({prefix}cfg_scale != 1, got "
                          f"{s.cfg_scale}): path drop replaces CFG's unconditional branch.")
    if isinstance(s, MetricSettings) and "fdd" in s.metrics and not s.dinov2_weights:
        raise ConfigError(f"{prefix}metrics={list(s.metrics)} asks for fdd (Fréchet distance on DINOv2 features), "
                          f"which needs {prefix}dinov2_weights=<a local Dinov2Model folder> (nothing is downloaded: "
                          f"save facebook/dinov2-large with transformers' save_pretrained on a machine with network).")
    if isinstance(s, MetricSettings) and "fvd" in s.metrics and not s.videomae_weights:
        raise ConfigError(f"{prefix}metrics={list(s.metrics)} asks for fvd (Fréchet distance on VideoMAE clip "
                          f"features), which needs {prefix}videomae_weights=<a local VideoMAEModel folder> (nothing is "
                          f"downloaded: save MCG-NJU/videomae-base with transformers' save_pretrained on a machine "
                          f"with network).")
    if isinstance(s, MetricSettings) and len(set(s.metrics)) != len(s.metrics):
        raise ConfigError(f"{prefix}metrics={list(s.metrics)} repeats a metric; allowed: each of {list(METRICS)} once.")


def check_sampling(values: dict, prefix: str = "") -> SamplingSettings:
    """The sampling keys alone (a library caller's settings), with the rules between them."""
    settings = check(SamplingSettings, values, prefix.rstrip("."))
    check_guidance(settings, prefix)
    return settings
