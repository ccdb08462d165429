"""Sana / Sana 1.5 / Sana-Sprint (diffusers SanaTransformer2DModel) with TREAD routing.

Every block is routable. The Mix-FFN's depthwise conv sees the kept tokens at their true grid positions and
zeros where tokens were dropped (`mix_ffn_kept`; docs/families.md explains why).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from tread.models.families.base import Embedded, FamilyConfigError, RoutedFamily, cond32, mask_bias, unpack_patches

_SANA = dict(mlp_ratio=2.5, attention_bias=False, norm_elementwise_affine=False, norm_eps=1e-6, dropout=0.0)
# The released models (diffusers' scripts/convert_sana_to_diffusers.py): 32-channel DC-AE f32 latents, patch 1,
# Gemma-2-2B text (2304 wide); sample_size = image size / 32; interpolation_scale None at 512 / 1024 px.
_RELEASED = dict(in_channels=32, out_channels=32, caption_channels=2304, patch_size=1, **_SANA)
_1600M = dict(num_attention_heads=70, attention_head_dim=32, num_layers=20, num_cross_attention_heads=20,
              cross_attention_head_dim=112, cross_attention_dim=2240)
_600M = dict(num_attention_heads=36, attention_head_dim=32, num_layers=28, num_cross_attention_heads=16,
             cross_attention_head_dim=72, cross_attention_dim=1152)

SANA_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 blocks, width 64 (4 heads x 16), Gemma stand-in of width 32, patch 2
    # (16x16 toy latents -> an 8x8 token grid); no position embedding, as the 1024 px models.
    "tiny": dict(num_attention_heads=4, attention_head_dim=16, num_layers=8, num_cross_attention_heads=4,
                 cross_attention_head_dim=16, cross_attention_dim=64, caption_channels=32, patch_size=2,
                 interpolation_scale=None, **_SANA),
    # GPU benchmarks (~0.33B parameters): width 1024, 20 blocks, Gemma-2 text width; patch 2 so that 4-channel
    # f8 latents give the other families' token count (Sana itself uses patch 1 on f32 DC-AE latents).
    "mid": dict(num_attention_heads=32, attention_head_dim=32, num_layers=20, num_cross_attention_heads=16,
                cross_attention_head_dim=64, cross_attention_dim=1024, caption_channels=2304, patch_size=2,
                interpolation_scale=None, **_SANA),
    # Released geometries (use model.pretrained for their weights).
    "sana-600m-1024": dict(**_600M, sample_size=32, interpolation_scale=None, **_RELEASED),
    "sana-1600m-1024": dict(**_1600M, sample_size=32, interpolation_scale=None, **_RELEASED),
    "sana-1600m-4k": dict(**_1600M, sample_size=128, interpolation_scale=2.0, **_RELEASED),
    "sana1.5-1600m-1024": dict(**_1600M, sample_size=32, interpolation_scale=None, qk_norm="rms_norm_across_heads",
                               **_RELEASED),
    "sana-sprint-1600m-1024": dict(**_1600M, sample_size=32, interpolation_scale=None, guidance_embeds=True,
                                   qk_norm="rms_norm_across_heads", **_RELEASED),
}


def mix_ffn_kept(ff: nn.Module, hidden: torch.Tensor, grid_pos: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """diffusers' GLUMBConv (Sana's Mix-FFN) on kept tokens at their true grid positions.

    hidden (B, K, C), grid_pos (B, K, 1) long flat positions in the (H, W) = `grid` token grid -> (B, K, C_out).
    Only the 3x3 depthwise conv runs on a zero (B, C', H, W) grid holding the kept tokens; the rest is per token.
    With all tokens kept this is GLUMBConv.forward.
    """
    B, K, _ = hidden.shape
    H, W = grid
    image = hidden.unflatten(1, (1, K)).permute(0, 3, 1, 2)                     # (B, C, 1, K), channels last
    residual = image if ff.residual_connection else None
    z = ff.nonlinearity(ff.conv_inverted(image))                                 # (B, C', 1, K)
    tokens = z.permute(0, 2, 3, 1).flatten(1, 2)                                 # (B, K, C')
    index = grid_pos.expand(B, K, tokens.shape[-1])
    holey = tokens.new_zeros(B, H * W, tokens.shape[-1]).scatter(1, index, tokens)   # zero where dropped
    # channels-last (B, C', H, W), the memory layout diffusers' conv_depth sees: dense is bit-identical
    z = ff.conv_depth(holey.unflatten(1, (H, W)).permute(0, 3, 1, 2))
    z = z.permute(0, 2, 3, 1).flatten(1, 2).gather(1, index)                     # (B, K, C') kept positions
    z = z.unflatten(1, (1, K)).permute(0, 3, 1, 2)                               # (B, C', 1, K)
    z, gate = torch.chunk(z, 2, dim=1)
    z = z * ff.nonlinearity(gate)
    z = ff.conv_point(z)                                                          # (B, C_out, 1, K)
    if ff.norm_type == "rms_norm":
        z = ff.norm(z.movedim(1, -1)).movedim(-1, 1)
    if residual is not None:
        z = z + residual
    return z.flatten(2, 3).permute(0, 2, 1)


def sana_block(block: nn.Module, x: torch.Tensor, context: torch.Tensor, mask: Optional[torch.Tensor],
               timestep: torch.Tensor, grid_pos: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """SanaTransformerBlock.forward on the (kept) tokens x (B, K, D) with their grid positions (B, K, 1):
    the block's own sub-modules in diffusers' order; the Mix-FFN through mix_ffn_kept."""
    B = x.shape[0]
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        block.scale_shift_table[None] + timestep.reshape(B, 6, -1)).chunk(6, dim=1)
    norm = block.norm1(x)
    norm = (norm * (1 + scale_msa) + shift_msa).to(x.dtype)
    x = x + gate_msa * block.attn1(norm)
    if block.attn2 is not None:
        x = block.attn2(x, encoder_hidden_states=context, attention_mask=mask) + x
    norm = block.norm2(x) * (1 + scale_mlp) + shift_mlp
    return x + gate_mlp * mix_ffn_kept(block.ff, norm, grid_pos, grid)


class SanaFamily(RoutedFamily):
    family = "sana"
    hub_hint = "Efficient-Large-Model/Sana_1600M_1024px_diffusers"
    diffusers_class = "SanaTransformer2DModel"
    text_dim_key = "caption_channels"

    def __init__(self, transformer: nn.Module, *, guidance: Optional[float] = None, **kwargs: Any):
        self.guidance = guidance
        super().__init__(transformer, **kwargs)
        if transformer.config.guidance_embeds and guidance is None:
            raise FamilyConfigError("model.guidance must be set for a guidance-distilled Sana-Sprint (guidance_embeds: "
                                    "true), e.g. model.guidance=4.5 (SanaSprintPipeline's guidance_scale default); "
                                    "got null.")
        if not transformer.config.guidance_embeds and guidance is not None:
            raise FamilyConfigError(f"model.guidance={guidance} needs a guidance-distilled Sana-Sprint transformer "
                                    f"(config guidance_embeds: true); this one has no guidance embedding: use null.")

    def check_shapes(self) -> None:
        c = self.transformer.config
        self._check_patch_io(c, "Sana's released models use 32-channel DC-AE latents",
                             width_key="cross_attention_dim",
                             width_note="the cross-attention keys and values are the text projected to the width")

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def timestep(self, noise_level: torch.Tensor) -> torch.Tensor:
        c = self.transformer.config
        if c.guidance_embeds:                    # SanaSprintPipeline: the sCM time in [0, 1]
            return noise_level / 1000
        scale = float(c.timestep_scale)          # SanaPipeline: scheduler timestep * timestep_scale
        return noise_level if scale == 1.0 else noise_level * scale

    def _guidance(self, batch: int, device: torch.device, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """SanaSprintPipeline: guidance_scale (B,) in the text dtype times config.guidance_embeds_scale."""
        if not self.transformer.config.guidance_embeds:
            return None
        g = torch.full((batch,), float(self.guidance), device=device, dtype=torch.float32).to(dtype)
        return g * self.transformer.config.guidance_embeds_scale

    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, B, grid = self.transformer, x.shape[0], self.grid_of(x)
        _, h, w = grid
        hidden = tr.patch_embed(x)                                      # (B, N, D) (+ sincos table if any)
        guidance = self._guidance(B, x.device, cond["text"].dtype)
        if guidance is not None:
            t6, t_emb = tr.time_embed(timestep, guidance=guidance, hidden_dtype=hidden.dtype)
        else:
            t6, t_emb = tr.time_embed(timestep, batch_size=B, hidden_dtype=hidden.dtype)
        context = tr.caption_projection(cond["text"]).view(B, -1, hidden.shape[-1])
        context = tr.caption_norm(context)                              # (B, L, D)
        grid_pos = torch.arange(h * w, device=x.device).view(1, h * w, 1).expand(B, -1, -1)
        extra = {"timestep": t6, "embedded_timestep": t_emb, "mask": mask_bias(cond.get("text_mask"), x.dtype)}
        return Embedded(hidden, context, {"grid_pos": grid_pos}, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        t6, mask, grid = emb.extra["timestep"], emb.extra["mask"], emb.grid[1:]

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                return sana_block(block, x, context, mask, cond32(t6), tok["grid_pos"], grid), context
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr = self.transformer
        x = tr.proj_out(tr.norm_out(x, emb.extra["embedded_timestep"], tr.scale_shift_table))
        return unpack_patches(x, emb.grid, self.latent_patch(), tr.config.out_channels or self.out_channels
                              ).squeeze(2)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        return transformer(hidden_states=x, encoder_hidden_states=cond["text"], timestep=timestep,
                           guidance=self._guidance(x.shape[0], x.device, cond["text"].dtype),
                           encoder_attention_mask=cond.get("text_mask"), return_dict=False)[0]


FAMILY = SanaFamily
PRESETS = SANA_PRESETS
