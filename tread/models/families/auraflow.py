"""AuraFlow (diffusers AuraFlowTransformer2DModel) with TREAD routing.

Routes count over the joint blocks, then the single blocks; the 8 register tokens and the text are
never-routed context (docs/families.md, "Implementation notes").
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from tread.models.families.base import Embedded, FamilyConfigError, Grid, RoutedFamily, cond32, unpack_patches

AURAFLOW_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 2 joint + 6 single blocks, width 64 (paper route = blocks 2..4).
    "tiny": dict(patch_size=2, num_mmdit_layers=2, num_single_dit_layers=6, attention_head_dim=16,
                 num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64),
    # A mid-size model for GPU benchmarks (~0.3B parameters), with the real (UMT5/Pile-T5) text width.
    "mid": dict(patch_size=2, num_mmdit_layers=2, num_single_dit_layers=12, attention_head_dim=128,
                num_attention_heads=8, joint_attention_dim=2048, caption_projection_dim=1024),
    # fal/AuraFlow v0.1-v0.2 geometry (diffusers' defaults; 6.8B). Load weights with model.pretrained,
    # which takes the checkpoint's own config (e.g. v0.3's larger position table).
    "v0": dict(sample_size=64, patch_size=2, in_channels=4, out_channels=4, num_mmdit_layers=4,
               num_single_dit_layers=32, attention_head_dim=256, num_attention_heads=12,
               joint_attention_dim=2048, caption_projection_dim=3072, pos_embed_max_size=1024),
}


class AuraFlowFamily(RoutedFamily):
    family = "auraflow"
    hub_hint = "fal/AuraFlow-v0.3"
    diffusers_class = "AuraFlowTransformer2DModel"
    text_dim_key = "joint_attention_dim"
    pos_table = "area"

    @property
    def num_registers(self) -> int:
        return int(self.transformer.register_tokens.shape[1])

    def check_shapes(self) -> None:
        c = self.transformer.config
        self._check_patch_io(c, "AuraFlow patchifies the latents as they are")
        side, grid = math.isqrt(int(c.pos_embed_max_size)), self.input_size // c.patch_size
        if grid > side:
            raise FamilyConfigError(
                f"model.config.pos_embed_max_size={c.pos_embed_max_size} holds a {side}x{side} position grid, "
                f"smaller than the {grid}x{grid} token grid (data.resolution / patch_size); allowed: "
                f"pos_embed_max_size >= {grid * grid}.")
        if c.num_mmdit_layers + c.num_single_dit_layers == 0:
            raise FamilyConfigError("model.config.num_mmdit_layers + num_single_dit_layers = 0: no blocks to run.")

    def check_grid(self, grid: Grid) -> None:
        """diffusers' AuraFlowPatchEmbed picks the centred h x w window of its isqrt(pos_embed_max_size)^2 table
        (pe_selection_index_based_on_dim), so neither side may exceed that side."""
        _, h, w = grid
        side = math.isqrt(int(self.transformer.config.pos_embed_max_size))
        if max(h, w) > side:
            p = int(self.transformer.config.patch_size)
            raise FamilyConfigError(
                f"model.family=auraflow: latents {h * p}x{w * p} make a {h}x{w} token grid, beyond the {side}x{side} "
                f"position table (model.config.pos_embed_max_size={self.transformer.config.pos_embed_max_size}); "
                f"allowed: token grid sides <= {side} (a fresh model: set model.config.pos_embed_max_size >= "
                f"{max(h, w) ** 2}).")

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return [*transformer.joint_transformer_blocks, *transformer.single_transformer_blocks]

    def timestep(self, noise_level: torch.Tensor) -> torch.Tensor:
        return noise_level / 1000.0   # the AuraFlow pipeline passes t in [0, 1]; the embedding scales by 1000

    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, grid = self.transformer, self.grid_of(x)
        hidden = tr.pos_embed(x)                                                    # (B, N, D), positions added
        dtype = next(tr.parameters()).dtype
        temb = tr.time_step_proj(tr.time_step_embed(timestep).to(dtype=dtype))      # (B, D)
        text = tr.context_embedder(cond["text"])                                    # (B, L, D)
        registers = tr.register_tokens.to(device=text.device, dtype=text.dtype).repeat(text.shape[0], 1, 1)
        context = torch.cat([registers, text], dim=1)                               # (B, 8 + L, D)
        return Embedded(hidden, context, {}, {"temb": temb}, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        temb = emb.extra["temb"]

        def joint(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                context, x = block(hidden_states=x, encoder_hidden_states=context, temb=cond32(temb))
                return x, context
            return fn

        def single(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                L = context.shape[1]
                out = block(hidden_states=torch.cat([context, x], dim=1), temb=cond32(temb))  # [registers, text, image]
                return out[:, L:], out[:, :L]
            return fn

        tr = self.transformer
        return [*(joint(b) for b in tr.joint_transformer_blocks), *(single(b) for b in tr.single_transformer_blocks)]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr = self.transformer
        out = tr.proj_out(tr.norm_out(x, emb.extra["temb"]))   # (B, N, p*p*C), features (p, q, C)
        p = int(tr.config.patch_size)
        return unpack_patches(out, emb.grid, (1, p, p), int(tr.out_channels)).squeeze(2)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        return transformer(hidden_states=x, encoder_hidden_states=cond["text"], timestep=timestep,
                           return_dict=False)[0]


FAMILY = AuraFlowFamily
PRESETS = AURAFLOW_PRESETS
