"""Text conditioning of the families whose prompt encoding is delegated to their diffusers pipeline.

The pipeline is built with only its text components and its own `encode_prompt` is called, so templates,
system prompts and hidden-state choices are the pipeline's; the results are stored at a fixed length with
a mask where the pipeline computes one (docs/data.md lists each family's arrays).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Sequence, Union

import torch

from tread.encoders.errors import TextEncoderError

Rows = Union[torch.Tensor, Sequence[torch.Tensor]]
# What a CALLS entry returns: (text rows, mask or None[, {other output key: tensor}]).
Encoded = Union[tuple[Rows, Optional[torch.Tensor]], tuple[Rows, Optional[torch.Tensor], dict[str, torch.Tensor]]]


def sana_instruction() -> list[str]:
    """SanaPipeline.__call__'s default complex human instruction (encode_prompt's own default is none)."""
    from diffusers import SanaPipeline

    return list(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)


def _flux2(pipe, prompts: list[str], length: int, device) -> tuple[Rows, Optional[torch.Tensor]]:
    text, _ = pipe.encode_prompt(prompts, device=device, num_images_per_prompt=1, max_sequence_length=length)
    return text, None


def _qwen_image(pipe, prompts: list[str], length: int, device) -> tuple[Rows, Optional[torch.Tensor]]:
    return pipe.encode_prompt(prompts, device=device, num_images_per_prompt=1, max_sequence_length=length)


def _chroma(pipe, prompts: list[str], length: int, device) -> tuple[Rows, Optional[torch.Tensor]]:
    out = pipe.encode_prompt(prompts, device=device, num_images_per_prompt=1, do_classifier_free_guidance=False,
                             max_sequence_length=length)
    return out[0], out[2]


def _sana(pipe, prompts: list[str], length: int, device) -> tuple[Rows, Optional[torch.Tensor]]:
    text, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, num_images_per_prompt=1,
                                          device=device, clean_caption=False, max_sequence_length=length,
                                          complex_human_instruction=sana_instruction())
    return text, mask


def _z_image(pipe, prompts: list[str], length: int, device) -> tuple[Rows, Optional[torch.Tensor]]:
    rows, _ = pipe.encode_prompt(list(prompts), device=device, do_classifier_free_guidance=False,
                                 max_sequence_length=length)  # a copy: the pipeline rewrites the list in place
    return rows, None


def _lumina2(pipe, prompts: list[str], length: int, device) -> tuple[Rows, Optional[torch.Tensor]]:
    text, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, num_images_per_prompt=1,
                                          device=device, max_sequence_length=length)
    return text, mask


def _hidream(pipe, prompts: list[str], length: int, device) -> Encoded:
    t5, _, llama, _, pooled, _ = pipe.encode_prompt(prompts, device=device, num_images_per_prompt=1,
                                                    do_classifier_free_guidance=False, max_sequence_length=length)
    return t5, None, {"pooled": pooled, "llama": llama.transpose(0, 1)}   # (n, B, L, Dl) -> batch first


def _ltx_video(pipe, prompts: list[str], length: int, device) -> tuple[Rows, Optional[torch.Tensor]]:
    text, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, num_videos_per_prompt=1,
                                          device=device, max_sequence_length=length)
    return text, mask


def _hunyuan_video(pipe, prompts: list[str], length: int, device) -> Encoded:
    pipe.tokenizer_max_length = length     # encode_prompt reads it (the pipeline's 1000 by default)
    text, mask, glyph, glyph_mask = pipe.encode_prompt(prompts, device=device, batch_size=len(prompts),
                                                       num_videos_per_prompt=1)
    return text, mask, {"glyph": glyph, "glyph_mask": glyph_mask.bool()}


CALLS: dict[str, Callable[..., Encoded]] = {
    "flux2": _flux2, "qwen_image": _qwen_image, "chroma": _chroma, "sana": _sana, "z_image": _z_image,
    "lumina2": _lumina2, "hidream": _hidream, "ltx_video": _ltx_video, "hunyuan_video": _hunyuan_video}


def _pipeline_extras(pipeline: str) -> dict[str, Any]:
    """What a pipeline's __init__ needs besides its text parts: HunyuanVideo15Pipeline reads vae.config whenever it
    has a vae slot (a tiny AutoencoderKLHunyuanVideo15 stands in: encode_prompt never uses it) and takes a guider."""
    import diffusers

    if pipeline != "HunyuanVideo15Pipeline":
        return {"vae": None}
    vae = diffusers.AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8,) * 5, layers_per_block=1)
    return {"vae": vae, "guider": None}


def build_pipeline(pipeline: str, models: dict[str, Any], tokenizers: dict[str, Any]):
    """The diffusers pipeline class `pipeline` holding only its text encoders and tokenizers, passed by pipeline
    subfolder name ("text_encoder", "tokenizer", "text_encoder_2", ...; no VAE, no transformer)."""
    import diffusers

    cls = getattr(diffusers, pipeline)
    return cls(**models, **tokenizers, transformer=None, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
               **_pipeline_extras(pipeline))


def fixed_length(rows: Rows, mask: Optional[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(text (B, length, D), mask (B, length) bool): a per-sample list of (L_i, D) rows (Z-Image) or a batch
    (B, L, D) with its mask (None: every position is real) zero-padded at the end to `length` positions."""
    if isinstance(rows, torch.Tensor):
        valid = mask.bool() if mask is not None else torch.ones(rows.shape[:2], dtype=torch.bool, device=rows.device)
        rows = list(rows)
        valid = list(valid)
    else:
        valid = [torch.ones(len(r), dtype=torch.bool, device=r.device) for r in rows]
    if any(len(r) > length for r in rows):
        raise TextEncoderError(f"the pipeline returned {max(len(r) for r in rows)} text positions, more than "
                               f"max_length={length}")
    text = torch.stack([torch.nn.functional.pad(r, (0, 0, 0, length - len(r))) for r in rows])
    return text, torch.stack([torch.nn.functional.pad(v, (0, length - len(v))) for v in valid])


def encode_via_pipeline(family: str, spec: Any, models: dict[str, Any], tokenizers: dict[str, Any],
                        prompts: list[str], length: int, device: torch.device, paths: Optional[dict[str, str]] = None
                        ) -> dict[str, torch.Tensor]:
    """Encode `prompts` with `family`'s pipeline's own encode_prompt: {"text", "text_mask"?, "pooled"?, "llama"?} of
    `length` positions. `spec`: the family's FamilySpec; `paths` name the encoders in errors."""
    pipe = build_pipeline(spec.pipeline, {s.model: models[s.model] for s in spec.slots},
                          {s.tokenizer: tokenizers[s.tokenizer] for s in spec.slots})
    try:
        rows, mask, *other = CALLS[family](pipe, list(prompts), length, device)
    except ValueError as err:
        slot, where = spec.slots[0], paths or {}
        raise TextEncoderError(
            f"{family} text encoder '{slot.model}' ({slot.what}) at '{where.get(slot.model, '?')}' with tokenizer "
            f"'{where.get(slot.tokenizer, '?')}': {spec.pipeline}.encode_prompt fails on them ({err}). Use the "
            f"family's own text encoder and tokenizer (with its chat template where the pipeline applies one): "
            f"`hf download {spec.repo} --include 'text_encoder*/*' 'tokenizer*/*' --local-dir DIR`") from None
    extra = other[0] if other else {}
    if not spec.mask:
        return {"text": rows, **extra}
    text, valid = fixed_length(rows, mask, length)
    return {"text": text, "text_mask": valid, **extra}
