"""The correctness checks every diffusers family shares (tests/family_checks.py): one test per check,
parametrized over the families. FAMILIES holds what differs per family; what only one family has (its
kept-subsequence reference, its own inputs and options) is in tests/test_family_<name>.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import pytest
import torch

import family_checks as fc

pytestmark = pytest.mark.usefixtures("one_thread")


def route(ratio: float, start: int, end: int) -> dict:
    return {"selection_ratio": ratio, "start_layer_idx": start, "end_layer_idx": end}


# Every tiny preset has 8 blocks. FLUX / AuraFlow: 2 double-stream (joint) + 6 single blocks; SD3: dual attention
# (SD3.5) in blocks 0..3, block 7 context_pre_only; Wan, PixArt: one block kind.
CROSS = [route(0.5, 1, 5)]                            # FLUX / AuraFlow: double (joint) -> single blocks
PER_KIND = [route(0.5, 0, 1), route(0.75, 3, 6)]      # FLUX / AuraFlow: one route in each block kind
SPAN = [route(0.5, 1, -2)]                            # blocks 1..6 (SD3: dual -> plain blocks)
TO_LAST = [route(0.75, 3, -1)]                        # SD3: ends in the context_pre_only last block
TWO_ROUTES = [route(0.5, 0, 2), route(0.75, 4, 7)]    # blocks 0..2 and 4..7 (SD3: dual, then plain blocks)
SD30 = {"config": {"dual_attention_layers": [], "qk_norm": None}}   # SD3.0-style blocks
RGB16 = {"input_size": 16, "in_channels": 3}
VIDEO = {"frames": 3}                                 # Wan: routes run at T = 3 (T = 1: image latents)
PER_TOKEN = {"frames": 3, "expand_timesteps": True}   # Wan: (B,) timesteps run through the (B, N) path

Case = tuple  # (routes, build kwargs)


class Cases(dict):
    """Several cases of one check for one family: {case id: case}."""


@dataclass(frozen=True)
class Family:
    """One family's inputs to the shared checks: per check one case, or Cases({case id: case})."""

    dense: Union[dict, Cases]               # build kwargs: dense == diffusers
    ratio_zero: Union[dict, Cases]          # build kwargs: ratio 0 with a permutation == dense
    set_aside: Union[Case, Cases]           # set-aside tokens bit-identical, text untouched
    gradients: Union[Case, Cases]
    force_keep: Union[Case, Cases]          # routes in every block kind
    checkpointing: Union[Case, Cases]
    text: dict                              # check_text_conditioning kwargs (with routes: + a routed step)
    pooled: bool                            # the text data brings pooled embeddings too
    timestep_divisor: float                 # the pipeline's timestep = noise_level / this
    toy_batch: int = 3
    config_errors: tuple = ()               # the family's own (needle, build_family kwargs)


FAMILIES = {
    "flux": Family(
        dense={}, ratio_zero={}, set_aside=(CROSS, {}), gradients=(CROSS, {}),
        force_keep=Cases({"crossing": (CROSS, {}), "double-and-single": (PER_KIND, {})}),
        checkpointing=(CROSS, {}), text={}, pooled=True, timestep_divisor=1000),
    "sd3": Family(
        dense=Cases({"sd35": {}, "sd30": SD30, "16px-rgb": RGB16}), ratio_zero={},
        set_aside=Cases({"crossing": (SPAN, {}), "to-last": (TO_LAST, {})}), gradients=(TO_LAST, {}),
        force_keep=Cases({"crossing": (SPAN, {}), "dual-and-plain": (TWO_ROUTES, {})}),
        checkpointing=(TO_LAST, {}), text={}, pooled=True, timestep_divisor=1,
        config_errors=(("pos_embed_max_size=2", {"config": {"pos_embed_max_size": 2}}),
                       ("caption_projection_dim=32", {"config": {"caption_projection_dim": 32}}),
                       ("does not take", {"config": {"num_single_layers": 2}}))),
    "wan": Family(
        dense=Cases({"image-T1": {}, "video-T3": VIDEO, "video-T3-per-token": PER_TOKEN}),
        ratio_zero=Cases({"image-T1": {}, "video-T3": VIDEO, "video-T3-per-token": PER_TOKEN}),
        set_aside=Cases({"image-T1": (SPAN, {}), "video-T3": (SPAN, VIDEO)}),
        gradients=Cases({"video-T3": (SPAN, VIDEO), "video-T3-per-token": (SPAN, PER_TOKEN)}),
        force_keep=Cases({"image-T1": (TWO_ROUTES, {}), "video-T3-per-token": (TWO_ROUTES, PER_TOKEN)}),
        checkpointing=Cases({"video-T3-per-token": (SPAN, PER_TOKEN)}), text={"with_mask": True, **VIDEO},
        pooled=False, timestep_divisor=1, toy_batch=2,
        config_errors=(("out_channels=8", {"config": {"out_channels": 8}}),
                       ("model.frames=3", {"frames": 3, "config": {"patch_size": (2, 2, 2)}}),
                       ("image_dim", {"config": {"image_dim": 16}}))),
    "auraflow": Family(
        dense=Cases({"": {}, "16px-rgb": RGB16}), ratio_zero={}, set_aside=(CROSS, {}), gradients=(CROSS, {}),
        force_keep=Cases({"crossing": (CROSS, {}), "joint-and-single": (PER_KIND, {})}),
        checkpointing=(CROSS, {}), text={}, pooled=False, timestep_divisor=1000,
        config_errors=(("pos_embed_max_size=9", {"config": {"pos_embed_max_size": 9}}),
                       ("caption_projection_dim=32", {"config": {"caption_projection_dim": 32}}))),
    "pixart": Family(
        dense={}, ratio_zero={}, set_aside=(SPAN, {}), gradients=(SPAN, {}), force_keep=(TWO_ROUTES, {}),
        checkpointing=(SPAN, {}), text={"routes": SPAN, "with_mask": True}, pooled=False, timestep_divisor=1,
        toy_batch=2,
        config_errors=(("out_channels=6", {"config": {"out_channels": 6}}),
                       ("cross_attention_dim=32", {"config": {"cross_attention_dim": 32}}),
                       # width 64: not a multiple of 3
                       ("use_additional_conditions=true", {"config": {"use_additional_conditions": True}}))),
    "chroma": Family(   # FLUX layout (2 dual + 6 single), approximator modulation, T5 + text mask, no pooled
        dense=Cases({"": {}, "16px-rgb": RGB16}), ratio_zero={}, set_aside=(CROSS, {}), gradients=(CROSS, {}),
        force_keep=Cases({"crossing": (CROSS, {}), "dual-and-single": (PER_KIND, {})}),
        checkpointing=(CROSS, {}), text={"routes": CROSS, "with_mask": True}, pooled=False, timestep_divisor=1000,
        config_errors=(("out_channels=8", {"config": {"out_channels": 8}}),
                       ("patch_size=2", {"config": {"patch_size": 2}}),
                       (r"axes_dims_rope=\[4, 4, 4\]", {"config": {"axes_dims_rope": [4, 4, 4]}}))),
    "qwen_image": Family(   # 8 dual-stream blocks (one block kind), 2x2 packing, centred 3-axis RoPE, text mask
        dense=Cases({"": {}, "16px-rgb": RGB16, "zero_cond_t": {"config": {"zero_cond_t": True}}}),
        ratio_zero=Cases({"": {}, "zero_cond_t": {"config": {"zero_cond_t": True}}}),
        set_aside=(SPAN, {}),
        gradients=Cases({"": (SPAN, {}), "zero_cond_t": (SPAN, {"config": {"zero_cond_t": True}})}),
        force_keep=(TWO_ROUTES, {}), checkpointing=(SPAN, {"config": {"zero_cond_t": True}}),
        text={"routes": SPAN, "with_mask": True}, pooled=False, timestep_divisor=1000,
        config_errors=(("out_channels=8", {"config": {"out_channels": 8}}),
                       ("patch_size=1", {"config": {"patch_size": 1}}),
                       (r"axes_dims_rope=\[4, 4, 4\]", {"config": {"axes_dims_rope": [4, 4, 4]}}),
                       ("guidance_embeds=true", {"config": {"guidance_embeds": True}}),
                       ("use_layer3d_rope=true", {"config": {"use_layer3d_rope": True}}),
                       ("model.kontext='yes'", {"kontext": "yes"}))),
    "flux2": Family(   # 2 dual + 6 single, shared modulation, 4-axis RoPE, no pooled; "guidance": guidance-distilled
        dense=Cases({"": {}, "16px-rgb": RGB16, "guidance": {"config": {"guidance_embeds": True}, "guidance": 4.0}}),
        ratio_zero=Cases({"": {}, "guidance": {"config": {"guidance_embeds": True}, "guidance": 4.0}}),
        set_aside=(CROSS, {}), gradients=(CROSS, {"config": {"guidance_embeds": True}, "guidance": 4.0}),
        force_keep=Cases({"crossing": (CROSS, {}), "dual-and-single": (PER_KIND, {})}),
        checkpointing=(CROSS, {}), text={"routes": CROSS}, pooled=False, timestep_divisor=1000,
        config_errors=(("out_channels=8", {"config": {"out_channels": 8}}),
                       ("patch_size=2", {"config": {"patch_size": 2}}),
                       (r"axes_dims_rope=\[4, 4, 8\]", {"config": {"axes_dims_rope": [4, 4, 8]}}),
                       ("model.guidance must be set", {"config": {"guidance_embeds": True}}),
                       ("model.guidance=4.0 is set", {"guidance": 4.0}),
                       ("model.kontext='yes'", {"kontext": "yes"}))),
    "sana": Family(   # one block kind: linear self-attn, cross-attn (Gemma text + mask), Mix-FFN (3x3 depthwise conv)
        dense=Cases({"": {}, "16px-rgb": RGB16, "pos-embed": {"config": {"interpolation_scale": 1.0}},
                     "sprint": {"config": {"guidance_embeds": True, "qk_norm": "rms_norm_across_heads"},
                                "guidance": 4.5}}),
        ratio_zero=Cases({"": {}, "16px-rgb": RGB16}), set_aside=(SPAN, {}),
        gradients=Cases({"": (SPAN, {}), "sprint": (SPAN, {"config": {"guidance_embeds": True}, "guidance": 4.5})}),
        force_keep=(TWO_ROUTES, {}), checkpointing=(SPAN, {}), text={"routes": SPAN, "with_mask": True},
        pooled=False, timestep_divisor=1, toy_batch=2,
        config_errors=(("out_channels=8", {"config": {"out_channels": 8}}),
                       ("cross_attention_dim=32", {"config": {"cross_attention_dim": 32}}),
                       ("model.guidance must be set", {"config": {"guidance_embeds": True}}),
                       ("model.guidance=4.5", {"guidance": 4.5}))),
    "hidream": Family(   # 2 dual + 6 single blocks, MoE feed-forward, T5 + a Llama state per block + pooled
        dense=Cases({"": {}, "16px-rgb": RGB16}), ratio_zero={}, set_aside=(CROSS, {}), gradients=(CROSS, {}),
        force_keep=Cases({"crossing": (CROSS, {}), "dual-and-single": (PER_KIND, {})}),
        checkpointing=(CROSS, {}), text={"routes": CROSS}, pooled=True, timestep_divisor=1,
        config_errors=(("out_channels=8", {"config": {"out_channels": 8}}),
                       ("llama_layers", {"config": {"llama_layers": [0, 1]}}),
                       (r"axes_dims_rope=\[4, 4, 4\]", {"config": {"axes_dims_rope": [4, 4, 4]}}),
                       ("force_inference_output", {"config": {"force_inference_output": True}}))),
    "z_image": Family(   # 8 single-stream main blocks over [image, image pads, caption]; refiners never routed.
        # default 4x4 grid: 16 image tokens + 16 x_pad_token pads (context); 16px-rgb: 8x8 grid, no pad
        dense=Cases({"": {}, "16px-rgb": RGB16}), ratio_zero=Cases({"": {}, "16px-rgb": RGB16}),
        set_aside=Cases({"": (SPAN, {}), "16px-rgb": (SPAN, RGB16)}), gradients=(SPAN, {}),
        force_keep=(TWO_ROUTES, {}), checkpointing=(SPAN, {}), text={"routes": SPAN, "with_mask": True},
        pooled=False, timestep_divisor=1000,   # sigma; the transformer gets 1 - sigma (tests/test_family_z_image.py)
        config_errors=(("siglip_feat_dim=16", {"config": {"siglip_feat_dim": 16}}),
                       (r"axes_dims=\[4, 4, 4\]", {"config": {"axes_dims": [4, 4, 4]}}),
                       (r"all_f_patch_size=\[2\]", {"config": {"all_f_patch_size": [2]}}),
                       (r"axes_lens=\[1024, 2, 2\]", {"config": {"axes_lens": [1024, 2, 2]}}),
                       ("does not take", {"config": {"num_layers": 2}}))),
    "lumina2": Family(   # 8 joint layers over [caption, image] (one block kind), never-routed refiners, Gemma mask, GQA
        dense=Cases({"": {}, "16px-rgb": RGB16}), ratio_zero={}, set_aside=Cases({"inner": (SPAN, {}),
                                                                                   "to-last": (TO_LAST, {})}),
        gradients=(SPAN, {}), force_keep=(TWO_ROUTES, {}), checkpointing=(SPAN, {}),
        text={"routes": SPAN, "with_mask": True}, pooled=False,
        timestep_divisor=1000,   # sigma; the transformer gets 1 - sigma (tests/test_family_lumina2.py)
        config_errors=(("out_channels=8", {"config": {"out_channels": 8}}),
                       ("num_kv_heads=3", {"config": {"num_kv_heads": 3}}),
                       ("hidden_size=66", {"config": {"hidden_size": 66}}),
                       (r"axes_dim_rope=\[4, 4, 4\]", {"config": {"axes_dim_rope": [4, 4, 4]}}),
                       (r"axes_lens=\[300, 2, 2\]", {"config": {"axes_lens": [300, 2, 2]}}),
                       ("num_layers=0", {"config": {"num_layers": 0}}))),
    "ltx_video": Family(   # 8 blocks of one kind, packed (C, pt, p, p) tokens, fractional 3-D RoPE, T5 + text mask
        dense=Cases({"image-T1": {}, "video-T3": VIDEO, "video-T3-per-token": PER_TOKEN, "16px-rgb": RGB16,
                     "frame-rate-12": {**VIDEO, "frame_rate": 12}}),
        ratio_zero=Cases({"image-T1": {}, "video-T3": VIDEO, "video-T3-per-token": PER_TOKEN}),
        set_aside=Cases({"image-T1": (SPAN, {}), "video-T3": (SPAN, VIDEO)}),
        gradients=Cases({"video-T3": (SPAN, VIDEO), "video-T3-per-token": (SPAN, PER_TOKEN)}),
        force_keep=Cases({"image-T1": (TWO_ROUTES, {}), "video-T3-per-token": (TWO_ROUTES, PER_TOKEN)}),
        checkpointing=Cases({"video-T3-per-token": (SPAN, PER_TOKEN)}),
        text={"routes": SPAN, "with_mask": True, **VIDEO}, pooled=False, timestep_divisor=1, toy_batch=2,
        config_errors=(("out_channels=8", {"config": {"out_channels": 8}}),
                       ("cross_attention_dim=32", {"config": {"cross_attention_dim": 32}}),
                       ("qk_norm='rms_norm'", {"config": {"qk_norm": "rms_norm"}}),
                       ("model.frames=3", {"frames": 3, "config": {"patch_size_t": 2}}),
                       ("model.frame_rate=0", {"frame_rate": 0}))),
    "cosmos": Family(   # Predict2: 8 blocks (one kind), 3D RoPE, T5 cross-attn; PER_TOKEN: (B,) -> per-frame (B, T) t
        dense=Cases({"image-T1": {}, "video-T3": VIDEO, "video-T3-per-frame": PER_TOKEN, "16px-rgb": RGB16,
                     "fps": {"frames": 3, "frame_rate": 16},
                     "video2world-geometry": {"frames": 3, "config": {"in_channels": 5}}}),
        ratio_zero=Cases({"image-T1": {}, "video-T3": VIDEO, "video-T3-per-frame": PER_TOKEN}),
        set_aside=Cases({"image-T1": (SPAN, {}), "video-T3": (SPAN, VIDEO)}),
        gradients=Cases({"video-T3": (SPAN, VIDEO), "video-T3-per-frame": (SPAN, PER_TOKEN)}),
        force_keep=Cases({"image-T1": (TWO_ROUTES, {}), "video-T3-per-frame": (TWO_ROUTES, PER_TOKEN)}),
        checkpointing=Cases({"video-T3-per-frame": (SPAN, PER_TOKEN)}), text={"with_mask": True, **VIDEO},
        pooled=False, timestep_divisor=1000, toy_batch=2,   # t = sigma / (sigma + 1) in [0, 1]
        config_errors=(("out_channels=8", {"config": {"out_channels": 8}}),
                       (r"patch_size=\[2, 2, 2\]", {"config": {"patch_size": (2, 2, 2)}}),
                       ("attention_head_dim=10", {"config": {"attention_head_dim": 10}}),
                       ("use_crossattn_projection=True", {"config": {"use_crossattn_projection": True}}),
                       (r"max_size=\[4, 4, 4\]", {"config": {"max_size": (4, 4, 4)}}),
                       ("model.frame_rate=0", {"frame_rate": 0}))),
    "hunyuan_video": Family(   # 8 dual-stream blocks; [latents, cond latents, mask] channels; per-sample timesteps
        # only (the model has no per-token / per-frame timestep: tests/test_family_hunyuan_video.py refuses (B, N))
        dense=Cases({"image-T1": {}, "video-T3": VIDEO, "16px-rgb": RGB16}),
        ratio_zero=Cases({"image-T1": {}, "video-T3": VIDEO}),
        set_aside=Cases({"image-T1": (SPAN, {}), "video-T3": (SPAN, VIDEO)}),
        gradients=Cases({"video-T3": (SPAN, VIDEO)}), force_keep=Cases({"video-T3": (TWO_ROUTES, VIDEO)}),
        checkpointing=Cases({"video-T3": (SPAN, VIDEO)}), text={"routes": SPAN, "with_mask": True, **VIDEO},
        pooled=False, timestep_divisor=1, toy_batch=2,
        config_errors=(("out_channels=8", {"config": {"out_channels": 8}}),
                       (r"rope_axes_dim=\[4, 4, 4\]", {"config": {"rope_axes_dim": (4, 4, 4)}}),
                       ("model.frames=3", {"frames": 3, "config": {"patch_size_t": 2}}),
                       ("use_meanflow=true", {"config": {"use_meanflow": True}}))),
    "qwen_image21": Family(   # 8 single-stream blocks over [text, target] (block-causal); "free-t": causal_condition off
        dense=Cases({"": {}, "16px-rgb": RGB16, "free-t": {"config": {"causal_condition": False}}}),
        ratio_zero=Cases({"": {}, "free-t": {"config": {"causal_condition": False}}}), set_aside=(SPAN, {}),
        gradients=Cases({"": (SPAN, {}), "free-t": (SPAN, {"config": {"causal_condition": False}})}),
        force_keep=(TWO_ROUTES, {}), checkpointing=(SPAN, {}), text={"routes": SPAN, "with_mask": True},
        pooled=False, timestep_divisor=1000,
        config_errors=(("out_channels=8", {"config": {"out_channels": 8}}),
                       (r"axes_dims_rope=\[4, 4, 4\]", {"config": {"axes_dims_rope": [4, 4, 4]}}),
                       ("a 3x3 token grid", {"input_size": 6}),
                       ("does not take", {"config": {"joint_attention_dim": 32}}))),
    "kandinsky5": Family(   # 8 visual (decoder) blocks; text encoder blocks never routed; 3-D RoPE rows per token;
        # per-sample modulation (timestep + CLIP pooled); text mask in text self-attn and cross-attn
        dense=Cases({"image-T1": {}, "video-T3": VIDEO, "16px-rgb": RGB16,
                     "t2i-geometry": {"config": {"visual_cond": False}}}),
        ratio_zero=Cases({"image-T1": {}, "video-T3": VIDEO}),
        set_aside=Cases({"video-T3": (SPAN, VIDEO)}), gradients=Cases({"video-T3": (SPAN, VIDEO)}),
        force_keep=Cases({"video-T3": (TWO_ROUTES, VIDEO)}), checkpointing=Cases({"video-T3": (SPAN, VIDEO)}),
        text={"routes": SPAN, "with_mask": True, **VIDEO}, pooled=True, timestep_divisor=1, toy_batch=2,
        config_errors=(("out_visual_dim=8", {"config": {"out_visual_dim": 8}}),
                       (r"patch_size=\[2, 2, 2\]", {"config": {"patch_size": (2, 2, 2)}}),
                       (r"axes_dims=\[4, 6, 4\]", {"config": {"axes_dims": (4, 6, 4)}}))),
    "ltx2": Family(   # 8 audio-visual blocks; video tokens routed, the audio stream (noise at sigma 1) never routed
        dense=Cases({"image-T1": {}, "video-T3": VIDEO, "video-T3-per-token": PER_TOKEN, "16px-rgb": RGB16}),
        ratio_zero=Cases({"image-T1": {}, "video-T3": VIDEO, "video-T3-per-token": PER_TOKEN}),
        set_aside=Cases({"video-T3": (SPAN, VIDEO)}),
        gradients=Cases({"video-T3-per-token": (SPAN, PER_TOKEN)}),
        force_keep=Cases({"video-T3-per-token": (TWO_ROUTES, PER_TOKEN)}),
        checkpointing=Cases({"video-T3-per-token": (SPAN, PER_TOKEN)}),
        text={"routes": SPAN, "with_mask": True, **VIDEO}, pooled=False, timestep_divisor=1, toy_batch=2,
        config_errors=(("out_channels=8", {"config": {"out_channels": 8}}),
                       ("cross_attention_dim=32", {"config": {"cross_attention_dim": 32}}),
                       ("audio_cross_attention_dim=16", {"config": {"audio_cross_attention_dim": 16}}),
                       ("caption_channels=48", {"config": {"caption_channels": 48}}),
                       ("use_prompt_embeddings=false", {"config": {"use_prompt_embeddings": False}}),
                       ("model.frame_rate=0", {"frame_rate": 0}))),
    "krea2": Family(   # 8 single-stream blocks over [text, image], GQA; text fusion never routed; text key mask
        dense=Cases({"": {}, "16px-rgb": RGB16}), ratio_zero={}, set_aside=(SPAN, {}), gradients=(SPAN, {}),
        force_keep=(TWO_ROUTES, {}), checkpointing=(SPAN, {}), text={"routes": SPAN, "with_mask": True},
        pooled=False, timestep_divisor=1000,
        config_errors=((r"axes_dims_rope=\[4, 4, 4\]", {"config": {"axes_dims_rope": [4, 4, 4]}}),
                       ("num_key_value_heads=3", {"config": {"num_key_value_heads": 3}}),
                       ("text_num_attention_heads=5", {"config": {"text_num_attention_heads": 5}}),
                       ("num_layers=0", {"config": {"num_layers": 0}}),
                       ("does not take", {"config": {"patch_size": 2}}))),
    "flux3": Family(   # 2 image mode + 6 single blocks (text / reference mode blocks never routed), 4-axis RoPE
        dense=Cases({"": {}, "16px-rgb": RGB16}), ratio_zero={}, set_aside=(CROSS, {}), gradients=(CROSS, {}),
        force_keep=Cases({"crossing": (CROSS, {}), "mode-and-single": (PER_KIND, {})}),
        checkpointing=(CROSS, {}), text={"routes": CROSS}, pooled=False, timestep_divisor=1000,
        config_errors=(("cond_in_channels=8", {"config": {"cond_in_channels": 8}}),
                       (r"axes_dims_rope=\[4, 4, 8\]", {"config": {"axes_dims_rope": [4, 4, 8]}}),
                       ("flow_map=true", {"config": {"flow_map": True}}),
                       ("model.kontext='yes'", {"kontext": "yes"}),
                       ("does not take", {"config": {"patch_size": 2}}))),
    "ernie_image": Family(   # 8 single-stream blocks over [image, text], one shared AdaLN, 2x2 packing, text mask
        dense=Cases({"": {}, "16px-rgb": RGB16}), ratio_zero=Cases({"": {}, "16px-rgb": RGB16}), set_aside=(SPAN, {}),
        gradients=(SPAN, {}), force_keep=(TWO_ROUTES, {}), checkpointing=(SPAN, {}),
        text={"routes": SPAN, "with_mask": True}, pooled=False, timestep_divisor=1,   # sigma * 1000, as the pipeline
        config_errors=(("out_channels=8", {"config": {"out_channels": 8}}),
                       ("patch_size=2", {"config": {"patch_size": 2}}),
                       (r"rope_axes_dim=\[4, 6, 8\]", {"config": {"rope_axes_dim": [4, 6, 8]}}),
                       ("does not take", {"config": {"num_single_layers": 2}}))),
    "minimax_h3": Family(   # 8 blocks over one packed [text | video] sequence; video rows routed, text (+ refiner) never;
        # per-row (timestep, modality) modulation rows and RoPE ids; video-only (no audio rows); t = 1 - sigma
        dense=Cases({"image-T1": {}, "video-T3": VIDEO, "16px-rgb": RGB16}),
        ratio_zero=Cases({"image-T1": {}, "video-T3": VIDEO}),
        set_aside=Cases({"video-T3": (SPAN, VIDEO)}), gradients=Cases({"video-T3": (SPAN, VIDEO)}),
        force_keep=Cases({"video-T3": (TWO_ROUTES, VIDEO)}), checkpointing=Cases({"video-T3": (SPAN, VIDEO)}),
        text={"routes": SPAN, "with_mask": True, **VIDEO}, pooled=False, timestep_divisor=1000, toy_batch=2,
        config_errors=((r"patch_size=\[2, 2\]", {"config": {"patch_size": (2, 2)}}),
                       ("rope_freq_dim=3", {"config": {"rope_freq_dim": 3}}),
                       (r"patch_size=\[2, 2, 2\]", {"frames": 3, "config": {"patch_size": (2, 2, 2)}}),
                       ("does not take", {"config": {"out_channels": 4}}))),
    "wan_vace": Family(   # Wan's 8 blocks + 4 VACE blocks (full sequence, never routed) whose hints are per video token;
        # the blank VACE context (no control video); per-sample timesteps only; "scale": per-layer conditioning_scale
        dense=Cases({"image-T1": {}, "video-T3": VIDEO, "16px-rgb": RGB16,
                     "scale": {**VIDEO, "conditioning_scale": [1.0, 0.5, 0.0, 2.0]}}),
        ratio_zero=Cases({"image-T1": {}, "video-T3": VIDEO}),
        set_aside=Cases({"image-T1": (SPAN, {}), "video-T3": (SPAN, VIDEO)}), gradients=Cases({"video-T3": (SPAN, VIDEO)}),
        force_keep=Cases({"video-T3": (TWO_ROUTES, VIDEO)}), checkpointing=Cases({"video-T3": (SPAN, VIDEO)}),
        text={"routes": SPAN, "with_mask": True, **VIDEO}, pooled=False, timestep_divisor=1, toy_batch=2,
        config_errors=(("vace_in_channels=96", {"config": {"vace_in_channels": 96}}),
                       (r"vace_layers=\[1, 3\]", {"config": {"vace_layers": [1, 3]}}),
                       (r"vace_layers=\[0, 8\]", {"config": {"vace_layers": [0, 8]}}),
                       ("conditioning_scale", {"conditioning_scale": [1.0, 2.0]}),
                       ("expand_timesteps", {"expand_timesteps": True}),
                       ("image_dim", {"config": {"image_dim": 16}}))),
    # -- new families above this line --
}


def cases(check: str) -> list:
    """pytest params (family, *case) of one check over FAMILIES; ids: family or family-case id."""
    params = []
    for family, fam in FAMILIES.items():
        entry = getattr(fam, check)
        for name, case in (entry if isinstance(entry, Cases) else {"": entry}).items():
            args = case if isinstance(case, tuple) else (case,)
            params.append(pytest.param(family, *args, id=f"{family}-{name}" if name else family))
    return params


@pytest.mark.parametrize("family,kw", cases("dense"))
def test_dense_equals_diffusers(family, kw):
    fc.check_dense_equals_diffusers(family, **kw)


@pytest.mark.parametrize("family,kw", cases("ratio_zero"))
def test_ratio_zero_permuted_equals_dense(family, kw):
    fc.check_ratio_zero_permuted_equals_dense(family, **kw)


@pytest.mark.parametrize("family,routes,kw", cases("set_aside"))
def test_set_aside_bit_identical_and_text_untouched(family, routes, kw):
    fc.check_set_aside_and_text(family, routes, **kw)


@pytest.mark.parametrize("family,routes,kw", cases("gradients"))
def test_gradients_reach_every_trained_parameter(family, routes, kw):
    fc.check_gradients_reach_all(family, routes, **kw)


@pytest.mark.parametrize("family,routes,kw", cases("force_keep"))
def test_force_keep_in_every_block_kind(family, routes, kw):
    fc.check_force_keep(family, routes, **kw)


@pytest.mark.parametrize("family,routes,kw", cases("checkpointing"))
def test_gradient_checkpointing_same_gradients(family, routes, kw):
    fc.check_checkpointing_same_grads(family, routes, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_text_data_conditioning_and_null_drop(family):
    """Text embeddings from the data (+ pooled where the family has them, + a keep-mask) replace the class table
    and give diffusers' forward; the null label zeroes them (CFG). With routes: a routed training step on them."""
    fam = FAMILIES[family]
    model, x, t, y, cond, _ = fc.check_text_conditioning(family, **fam.text)
    assert (model.pooled_dim is not None) == fam.pooled
    if fam.text.get("routes"):
        out = model.train()(x, t, y, cond=cond)
        assert out.shape == x.shape and model.last_route_stats


@pytest.mark.parametrize("family", FAMILIES)
def test_toy_data_with_paper_route(family):
    """The tiny preset builds for the built-in 3x16x16 data with the paper route (blocks 2..-4) and trains; the
    timestep follows the family's pipeline convention."""
    fam = FAMILIES[family]
    model, (_, t, _) = fc.check_paper_route_on_toy_data(family, batch=fam.toy_batch)
    if fam.timestep_divisor == 1:
        assert model.timestep(t) is t   # the pipeline feeds sigma * 1000: no conversion
    else:
        torch.testing.assert_close(model.timestep(t), t / fam.timestep_divisor)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_errors_name_the_key(family):
    fc.check_config_errors(family, *FAMILIES[family].config_errors)


@pytest.mark.parametrize("family", FAMILIES)
def test_flops_on_the_meta_device_and_from_three_counts(family):
    fc.check_meta_flops(family)
