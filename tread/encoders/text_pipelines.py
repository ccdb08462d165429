"""Text conditioning of the families whose prompt encoding is delegated to their diffusers pipeline.

The pipeline is built with only its text components and its own `encode_prompt` is called, so templates,
system prompts and hidden-state choices are the pipeline's; the results are stored at a fixed length with
a mask where the pipeline computes one (docs/data.md lists each family's arrays).
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace
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


def _qwen_image21(pipe, prompts: list[str], length: int, device) -> tuple[Rows, Optional[torch.Tensor]]:
    text, mask, _ = pipe.encode_prompt(prompts, device=device, num_images_per_prompt=1)   # mask None: no padding
    return text, mask


def _kandinsky5(pipe, prompts: list[str], length: int, device) -> Encoded:
    text, pooled, cu_seqlens = pipe.encode_prompt(prompts, num_videos_per_prompt=1, max_sequence_length=length,
                                                  device=device)
    mask = torch.arange(text.shape[1], device=text.device)[None, :] < cu_seqlens.diff().to(text.device)[:, None]
    return text, mask, {"pooled": pooled}   # right padding: each prompt's real rows first


def _ltx2(pipe, prompts: list[str], length: int, device) -> tuple[Rows, Optional[torch.Tensor]]:
    """LTX2Pipeline.encode_prompt: the stacked Gemma-3 hidden states, left-padded to `length` (the connectors run
    in the model)."""
    text, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, num_videos_per_prompt=1,
                                          device=device, max_sequence_length=length)
    return text, mask


def _krea2(pipe, prompts: list[str], length: int, device) -> tuple[Rows, Optional[torch.Tensor]]:
    text, mask = pipe.encode_prompt(prompts, device=device, num_images_per_prompt=1, max_sequence_length=length)
    return text.flatten(2), mask   # (B, L, layers, D) -> (B, L, layers x D): tread/models/families/krea2.py unflattens


def _ernie_image(pipe, prompts: list[str], length: int, device) -> tuple[Rows, Optional[torch.Tensor]]:
    """One (T_i, D) row block per prompt; the pipeline's tokenizer truncates at its model_max_length, set to the
    stored length for the call (encode_prompt takes no max_sequence_length)."""
    tokenizer = pipe.tokenizer
    saved = tokenizer.model_max_length
    tokenizer.model_max_length = min(saved, length)
    try:
        return pipe.encode_prompt(list(prompts), device=device, num_images_per_prompt=1), None
    finally:
        tokenizer.model_max_length = saved


def _minimax_h3(pipe, prompts: list[str], length: int, device) -> tuple[Rows, Optional[torch.Tensor]]:
    """MiniMaxH3ModularPipeline's own t2va text step (its text_encoder block picks MiniMaxH3TextEncoderStep for a
    prompt alone: the prompt verbatim, no template, Qwen3-VL hidden_states[50]), one prompt per call as the pipeline
    takes it; the slot's processor brings the tokenizer."""
    from diffusers.modular_pipelines import PipelineState   # deferred: diffusers is optional

    pipe.update_components(tokenizer=pipe.processor.tokenizer)
    rows = []
    for prompt in prompts:
        state = PipelineState()
        state.set("prompt", prompt)
        _, state = pipe.blocks.sub_blocks["text_encoder"](pipe, state)
        rows.append(state.get("prompt_embeds")[0])
    return rows, None


def _flux3(pipe, prompts: list[str], length: int, device) -> tuple[Rows, Optional[torch.Tensor]]:
    """FLUX.3 has no encode_prompt: its modular Flux3TextEncoderStep runs as its own pipeline on the loaded encoder,
    one prompt per call (it refuses batches). Its pad multiple is set to `length`, so every prompt fills exactly
    `length` positions (pad tokens included: the transformer attends to them); with length <= 80 that is the step's
    default window (a multiple of 80, capped at max_sequence_length) for every prompt."""
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep   # deferred: diffusers is optional

    step = Flux3TextEncoderStep(pad_multiple=length).init_pipeline()
    step.update_components(text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer)
    rows = [step(prompt=p, max_sequence_length=length, output="prompt_embeds")[0] for p in prompts]
    return torch.stack(rows).to(device), None


def _wan_vace(pipe, prompts: list[str], length: int, device) -> tuple[Rows, Optional[torch.Tensor]]:
    """WanVACEPipeline.encode_prompt's own rows (its prompt_clean, the UMT5 last hidden state of each prompt's real
    tokens, zero rows after them, `length` positions) and the mask of those real tokens, from the pipeline's
    tokenizer call (encode_prompt keeps it internal). The pipeline module uses
    ftfy without importing it when it is not installed (a NameError): then, as Wan's own path (text.py _wan_clean),
    the text is cleaned without it."""
    from diffusers.pipelines.wan import pipeline_wan_vace as module   # deferred: diffusers is optional

    no_ftfy = not hasattr(module, "ftfy")
    if no_ftfy:
        module.ftfy = SimpleNamespace(fix_text=lambda text: text)
    try:
        text, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, num_videos_per_prompt=1,
                                     max_sequence_length=length, device=device)
        clean = [module.prompt_clean(p) for p in prompts]
    finally:
        if no_ftfy:
            del module.ftfy
    mask = pipe.tokenizer(clean, padding="max_length", max_length=length, truncation=True, add_special_tokens=True,
                          return_attention_mask=True, return_tensors="pt").attention_mask
    return text, mask.to(text.device).bool()


CALLS: dict[str, Callable[..., Encoded]] = {
    "flux2": _flux2, "qwen_image": _qwen_image, "chroma": _chroma, "sana": _sana, "z_image": _z_image,
    "lumina2": _lumina2, "hidream": _hidream, "ltx_video": _ltx_video, "hunyuan_video": _hunyuan_video,
    "qwen_image21": _qwen_image21,
    "kandinsky5": _kandinsky5,
    "ltx2": _ltx2,
    "krea2": _krea2,
    "ernie_image": _ernie_image,
    "minimax_h3": _minimax_h3,
    "flux3": _flux3,
    "wan_vace": _wan_vace,
    # -- new pipeline encoders above this line --
}


def _pipeline_extras(pipeline: str) -> dict[str, Any]:
    """What a pipeline's __init__ needs besides its text parts: HunyuanVideo15Pipeline reads vae.config whenever it
    has a vae slot (a tiny AutoencoderKLHunyuanVideo15 stands in: encode_prompt never uses it) and takes a guider."""
    import diffusers

    if pipeline == "LTX2Pipeline":   # its audio VAE, connectors and vocoder: encode_prompt uses none of them
        return {"vae": None, "audio_vae": None, "connectors": None, "vocoder": None}
    if pipeline != "HunyuanVideo15Pipeline":
        return {"vae": None}
    vae = diffusers.AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8,) * 5, layers_per_block=1)
    return {"vae": vae, "guider": None}


def build_pipeline(pipeline: str, models: dict[str, Any], tokenizers: dict[str, Any]):
    """The diffusers pipeline class `pipeline` holding only its text encoders and tokenizers, passed by pipeline
    subfolder name ("text_encoder", "tokenizer", "text_encoder_2", ...; no VAE, no transformer)."""
    import diffusers

    cls = getattr(diffusers, pipeline)
    if issubclass(cls, diffusers.ModularPipeline):   # modular-only families: its default blocks, the text parts set
        pipe = cls()
        pipe.update_components(**models, **tokenizers)
        return pipe
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
