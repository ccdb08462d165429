"""Stable Diffusion 3 / 3.5 (diffusers SD3Transformer2DModel) with TREAD routing.

Routes count over the joint MMDiT blocks (a route may end in the context_pre_only last block); positions are
in the patch embedding. `use_t5=False` zeroes the T5 part of the text, as the pipeline without T5.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from tread.models.families.base import Embedded, FamilyConfigError, Grid, RoutedFamily, cond32, unpack_patches

CLIP_TOKENS = 77   # the SD3 text embeddings: 77 CLIP positions, then the T5 output (tread/encoders/text.py)

SD3_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 joint blocks, width 64. SD3.5-style: dual attention in the first
    # half and RMS QK-norm, so the tests cover both block kinds (SD3.0: config={dual_attention_layers: [],
    # qk_norm: null}).
    "tiny": dict(patch_size=2, num_layers=8, attention_head_dim=16, num_attention_heads=4,
                 joint_attention_dim=32, caption_projection_dim=64, pooled_projection_dim=32,
                 dual_attention_layers=(0, 1, 2, 3), qk_norm="rms_norm"),
    # A mid-size model for GPU benchmarks (~0.39B parameters), SD3.5-medium-like with the real text widths.
    "mid": dict(patch_size=2, num_layers=16, attention_head_dim=64, num_attention_heads=12,
                joint_attention_dim=4096, caption_projection_dim=768, pooled_projection_dim=2048,
                dual_attention_layers=tuple(range(8)), qk_norm="rms_norm"),
    # stabilityai/stable-diffusion-3-medium-diffusers geometry (load the weights with model.pretrained).
    "medium": dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=192,
                   dual_attention_layers=(), qk_norm=None),
    # stabilityai/stable-diffusion-3.5-medium geometry (MMDiT-X: dual attention in blocks 0..12).
    "medium35": dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                     attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                     caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                     dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
    # stabilityai/stable-diffusion-3.5-large geometry.
    "large": dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38,
                  attention_head_dim=64, num_attention_heads=38, joint_attention_dim=4096,
                  caption_projection_dim=2432, pooled_projection_dim=2048, pos_embed_max_size=192,
                  dual_attention_layers=(), qk_norm="rms_norm"),
}


class SD3Family(RoutedFamily):
    family = "sd3"
    hub_hint = "stabilityai/stable-diffusion-3-medium-diffusers"
    diffusers_class = "SD3Transformer2DModel"
    text_dim_key = "joint_attention_dim"
    pooled_dim_key = "pooled_projection_dim"
    pos_table = "side"

    def __init__(self, transformer: nn.Module, *, use_t5: bool = True, **kwargs: Any):
        if not isinstance(use_t5, bool):
            raise FamilyConfigError(f"model.use_t5={use_t5!r} is not allowed; allowed: true or false.")
        self.use_t5 = use_t5
        super().__init__(transformer, **kwargs)

    def conditioning(self, labels: torch.Tensor, cond: Optional[Mapping[str, torch.Tensor]]) -> dict:
        """RoutedFamily's text conditioning; without T5, the T5 positions (after the 77 CLIP tokens) are zeros."""
        text = super().conditioning(labels, cond)
        if self.use_t5 or text["text"].shape[1] <= CLIP_TOKENS:
            return text
        clip_part = text["text"][:, :CLIP_TOKENS]
        zeros = clip_part.new_zeros((clip_part.shape[0], text["text"].shape[1] - CLIP_TOKENS, clip_part.shape[2]))
        return {**text, "text": torch.cat([clip_part, zeros], dim=1)}

    def check_text_data(self, conditioning: Mapping[str, Any], where: str) -> None:
        """RoutedFamily's checks; model.use_t5=false acts on text embeddings from the data only, so on class labels
        (the class table stands in for the text) it would change nothing: refused, not ignored."""
        super().check_text_data(conditioning, where)
        if not self.use_t5 and conditioning.get("text") is None:
            raise FamilyConfigError(
                f"model.use_t5=false zeroes the T5 part of the data's text embeddings, but the data at {where} has "
                f"none (class labels: the class table stands in for the text, so it would change nothing); allowed: "
                f"text data (data=toy_text model.text_encoders=DIR, or scripts/precompute_latents.py --text-family "
                f"sd3 [--no-t5]), or model.use_t5=true.")

    def check_shapes(self) -> None:
        c = self.transformer.config
        self._check_patch_io(c, "SD3 patchifies the latents as they are")
        grid = self.input_size // c.patch_size
        if c.pos_embed_max_size is None or grid > c.pos_embed_max_size:
            raise FamilyConfigError(
                f"model.config.pos_embed_max_size={c.pos_embed_max_size} is smaller than the token grid side "
                f"data.resolution / patch_size = {grid}; allowed: pos_embed_max_size >= {grid}.")
        bad = [i for i in (c.dual_attention_layers or ()) if not 0 <= int(i) < c.num_layers]
        if bad:
            raise FamilyConfigError(f"model.config.dual_attention_layers={list(c.dual_attention_layers)} has "
                                    f"indices {bad} outside the {c.num_layers} blocks (0..{c.num_layers - 1}).")

    def check_grid(self, grid: Grid) -> None:
        """diffusers' PatchEmbed crops the centre h x w of its pos_embed_max_size^2 sin-cos table (cropped_pos_embed),
        so neither side may exceed pos_embed_max_size."""
        _, h, w = grid
        side, p = self.transformer.config.pos_embed_max_size, int(self.transformer.config.patch_size)
        if max(h, w) > side:
            raise FamilyConfigError(
                f"model.family=sd3: latents {h * p}x{w * p} make a {h}x{w} "
                f"token grid, beyond the {side}x{side} position table (model.config.pos_embed_max_size={side}); "
                f"allowed: token grid sides <= {side} (a fresh model: set model.config.pos_embed_max_size >= "
                f"{max(h, w)}).")

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def timestep(self, noise_level: torch.Tensor) -> torch.Tensor:
        return noise_level   # the SD3 pipeline passes sigma * 1000; the embedding does not rescale

    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, grid = self.transformer, self.grid_of(x)
        hidden = tr.pos_embed(x).contiguous()                  # (B, N, D), the centre crop's positions added
        temb = tr.time_text_embed(timestep, cond["pooled"])    # (B, D)
        context = tr.context_embedder(cond["text"])            # (B, L, D)
        return Embedded(hidden, context, {}, {"temb": temb}, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        temb = emb.extra["temb"]

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: Optional[torch.Tensor], tok: Mapping[str, torch.Tensor]):
                context, x = block(hidden_states=x, encoder_hidden_states=context, temb=cond32(temb))
                return x, context          # context is None after the context_pre_only (last) block
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr = self.transformer
        out = tr.proj_out(tr.norm_out(x, emb.extra["temb"]))   # (B, N, p*p*C), features (p, q, C)
        p = int(tr.config.patch_size)
        return unpack_patches(out, emb.grid, (1, p, p), tr.out_channels).squeeze(2)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        return transformer(hidden_states=x, encoder_hidden_states=cond["text"],
                           pooled_projections=cond["pooled"], timestep=timestep, return_dict=False)[0]


FAMILY = SD3Family
PRESETS = SD3_PRESETS
