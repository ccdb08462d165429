"""Text conditioning: load a family's text encoders from local folders and encode prompts as that family's
diffusers pipeline does, into the arrays a latent dataset stores (text_embeds, text_mask, pooled, llama).

FLUX, SD3, Wan, AuraFlow and PixArt are encoded here; the newer families through their pipeline's own
encode_prompt (text_pipelines.py). Weights are never downloaded. docs/data.md lists each family's arrays.
"""
from __future__ import annotations

import html
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from tread.encoders.errors import TextEncoderError
from tread.encoders.text_families import (CLIP_DEFAULT_LENGTH, FAMILIES, MODEL_TYPES, PIXART_SIGMA_LENGTH,
                                         SD3_T5_WIDTH, TOKENIZER_FILES, EncoderSlot, PathLike, encoder_keys,
                                         family_slots, family_spec)
from tread.encoders.text_pipelines import encode_via_pipeline
from tread.utils.readers import FileFormatError, read_json

@dataclass
class TextEncoders:
    """A family's loaded encoders: models and tokenizers by pipeline subfolder name, where they came from, and the
    default sequence length for these weights (None: the family's)."""
    family: str
    models: dict[str, Any]
    tokenizers: dict[str, Any]
    paths: dict[str, str] = field(default_factory=dict)
    max_length: Optional[int] = None
    t5: bool = True                   # False: SD3 loaded without T5 (its part of the embeddings is zeros)
    t5_width: Optional[int] = None    # without T5: the width of those zeros (None: SD3_T5_WIDTH)


# ----------------------------------------------------------------------------- locating and loading

def _advice(family: str, slot: EncoderSlot, whole: bool = False) -> str:
    """How to provide `slot`'s files; whole: the family's folder (encoders from other repos are named too)."""
    spec = FAMILIES[family]
    fetch = (f"Fetch them with `hf download {spec.repo} --include 'text_encoder*/*' 'tokenizer*/*' --local-dir DIR` "
             f"and pass DIR (a diffusers pipeline folder; --text-encoders DIR)")
    if slot.download and not whole:   # not in the family's repo
        fetch = f"{slot.model} ({slot.what}): {slot.download} Pass DIR (--text-encoders DIR)"
    notes = "".join(f" {s.model} ({s.what}): {s.download}" for s in spec.slots if s.download and whole)
    return (f"Text encoders are read from local folders only (nothing is downloaded). {fetch}, or give this "
            f"encoder's own folder ({slot.model}=PATH, and {slot.tokenizer}=PATH if its tokenizer lives elsewhere)."
            f"{notes}")


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in TOKENIZER_FILES)


def resolve_text_encoder_paths(family: str, paths: Union[PathLike, Mapping[str, PathLike]], *,
                               t5: bool = True) -> dict[str, Path]:
    """{model or tokenizer subfolder name: local folder} for every encoder of `family`, without loading anything.

    `paths` is a diffusers pipeline folder, or a dict with "pipeline" and/or explicit folders per key
    (encoder_keys(family)). Missing files raise TextEncoderError naming the family, encoder, path and how to get
    them. t5=False (sd3): T5's folders are not looked for.
    """
    spec = family_spec(family)
    slots = family_slots(family, t5)
    given = {"pipeline": paths} if isinstance(paths, (str, os.PathLike)) else dict(paths or {})
    unknown = sorted(set(given) - set(encoder_keys(family)))
    if unknown:
        raise TextEncoderError(f"{family} text encoder paths have unknown key(s) {unknown}; allowed: "
                               f"{list(encoder_keys(family))}")
    unused = sorted(k for s in set(spec.slots) - set(slots) for k in (s.model, s.tokenizer) if given.get(k))
    if unused:
        raise TextEncoderError(f"{family} text encoder paths {unused} are given with t5=False (no T5); allowed: "
                               f"leave them out, or encode with T5.")
    given = {k: Path(v).expanduser().absolute() for k, v in given.items() if v is not None and str(v)}
    pipe = given.get("pipeline")
    if pipe is not None and not pipe.is_dir():
        slot = spec.slots[0]
        raise TextEncoderError(f"{family} text encoders: the pipeline folder '{pipe}' does not exist. "
                               f"{_advice(family, slot, whole=True)}")
    out: dict[str, Path] = {}
    for slot in slots:
        explicit, own_pipe = given.get(slot.model), None
        if explicit is not None and not (explicit / "config.json").is_file() and \
                (explicit / slot.model / "config.json").is_file():
            own_pipe, explicit = explicit, explicit / slot.model  # a pipeline-like folder given for this encoder
        model = explicit if explicit is not None else (pipe / slot.model if pipe is not None else None)
        if model is None:
            raise TextEncoderError(f"{family} text encoder '{slot.model}' ({slot.what}): no path given (neither a "
                                   f"pipeline folder nor {slot.model}=PATH). {_advice(family, slot)}")
        if not (model / "config.json").is_file():
            why = "no such folder" if not model.exists() else "no config.json there"
            raise TextEncoderError(f"{family} text encoder '{slot.model}' ({slot.what}): no model at '{model}' "
                                   f"({why}). {_advice(family, slot)}")
        candidates = [given[slot.tokenizer]] if slot.tokenizer in given else \
            [c / slot.tokenizer for c in (own_pipe, pipe) if c is not None] + [model]
        tokenizer = next((c for c in candidates if _has_tokenizer(c)), None)
        if tokenizer is None:
            tried = " or ".join(f"'{c}'" for c in candidates)
            raise TextEncoderError(f"{family} tokenizer '{slot.tokenizer}' of text encoder '{slot.model}' "
                                   f"({slot.what}): no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {tried}. "
                                   f"{_advice(family, slot)}")
        out[slot.model], out[slot.tokenizer] = model, tokenizer
    return out


def _model_class(family: str, slot: EncoderSlot, folder: Path):
    import transformers

    if slot.kind == "clip":
        return transformers.CLIPTextModel
    if slot.kind == "clip_proj":
        return transformers.CLIPTextModelWithProjection
    try:
        config = read_json(folder / "config.json", f"{family} text encoder '{slot.model}' config",
                           "a transformers config (JSON object)", TextEncoderError)
    except FileNotFoundError as err:
        raise TextEncoderError(f"{family} text encoder '{slot.model}': cannot read '{folder / 'config.json'}' "
                               f"({err.strerror})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    classes = MODEL_TYPES[slot.kind]
    if model_type not in classes:
        allowed = " or ".join(repr(t) for t in classes)
        raise TextEncoderError(f"{family} text encoder '{slot.model}' at '{folder}' is a {model_type!r} model; "
                               f"expected {slot.what} (config.json model_type {allowed})")
    return getattr(transformers, classes[model_type])


def _load_tokenizer(family: str, slot: EncoderSlot, folder: Path):
    """The slot's tokenizer (AutoTokenizer), or its processor (AutoProcessor) where the pipeline takes one."""
    from transformers import AutoProcessor, AutoTokenizer

    try:
        return (AutoProcessor if slot.processor else AutoTokenizer).from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        raise TextEncoderError(f"{family} tokenizer '{slot.tokenizer}': cannot load it from '{folder}' "
                               f"({err}). {_advice(family, slot)}") from None


def load_text_encoders(family: str, paths: Union[PathLike, Mapping[str, PathLike]], device: Any = "cpu",
                       dtype: torch.dtype = torch.float32, *, t5: bool = True) -> TextEncoders:
    """Load `family`'s text encoders and tokenizers (the classes its pipeline uses) from local folders
    (resolve_text_encoder_paths) on `device` in `dtype`, in eval mode without gradients. Never downloads:
    missing files raise TextEncoderError. t5=False (sd3 only): T5 is not loaded; its part will be zeros."""
    spec = family_spec(family)
    found = resolve_text_encoder_paths(family, paths, t5=t5)
    models, tokenizers = {}, {}
    for slot in family_slots(family, t5):
        folder, tok_folder = found[slot.model], found[slot.tokenizer]
        cls = _model_class(family, slot, folder)
        try:
            model = cls.from_pretrained(folder, dtype=dtype, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as err:
            raise TextEncoderError(f"{family} text encoder '{slot.model}' ({slot.what}): cannot load it from "
                                   f"'{folder}' ({err}). {_advice(family, slot)}") from None
        models[slot.model] = model.to(device).eval().requires_grad_(False)
        tokenizers[slot.tokenizer] = _load_tokenizer(family, slot, tok_folder)
    length = default_max_length(family, paths)
    return TextEncoders(family, models, tokenizers, {k: str(v) for k, v in found.items()},
                        None if length == spec.max_length else length, t5=t5,
                        t5_width=None if t5 else sd3_t5_width(paths))


def sd3_t5_width(paths: Union[PathLike, Mapping[str, PathLike], None]) -> Optional[int]:
    """The width of SD3's zeros in place of T5 (the transformer's joint_attention_dim), read from the pipeline
    folder's config files only; None when they do not say (encode_prompts then uses SD3_T5_WIDTH)."""
    pipe = paths if isinstance(paths, (str, os.PathLike)) else (paths or {}).get("pipeline")
    if not pipe:
        return None
    for sub, name in (("transformer", "joint_attention_dim"), ("text_encoder_3", "d_model")):
        try:
            value = read_json(Path(pipe).expanduser() / sub / "config.json", "config").get(name)
        except (OSError, FileFormatError, AttributeError):
            continue
        if isinstance(value, int) and value > 0:
            return value
    return None


def default_max_length(family: str, paths: Union[PathLike, Mapping[str, PathLike], None] = None) -> int:
    """The sequence length `family`'s pipeline uses by default (FAMILIES[family].max_length); for PixArt, 300
    when the pipeline folder's model_index.json names a PixArt-Sigma pipeline (120 for Alpha)."""
    spec = family_spec(family)
    if family != "pixart" or not paths:
        return spec.max_length
    pipe = paths if isinstance(paths, (str, os.PathLike)) else paths.get("pipeline")
    index = Path(pipe).expanduser() / "model_index.json" if pipe else None
    try:
        if index is not None and "Sigma" in str(read_json(index, "model index").get("_class_name", "")):
            return PIXART_SIGMA_LENGTH
    except (OSError, FileFormatError, AttributeError):
        pass
    return spec.max_length


# ----------------------------------------------------------------------------- encoding

def _wan_clean(text: str) -> str:
    """Wan's prompt cleaning: fix mojibake (ftfy, if installed), undo (double) HTML escaping, collapse
    whitespace."""
    try:
        import ftfy
        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def _tokenize(tokenizer, prompts: list[str], length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    out = tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    return out["input_ids"].to(device), out["attention_mask"].to(device)


def _clip_length(tokenizer, model) -> int:
    """The CLIP pipelines' sequence length: the tokenizer's model_max_length (77), within the model's positions."""
    length = getattr(tokenizer, "model_max_length", None)
    if not isinstance(length, int) or length <= 0 or length > 100_000:  # unset: transformers' huge sentinel
        length = CLIP_DEFAULT_LENGTH
    return min(length, int(model.config.max_position_embeddings))


def _as_encoders(family: str, encoders: Union[TextEncoders, Mapping[str, Any]], t5: Optional[bool]
                 ) -> tuple[TextEncoders, bool]:
    """(the encoders as TextEncoders, whether T5 runs): t5 None follows the encoders (loaded with or without
    T5; a dict: with); t5=True with encoders loaded without T5 is an error."""
    if isinstance(encoders, TextEncoders):
        if encoders.family != family:
            raise TextEncoderError(f"encoders were loaded for family {encoders.family!r}, not {family!r}")
        enc = encoders
    elif isinstance(encoders, Mapping):
        spec = family_spec(family)
        models = {s.model: encoders[s.model] for s in spec.slots if s.model in encoders}
        toks = {s.tokenizer: encoders[s.tokenizer] for s in spec.slots if s.tokenizer in encoders}
        enc = TextEncoders(family, models, toks)
    else:
        raise TextEncoderError(f"encoders must be a TextEncoders (load_text_encoders) or a dict of models and "
                               f"tokenizers by pipeline subfolder name, got {type(encoders).__name__}")
    use_t5 = enc.t5 if t5 is None else bool(t5)
    if use_t5 and not enc.t5:
        raise TextEncoderError(f"t5=True, but these {family} encoders were loaded without T5 "
                               f"(load_text_encoders(..., t5=False)); allowed: t5=False or None with them.")
    missing = [k for s in family_slots(family, use_t5) for k, d in ((s.model, enc.models),
                                                                    (s.tokenizer, enc.tokenizers)) if k not in d]
    if missing:
        raise TextEncoderError(f"{family} text encoding needs {missing} (model / tokenizer by pipeline subfolder "
                               f"name); got {sorted(enc.models) + sorted(enc.tokenizers)}")
    return enc, use_t5


def _placed(enc: TextEncoders, slots: Sequence[EncoderSlot], device: torch.device, dtype: Optional[torch.dtype]
            ) -> dict[str, Any]:
    """The slots' models on `device` in `dtype` (None: theirs), moved only where they are elsewhere."""
    models = {}
    for key, model in enc.models.items():
        if key not in {s.model for s in slots}:
            continue
        if model.device != device:
            model = model.to(device)
        if dtype is not None and model.dtype != dtype:  # only then: a cast would undo T5's fp32-kept layers
            model = model.to(dtype=dtype)
        models[key] = model
    return models


def encode_prompts(family: str, encoders: Union[TextEncoders, Mapping[str, Any]], prompts: Union[str, Sequence[str]],
                   *, max_length: Optional[int] = None, device: Any = "cpu",
                   dtype: Optional[torch.dtype] = torch.float32, t5: Optional[bool] = None) -> dict[str, np.ndarray]:
    """Encode `prompts` as `family`'s pipeline does: numpy {"text": (B, L, D), "text_mask": (B, L) bool,
    "pooled": (B, P), "llama": (B, n_layers, L, Dl)}, each as the family has it.

    `encoders`: load_text_encoders' result or a dict {subfolder name: model or tokenizer}; max_length: L
    (default: the family's); models run on `device` in `dtype` (moved in place if elsewhere). t5 (sd3): False
    encodes without T5 (zeros); None follows how the encoders were loaded.
    """
    spec = family_spec(family)
    enc, use_t5 = _as_encoders(family, encoders, t5)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    bad = [p for p in prompts if not isinstance(p, str)]
    if not prompts or bad:
        raise TextEncoderError(f"prompts must be a non-empty list of strings, got "
                               f"{'an empty list' if not prompts else f'{type(bad[0]).__name__} {bad[0]!r}'}")
    length = max_length if max_length is not None else (enc.max_length or spec.max_length)
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise TextEncoderError(f"max_length={length!r} must be a positive integer (tokens)")
    device = torch.device(device)
    models = _placed(enc, family_slots(family, use_t5), device, dtype)
    with torch.inference_mode():
        if spec.via_pipeline:
            out = encode_via_pipeline(family, spec, models, enc.tokenizers, prompts, length, device, enc.paths)
        elif family == "flux":
            out = _encode_flux(models, enc.tokenizers, prompts, length, device)
        elif family == "sd3":
            out = _encode_sd3(models, enc.tokenizers, prompts, length, device, _zeros_width(enc, use_t5))
        else:  # one T5-type encoder that sees the attention mask: wan, auraflow, pixart, cosmos
            out = _encode_masked_t5(family, models, enc.tokenizers, prompts, length, device)
    arrays = {k: v.detach().cpu().numpy() if v.dtype == torch.bool else v.detach().float().cpu().numpy()
              for k, v in out.items()}
    return {k: arrays[k] for k in ("text", "text_mask", "pooled", "llama", "glyph", "glyph_mask") if k in arrays}


def _encode_flux(models: dict, tok: dict, prompts: list[str], length: int, device: torch.device
                 ) -> dict[str, torch.Tensor]:
    """FLUX: the CLIP pooler output and the T5 last hidden state."""
    out: dict[str, torch.Tensor] = {}
    clip, t5 = models["text_encoder"], models["text_encoder_2"]
    ids, _ = _tokenize(tok["tokenizer"], prompts, _clip_length(tok["tokenizer"], clip), device)
    out["pooled"] = clip(ids, output_hidden_states=False).pooler_output
    ids, _ = _tokenize(tok["tokenizer_2"], prompts, length, device)
    out["text"] = t5(ids)[0]  # FLUX passes no attention mask to T5
    return out


def _zeros_width(enc: TextEncoders, use_t5: bool) -> Optional[int]:
    """SD3 without T5: the width of the zeros standing in for T5 (None: T5 runs)."""
    if use_t5:
        return None
    t5 = enc.models.get("text_encoder_3")
    return enc.t5_width or (int(t5.config.d_model) if t5 is not None else SD3_T5_WIDTH)


def _encode_sd3(models: dict, tok: dict, prompts: list[str], length: int, device: torch.device,
                zeros_width: Optional[int] = None) -> dict[str, torch.Tensor]:
    """SD3: both CLIPs' penultimate hidden states (zero-padded to the T5 width) before the T5 output, and both
    CLIPs' projections as the pooled embedding. zeros_width: no T5; its output is zeros (B, length, width)."""
    out: dict[str, torch.Tensor] = {}
    hidden, pooled = [], []
    for model_key, tok_key in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
        model = models[model_key]
        ids, _ = _tokenize(tok[tok_key], prompts, _clip_length(tok[tok_key], model), device)
        result = model(ids, output_hidden_states=True)
        hidden.append(result.hidden_states[-2].float())  # penultimate layer (clip_skip=None)
        pooled.append(result.text_embeds.float())
    if hidden[0].shape[1] != hidden[1].shape[1]:
        raise TextEncoderError(f"sd3: the CLIP tokenizers give {hidden[0].shape[1]} and {hidden[1].shape[1]} "
                               f"tokens; both must use the same length (77)")
    if zeros_width is not None:   # StableDiffusion3Pipeline with text_encoder_3=None
        t5 = torch.zeros((len(prompts), length, zeros_width), device=device)
    else:
        ids, _ = _tokenize(tok["tokenizer_3"], prompts, length, device)
        t5 = models["text_encoder_3"](ids)[0].float()  # no attention mask, as the SD3 pipeline
    clip = torch.cat(hidden, dim=-1)
    if clip.shape[-1] > t5.shape[-1]:
        raise TextEncoderError(f"sd3: the CLIP hidden states are {clip.shape[-1]} wide together, more than "
                               f"the T5 width {t5.shape[-1]} they are zero-padded to")
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    out["text"] = torch.cat([clip, t5], dim=1)
    out["pooled"] = torch.cat(pooled, dim=-1)
    return out


def _encode_masked_t5(family: str, models: dict, tok: dict, prompts: list[str], length: int, device: torch.device
                      ) -> dict[str, torch.Tensor]:
    """wan, auraflow, pixart, cosmos: one T5-type encoder that sees the attention mask; the mask is returned too."""
    if family == "wan":
        prompts = [_wan_clean(p) for p in prompts]
    ids, mask = _tokenize(tok["tokenizer"], prompts, length, device)
    hidden = models["text_encoder"](input_ids=ids, attention_mask=mask)[0]
    if family in ("wan", "auraflow", "cosmos"):  # padding positions zeroed (Wan keeps the first seq_len rows)
        hidden = hidden * mask[..., None].to(hidden.dtype)
    return {"text": hidden, "text_mask": mask.bool()}
