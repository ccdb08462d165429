"""Which text encoders each family's diffusers (0.42) pipeline loads: per family its encoder slots (pipeline
subfolders, kind, what it is), default sequence length, whether a mask and a pooled embedding come out, the hub
repo to name in download advice, and the pipeline class; the transformers class per encoder kind. Loading and
encoding: tread/encoders/text.py."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

from tread.encoders.errors import TextEncoderError

PathLike = Union[str, os.PathLike]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.json")
CLIP_DEFAULT_LENGTH = 77
SD3_T5_WIDTH = 4096   # joint_attention_dim of every SD3 / SD3.5 transformer (T5-XXL's width)


@dataclass(frozen=True)
class EncoderSlot:
    """One text encoder of a family: its pipeline subfolders and what it is."""
    model: str        # subfolder of the model in a diffusers pipeline folder, e.g. "text_encoder_2"
    tokenizer: str    # subfolder of its tokenizer, e.g. "tokenizer_2"
    kind: str         # "clip" (CLIPTextModel) | "clip_proj" (CLIPTextModelWithProjection) | a key of MODEL_TYPES
    what: str         # for messages
    processor: bool = False   # the tokenizer folder is loaded with AutoProcessor (as the pipeline's tokenizer is)
    download: Optional[str] = None   # how to fetch it when the family's hub repo does not hold it (for messages)


@dataclass(frozen=True)
class FamilySpec:
    slots: tuple[EncoderSlot, ...]
    max_length: int   # default sequence length of the T5-type encoder (the pipeline's max_sequence_length)
    mask: bool        # whether encode_prompts returns "text_mask"
    pooled: bool      # whether encode_prompts returns "pooled"
    repo: str         # a hub repo with these encoders (for the download advice)
    pipeline: str     # diffusers pipeline class (model_index.json of save_tiny_text_encoders)
    via_pipeline: bool = False   # encoded by the pipeline's own encode_prompt (text_pipelines.py)


_CLIP_L = EncoderSlot("text_encoder", "tokenizer", "clip", "CLIP-L (CLIPTextModel)")
# HiDream's Llama is not in its hub repo: diffusers' HiDreamImagePipeline example loads it (model and tokenizer) from
# meta-llama/Meta-Llama-3.1-8B-Instruct; 'original/' there holds Meta's own checkpoint format, not needed.
LLAMA_DOWNLOAD = ("HiDream-ai/HiDream-I1-Full does not hold it: HiDreamImagePipeline takes it from "
                  "meta-llama/Meta-Llama-3.1-8B-Instruct (a gated repo: accept its license on the hub first); fetch "
                  "it with `hf download meta-llama/Meta-Llama-3.1-8B-Instruct --exclude 'original/*' --local-dir "
                  "DIR/text_encoder_4` (model and tokenizer in one folder).")
FAMILIES: dict[str, FamilySpec] = {
    "flux": FamilySpec((_CLIP_L, EncoderSlot("text_encoder_2", "tokenizer_2", "t5", "T5 (T5EncoderModel)")),
                       512, mask=False, pooled=True, repo="black-forest-labs/FLUX.1-dev", pipeline="FluxPipeline"),
    "sd3": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "clip_proj", "CLIP-L (CLIPTextModelWithProjection)"),
                       EncoderSlot("text_encoder_2", "tokenizer_2", "clip_proj",
                                   "CLIP-G (CLIPTextModelWithProjection)"),
                       EncoderSlot("text_encoder_3", "tokenizer_3", "t5", "T5 (T5EncoderModel)")),
                      256, mask=False, pooled=True, repo="stabilityai/stable-diffusion-3-medium-diffusers",
                      pipeline="StableDiffusion3Pipeline"),
    "wan": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "t5", "UMT5 (UMT5EncoderModel)"),), 512, mask=True,
                      pooled=False, repo="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", pipeline="WanPipeline"),
    "auraflow": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "t5", "UMT5 (UMT5EncoderModel)"),), 256,
                           mask=True, pooled=False, repo="fal/AuraFlow", pipeline="AuraFlowPipeline"),
    "pixart": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "t5", "T5 (T5EncoderModel)"),), 120, mask=True,
                         pooled=False, repo="PixArt-alpha/PixArt-XL-2-512x512", pipeline="PixArtAlphaPipeline"),
}
FAMILIES.update({
    "flux2": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "mistral3", "Mistral-Small 3 "
                                     "(Mistral3ForConditionalGeneration)", processor=True),), 512, mask=False,
                        pooled=False, repo="black-forest-labs/FLUX.2-dev", pipeline="Flux2Pipeline", via_pipeline=True),
    "qwen_image": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "qwen2_5_vl", "Qwen2.5-VL "
                                          "(Qwen2_5_VLForConditionalGeneration)"),), 512, mask=True, pooled=False,
                             repo="Qwen/Qwen-Image", pipeline="QwenImagePipeline", via_pipeline=True),
    "chroma": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "t5", "T5 (T5EncoderModel)"),), 512, mask=True,
                         pooled=False, repo="lodestones/Chroma1-HD", pipeline="ChromaPipeline", via_pipeline=True),
    "sana": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "gemma2", "Gemma-2 (Gemma2Model)"),), 300, mask=True,
                       pooled=False, repo="Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers",
                       pipeline="SanaPipeline", via_pipeline=True),
    "z_image": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "qwen3", "Qwen3 (Qwen3Model)"),), 512, mask=True,
                          pooled=False, repo="Tongyi-MAI/Z-Image-Turbo", pipeline="ZImagePipeline", via_pipeline=True),
    "lumina2": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "gemma2", "Gemma-2 (Gemma2Model)"),), 256,
                          mask=True, pooled=False, repo="Alpha-VLLM/Lumina-Image-2.0", pipeline="Lumina2Pipeline",
                          via_pipeline=True),
    "hidream": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "clip_proj",
                                       "CLIP-L (CLIPTextModelWithProjection)"),
                           EncoderSlot("text_encoder_2", "tokenizer_2", "clip_proj",
                                       "CLIP-G (CLIPTextModelWithProjection)"),
                           EncoderSlot("text_encoder_3", "tokenizer_3", "t5", "T5 (T5EncoderModel)"),
                           EncoderSlot("text_encoder_4", "tokenizer_4", "llama",
                                       "Llama-3.1-8B-Instruct (LlamaForCausalLM)", download=LLAMA_DOWNLOAD)),
                          128, mask=False, pooled=True, repo="HiDream-ai/HiDream-I1-Full",
                          pipeline="HiDreamImagePipeline", via_pipeline=True),
})
# LTX-Video: LTXPipeline's T5 (T5-v1.1-XXL, 4096 wide), run WITHOUT the attention mask (the pipeline passes none to
# T5), padded to max_sequence_length=128; the mask goes to the transformer's cross-attention.
FAMILIES.update({
    "ltx_video": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "t5", "T5 (T5EncoderModel)"),), 128, mask=True,
                            pooled=False, repo="Lightricks/LTX-Video", pipeline="LTXPipeline", via_pipeline=True),
})
# Cosmos-Predict2: Cosmos2TextToImagePipeline / Cosmos2VideoToWorldPipeline._get_t5_prompt_embeds: T5 (google-t5/t5-11b,
# 1024 wide) with the attention mask, max_sequence_length=512, padding rows zeroed (text.py's _encode_masked_t5).
FAMILIES.update({
    "cosmos": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "t5", "T5 (T5EncoderModel)"),), 512, mask=True,
                         pooled=False, repo="nvidia/Cosmos-Predict2-2B-Text2Image",
                         pipeline="Cosmos2TextToImagePipeline"),
})
# HunyuanVideo 1.5: HunyuanVideo15Pipeline.encode_prompt: Qwen2.5-VL's text model (hidden_states[-3]) on the pipeline's
# system-message chat template, padded to tokenizer_max_length=1000 after its 108-token template prefix is dropped, + the
# tokenizer's mask; its ByT5 (Glyph-SDXL-v2, T5EncoderModel) encodes the quoted text of a prompt (zeros and mask 0 for a
# prompt without: text_pipelines.py returns it as "glyph" / "glyph_mask").
FAMILIES.update({
    "hunyuan_video": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "qwen2_5_vl_text",
                                             "Qwen2.5-VL text model (Qwen2_5_VLTextModel)"),
                                 EncoderSlot("text_encoder_2", "tokenizer_2", "t5", "ByT5 (T5EncoderModel)")), 1000,
                                mask=True, pooled=False, repo="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
                                pipeline="HunyuanVideo15Pipeline", via_pipeline=True),
})
# Qwen-Image 2.1: QwenImage21Pipeline.encode_prompt: Qwen3-VL (its processor: the pipeline's raw chat-template string,
# left padding) hidden_states[-1] before the final norm, the system message dropped, right-padded with a mask; no
# max_sequence_length in the pipeline (512 is the stored length here).
FAMILIES.update({
    "qwen_image21": FamilySpec((EncoderSlot("text_encoder", "processor", "qwen3_vl",
                                            "Qwen3-VL (Qwen3VLForConditionalGeneration)", processor=True),), 512,
                               mask=True, pooled=False, repo="Qwen/Qwen-Image-2.1", pipeline="QwenImage21Pipeline",
                               via_pipeline=True),
})
# Kandinsky 5.0: Kandinsky5T2VPipeline.encode_prompt (the T2V / I2V template; its 128-token prefix dropped): Qwen2.5-VL
# hidden_states[-1] (run without a mask; right padding) + cu_seqlens (-> the mask), and CLIP-L's pooler_output (77
# tokens) as "pooled". The T2I pipeline's template (40-token prefix) is not offered here.
FAMILIES.update({
    "kandinsky5": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "qwen2_5_vl_kandinsky5",
                                          "Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration)"),
                              EncoderSlot("text_encoder_2", "tokenizer_2", "clip", "CLIP-L (CLIPTextModel)")), 512,
                             mask=True, pooled=True, repo="kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers",
                             pipeline="Kandinsky5T2VPipeline", via_pipeline=True),
})
# LTX-2: LTX2Pipeline.encode_prompt: Gemma-3 (Gemma3ForConditionalGeneration), every hidden state stacked per token
# (embeddings + each layer: width x 49 for Gemma-3-12B), left-padded to max_sequence_length=1024, + the tokenizer's
# mask. The text connectors run in the model (tread/models/families/ltx2.py), as the pipeline runs them after this.
FAMILIES.update({
    "ltx2": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "gemma3", "Gemma-3 (Gemma3ForConditionalGeneration)"),),
                       1024, mask=True, pooled=False, repo="Lightricks/LTX-2", pipeline="LTX2Pipeline",
                       via_pipeline=True),
})
# Krea 2: Krea2Pipeline.encode_prompt: Qwen3VLModel (Qwen3-VL-4B-Instruct) on the Qwen-Image template padded to a
# fixed max_sequence_length in the middle ([prompt | PAD | 5 suffix tokens], positions counting real tokens only), the
# hidden states text_encoder_select_layers (2, 5, ..., 35) stacked per token, the 34-token prefix dropped; stored with
# the layers side by side: text (L, 12 x 2560) and the mask (True at the prompt and the suffix).
FAMILIES.update({
    "krea2": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "qwen3_vl_model", "Qwen3-VL (Qwen3VLModel)"),), 512,
                        mask=True, pooled=False, repo="krea/Krea-2-Turbo", pipeline="Krea2Pipeline",
                        via_pipeline=True),
})
# ERNIE-Image: ErnieImagePipeline.encode_prompt: Mistral3Model (Ministral-3 3B, 3072 wide) hidden_states[-2] on the bare
# prompt (tokenizer with its bos, no template, no padding): one (T_i, D) row block per prompt. The pipeline has no
# max_sequence_length (the tokenizer truncates at its model_max_length): 512 is the stored length here, and the
# tokenizer truncates at it. Its prompt enhancer (`pe`, a Ministral3ForCausalLM rewriting prompts) is not used.
FAMILIES.update({
    "ernie_image": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "mistral3_model",
                                           "Ministral-3 3B (Mistral3Model)"),), 512, mask=True, pooled=False,
                              repo="baidu/ERNIE-Image", pipeline="ErnieImagePipeline", via_pipeline=True),
})
# FLUX.3: modular only (Flux3ModularPipeline; no encode_prompt): its Flux3TextEncoderStep, one prompt per call, the
# chat template, Qwen3-VL hidden states 4, 8, ..., 32 stacked per token (8 x 2560 = 20480), pad tokens encoded and kept
# (the transformer attends to them; no mask). The step pads to a multiple of 80 tokens; a batch needs one window, so
# each prompt gets exactly max_length tokens: the pipeline's own window for every prompt when max_length <= 80.
FAMILIES.update({
    "flux3": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "qwen3_vl_flux3",
                                     "Qwen3-VL (Qwen3VLForConditionalGeneration)", processor=True),), 80, mask=False,
                        pooled=False, repo="black-forest-labs/FLUX.3", pipeline="Flux3ModularPipeline",
                        via_pipeline=True),
})
# MiniMax-H3: modular only (MiniMaxH3ModularPipeline, no encode_prompt): its t2va text step MiniMaxH3TextEncoderStep, one
# prompt per call, the prompt verbatim (no chat template, no special tokens), Qwen3-VL hidden_states[50] (5120 wide),
# unpadded (stored right-padded with a mask); components text_encoder, tokenizer, processor (the slot loads the
# processor; its tokenizer is the pipeline's tokenizer). No max length in the pipeline (512 stored here).
FAMILIES.update({
    "minimax_h3": FamilySpec((EncoderSlot("text_encoder", "processor", "qwen3_vl_h3",
                                          "Qwen3-VL (Qwen3VLForConditionalGeneration)", processor=True),), 512,
                             mask=True, pooled=False, repo="MiniMaxAI/MiniMax-H3", pipeline="MiniMaxH3ModularPipeline",
                             via_pipeline=True),
})
# WanVACE: WanVACEPipeline.encode_prompt (WanPipeline's: UMT5, prompts cleaned, rows after each prompt zeroed).
FAMILIES.update({
    "wan_vace": FamilySpec((EncoderSlot("text_encoder", "tokenizer", "umt5_vace", "UMT5 (UMT5EncoderModel)"),), 512,
                           mask=True, pooled=False, repo="Wan-AI/Wan2.1-VACE-1.3B-diffusers", pipeline="WanVACEPipeline",
                           via_pipeline=True),
})
# -- new text families above this line --
TEXT_FAMILIES = tuple(FAMILIES)
PIXART_SIGMA_LENGTH = 300
# transformers model classes by encoder kind and config.json model_type (the classes the pipelines load)
MODEL_TYPES: dict[str, dict[str, str]] = {
    "t5": {"t5": "T5EncoderModel", "umt5": "UMT5EncoderModel"},
    "mistral3": {"mistral3": "Mistral3ForConditionalGeneration"},
    "qwen2_5_vl": {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"},
    "qwen2_5_vl_text": {"qwen2_5_vl_text": "Qwen2_5_VLTextModel"},
    "gemma2": {"gemma2": "Gemma2Model"},
    "qwen3": {"qwen3": "Qwen3Model"},
    "llama": {"llama": "LlamaForCausalLM"},
    "qwen3_vl": {"qwen3_vl": "Qwen3VLForConditionalGeneration"},
    "qwen2_5_vl_kandinsky5": {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"},   # own tiny tokenizer only
    "gemma3": {"gemma3": "Gemma3ForConditionalGeneration"},
    "qwen3_vl_model": {"qwen3_vl": "Qwen3VLModel"},   # Krea 2: the base model, no LM head
    "mistral3_model": {"mistral3": "Mistral3Model"},   # ERNIE-Image: the base model, no LM head
    "qwen3_vl_flux3": {"qwen3_vl": "Qwen3VLForConditionalGeneration"},   # FLUX.3: 32 tiny layers (hidden states to 32)
    "qwen3_vl_h3": {"qwen3_vl": "Qwen3VLForConditionalGeneration"},   # MiniMax-H3: 51 tiny layers (reads 50)
    "umt5_vace": {"umt5": "UMT5EncoderModel"},   # wan_vace: UMT5 as Wan's (its own kind: built by tiny_text as UMT5)
    # -- new encoder kinds above this line --
}


def family_spec(family: str) -> FamilySpec:
    if family not in FAMILIES:
        raise TextEncoderError(f"text family {family!r} is unknown; allowed: {', '.join(TEXT_FAMILIES)}")
    return FAMILIES[family]


def family_slots(family: str, t5: bool = True) -> tuple[EncoderSlot, ...]:
    """`family`'s encoders; t5=False (SD3 only: its pipeline runs without text_encoder_3) leaves T5 out."""
    slots = family_spec(family).slots
    if t5:
        return slots
    if family != "sd3":
        source = "its T5's output" if any(s.kind == "t5" for s in slots) else f"the output of {slots[0].what}"
        raise TextEncoderError(f"t5=False (no T5 encoder) is for sd3 only; {family}'s text embeddings are {source}. "
                               f"Allowed: t5=True for {family}.")
    return tuple(s for s in slots if s.kind != "t5")


def encoder_keys(family: str) -> tuple[str, ...]:
    """The path keys load_text_encoders accepts for `family`: "pipeline" and each model/tokenizer subfolder."""
    return ("pipeline",) + tuple(k for s in family_spec(family).slots for k in (s.model, s.tokenizer))
