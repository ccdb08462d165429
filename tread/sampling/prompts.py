"""Prompts in: a text-conditioned model's conditioning from prompts, encoded by its family's text encoders as its
training data was (sequence length and dtype from the data's meta.json), for sample.py prompts=[...] and the
validation prompts. An empty negative prompt gives what the model learned as unconditional.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch

from tread.encoders.text import TextEncoderError, encode_prompts, load_text_encoders, resolve_text_encoder_paths
from tread.sampling.generate import CondFn, generate
from tread.sampling.guidance import Guidance
from tread.utils.errors import UserError

ENCODER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


CAPTION_DROPOUT_MODES = ("auto", "empty", "zeros")
# The unconditional input of each family's pipeline (train.caption_dropout_mode=auto): the encoded empty prompt "",
# except FLUX.2 (guidance-distilled, its pipeline has no negative prompt: zeros); docs/data.md has the table.
FAMILY_MODES = {"flux": "empty", "sd3": "empty", "wan": "empty", "auraflow": "empty", "pixart": "empty",
                "flux2": "zeros", "qwen_image": "empty", "chroma": "empty", "sana": "empty", "z_image": "empty",
                "lumina2": "empty", "hidream": "empty"}
# pipelines that encode "" as their default negative prompt (negative_prompt or "" in their __call__)
FAMILY_MODES.update({f: "empty" for f in ("ltx_video", "ltx2", "krea2", "ernie_image", "wan_vace")})


def resolve_mode(mode: str, family: Optional[str]) -> str:
    """"empty" or "zeros": `mode`, or for "auto" the family's (FAMILY_MODES)."""
    if mode != "auto":
        return mode
    if family not in FAMILY_MODES:
        raise PromptError(f"train.caption_dropout_mode=auto needs a text-conditioned model.family (one of "
                          f"{list(FAMILY_MODES)}), got {family!r}; allowed: empty or zeros.")
    return FAMILY_MODES[family]


def learned_unconditional(caption_dropout: float, mode: str, family: Optional[str]) -> str:
    """What a run learned as the unconditional input (train.caption_dropout, train.caption_dropout_mode,
    model.family): "empty" (the encoded "") with caption dropout to the empty prompt, else "zeros" (label
    dropout's null text)."""
    if caption_dropout <= 0:
        return "zeros"
    return resolve_mode(mode, family)


class PromptError(UserError):
    """Prompts that cannot be used: none given, an unreadable prompts file, or a model that takes no text."""


def read_prompts_file(path: Any, key: str = "prompts_file") -> list[str]:
    """One prompt per line of a UTF-8 text file; empty (whitespace-only) lines are skipped."""
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise PromptError(f"{key}='{path}' does not exist (or is not a file); allowed: a UTF-8 text file with one "
                          f"prompt per line.")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise PromptError(f"{key}='{path}' is not UTF-8 text ({err}); allowed: a UTF-8 text file with one prompt "
                          f"per line.") from None
    prompts = [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise PromptError(f"{key}='{path}' holds no prompts (only empty lines); allowed: a UTF-8 text file with one "
                          f"prompt per line.")
    return prompts


def check_prompts(prompts: Sequence[Any], key: str = "prompts") -> list[str]:
    """A non-empty list of non-empty strings."""
    prompts = list(prompts)
    if not prompts:
        raise PromptError(f"{key}=[] is empty; allowed: a non-empty list of prompts.")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptError(f"{key}[{i}]={prompt!r} is not allowed; allowed: a non-empty string.")
    return prompts


def check_text_model(model: Any, meta: Mapping[str, Any], what: str = "prompts") -> str:
    """The family of a model that prompts can condition: a diffusers family trained on text embeddings."""
    if not model.text_conditioned:
        raise PromptError(f"{what} need a text-conditioned model (a diffusers family trained on text embeddings), "
                          f"but this is the class-conditional {type(model).__name__} model, sampled by "
                          f"class only.")
    if not (meta.get("conditioning") or {}).get("text"):
        raise PromptError(f"{what} need a model trained on text embeddings, but this {model.family} model was "
                          f"trained on class-conditional data (no text embeddings): train it on text data "
                          f"(data=toy_text, or latents precomputed with captions) to condition it on prompts.")
    if model.kontext:
        raise PromptError(f"{what} are not supported for a FLUX Kontext model (model.kontext=true): each image also "
                          f"needs a reference image, which prompts do not give; sample it without prompts (seed i "
                          f"takes the text and reference of training item i mod N).")
    return str(model.family)


@dataclass
class PromptEmbeddings:
    """Encoded prompts: `cond` holds one row per prompt ({"text", "text_mask", "pooled", "llama", "glyph"} as the family
    has them), `negative` one row for CFG's unconditional branch (None: the null label)."""
    prompts: list[str]
    cond: dict[str, torch.Tensor]
    negative: Optional[dict[str, torch.Tensor]] = None

    def cond_fn(self, index: int) -> CondFn:
        """Every seed gets prompt `index`."""
        row = {k: v[index:index + 1] for k, v in self.cond.items()}
        return lambda seeds: {k: v.expand(len(seeds), *v.shape[1:]) for k, v in row.items()}

    def uncond_fn(self) -> Optional[CondFn]:
        """Every seed gets the negative prompt; None when there is none (the null label)."""
        if self.negative is None:
            return None
        negative = self.negative
        return lambda seeds: {k: v.expand(len(seeds), *v.shape[1:]) for k, v in negative.items()}


def encode_for_model(model: Any, meta: Mapping[str, Any], prompts: Sequence[str], negative_prompt: str,
                     text_encoders: Optional[str], *, key: str, device: Any = "cpu",
                     what: str = "prompts", unconditional: str = "zeros") -> PromptEmbeddings:
    """Encode `prompts` (and a non-empty `negative_prompt`) for `model` with the encoders at `text_encoders`, at the
    training data's sequence length and dtype; the encoders are freed before returning. unconditional="empty":
    an empty negative prompt is encoded as "" too. `key` / `what` name the settings in messages."""
    family = check_text_model(model, meta, what)
    prompts = check_prompts(prompts)
    if not text_encoders:
        try:
            resolve_text_encoder_paths(family, {})     # raises the advice: how to get the encoders
        except TextEncoderError as err:
            raise PromptError(f"{key} is not set, but prompts are encoded with the model's own text encoders "
                              f"({family}): set {key}=DIR. {err}") from None
    text_meta = meta["conditioning"]["text"]
    dtype = ENCODER_DTYPES.get(str(text_meta.get("encoder_dtype")), torch.float32)
    # SD3 without T5 (model.use_t5=false, or data precomputed with --no-t5): T5 is neither needed nor loaded.
    no_t5 = family == "sd3" and (text_meta.get("t5") is False or model.use_t5 is False)
    try:
        encoders = load_text_encoders(family, str(text_encoders), device=device, dtype=dtype, t5=not no_t5)
        negative = bool(negative_prompt) or unconditional == "empty"
        texts = list(prompts) + ([negative_prompt] if negative else [])
        arrays = encode_prompts(family, encoders, texts, max_length=text_meta.get("max_length"), device=device,
                                dtype=dtype)
    except TextEncoderError as err:
        raise PromptError(f"{key}='{text_encoders}': {err}") from None
    del encoders          # the encoders can be large (T5-XXL): freed before any sampling
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items() if k in _trained_keys(meta)}
    check_widths(model, tensors, f"{key}='{text_encoders}'")
    n = len(prompts)
    return PromptEmbeddings(list(prompts), {k: v[:n] for k, v in tensors.items()},
                            {k: v[n:] for k, v in tensors.items()} if negative else None)


def _trained_keys(meta: Mapping[str, Any]) -> tuple[str, ...]:
    """The encode_prompts keys the model saw in training: HiDream's Llama states and HunyuanVideo 1.5's glyph
    embeddings only where its data stored them (llama_embeds.npy, glyph_embeds.npy); a model trained without them
    has only seen zeros there."""
    cond = meta.get("conditioning") or {}
    return ("text", "text_mask", "pooled") + (("llama",) if cond.get("llama") else ()) + \
        (("glyph", "glyph_mask") if cond.get("glyph") else ())


def check_widths(model: Any, tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """The encoders' embedding widths against the transformer's text widths."""
    def width(name: str) -> Optional[int]:
        return tensors[name].shape[-1] if name in tensors else None

    for name, have, want, config_key in (("text", width("text"), model.text_dim, model.text_dim_key),
                                         ("pooled", width("pooled"), model.pooled_dim, model.pooled_dim_key),
                                         ("Llama", width("llama"), model.llama_dim,
                                          "caption_channels[1]")):
        if have is not None and want and int(have) != int(want):
            raise PromptError(f"{where} gives {have}-wide {name} embeddings, but the model takes {want} "
                              f"(model.config.{config_key}, {model.family}): use the text encoders its training "
                              f"data was encoded with.")


def generate_for_prompts(net: Any, diffusion: Any, embeddings: PromptEmbeddings, seeds: Sequence[int],
                         shape: Sequence[int], num_classes: int, device: torch.device, *, batch_size: int,
                         num_steps: Optional[int] = None, guidance: Optional[Guidance] = None,
                         stats: Optional[dict] = None) -> Iterator[tuple[int, list[int], torch.Tensor]]:
    """Yield (prompt index, seeds, latents) batches: every prompt with every seed (prompt-major), each sample
    with its own generators as in `generate`, so an image depends on its prompt and seed only."""
    for index in range(len(embeddings.prompts)):
        for batch, _, x in generate(net, diffusion, seeds, shape, num_classes, device, batch_size=batch_size,
                                    num_steps=num_steps, cond_fn=embeddings.cond_fn(index), guidance=guidance,
                                    stats=stats, uncond_fn=embeddings.uncond_fn()):
            yield index, batch, x
