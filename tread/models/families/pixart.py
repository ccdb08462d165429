"""PixArt-alpha / PixArt-sigma (diffusers PixArtTransformer2DModel) with TREAD routing.

Positions are in the patch embedding, so routing gathers hidden states only; the learned-sigma channels are
dropped from the output, as the pipelines do (docs/families.md, "Implementation notes").
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from tread.models.families.base import Embedded, FamilyConfigError, RoutedFamily, cond32, mask_bias, unpack_patches

_BLOCK = dict(norm_type="ada_norm_single", num_embeds_ada_norm=1000, activation_fn="gelu-approximate",
              attention_bias=True, norm_elementwise_affine=False, norm_eps=1e-6)

PIXART_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 blocks, width 64 (4 heads x 16), T5 stand-in of width 32.
    "tiny": dict(num_attention_heads=4, attention_head_dim=16, num_layers=8, cross_attention_dim=64,
                 caption_channels=32, patch_size=2, use_additional_conditions=False, **_BLOCK),
    # A mid-size model for GPU benchmarks (~0.35B parameters): width 1024, 20 blocks, T5-XXL text width.
    "mid": dict(num_attention_heads=16, attention_head_dim=64, num_layers=20, cross_attention_dim=1024,
                caption_channels=4096, patch_size=2, use_additional_conditions=False, **_BLOCK),
    # Released geometries (SD VAE / SDXL VAE latents, 4 channels, learned sigma): use model.pretrained.
    "alpha-512": dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
                      cross_attention_dim=1152, caption_channels=4096, sample_size=64, patch_size=2,
                      use_additional_conditions=False, **_BLOCK),
    "alpha-1024": dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
                       cross_attention_dim=1152, caption_channels=4096, sample_size=128, patch_size=2,
                       use_additional_conditions=True, **_BLOCK),
    "sigma-1024": dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
                       cross_attention_dim=1152, caption_channels=4096, sample_size=128, patch_size=2,
                       interpolation_scale=2, use_additional_conditions=False, **_BLOCK),
}


class PixArtFamily(RoutedFamily):
    family = "pixart"
    hub_hint = "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"
    diffusers_class = "PixArtTransformer2DModel"

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        # learned sigma (2C outputs) as the released models; the sincos position table fits the data size
        return {**super().data_config(in_channels, input_size, diffusers_config), "out_channels": 2 * in_channels}

    def __init__(self, transformer: nn.Module, *, vae_scale_factor: int = 8, **kwargs: Any):
        self.vae_scale_factor = int(vae_scale_factor)
        super().__init__(transformer, **kwargs)

    @property
    def text_dim(self) -> int:
        c = self.transformer.config
        return int(c.caption_channels if c.caption_channels is not None else c.cross_attention_dim)

    def check_shapes(self) -> None:
        c, tr = self.transformer.config, self.transformer
        self._check_patch_io(c, "PixArt's released models use 4-channel VAE latents", learned_sigma=True,
                             width_key="cross_attention_dim" if c.caption_channels is not None else None,
                             width_note="PixArt projects the captions to the model width")
        if tr.use_additional_conditions and tr.inner_dim % 3:
            raise FamilyConfigError(
                f"model.config.use_additional_conditions=true needs a width (num_attention_heads x "
                f"attention_head_dim = {tr.inner_dim}) divisible by 3: the resolution (2 values) and aspect-ratio "
                f"embeddings are width/3 each. Allowed: a multiple of 3, or use_additional_conditions=false.")

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    # noise_level = t * 1000 is what the PixArt pipelines feed (scheduler timesteps): the default timestep().

    def _added_cond(self, x: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
        if not self.transformer.use_additional_conditions:
            return {"resolution": None, "aspect_ratio": None}
        B, (H, W) = x.shape[0], x.shape[-2:]
        s = self.vae_scale_factor
        return {"resolution": torch.tensor([[H * s, W * s]], dtype=x.dtype, device=x.device).repeat(B, 1),
                "aspect_ratio": torch.tensor([[H / W]], dtype=x.dtype, device=x.device).repeat(B, 1)}

    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, B, grid = self.transformer, x.shape[0], self.grid_of(x)
        hidden = tr.pos_embed(x)                                                     # (B, N, D) + positions
        t6, t_emb = tr.adaln_single(timestep, self._added_cond(x), batch_size=B, hidden_dtype=hidden.dtype)
        context = cond["text"]
        if tr.caption_projection is not None:
            context = tr.caption_projection(context).view(B, -1, hidden.shape[-1])  # (B, L, D)
        extra = {"timestep": t6, "embedded_timestep": t_emb, "mask": mask_bias(cond.get("text_mask"), hidden.dtype)}
        return Embedded(hidden, context, {}, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        t6, mask = emb.extra["timestep"], emb.extra["mask"]

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                x = block(x, attention_mask=None, encoder_hidden_states=context, encoder_attention_mask=mask,
                          timestep=cond32(t6), cross_attention_kwargs=None, class_labels=None)
                return x, context
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr = self.transformer
        shift, scale = (tr.scale_shift_table[None] + emb.extra["embedded_timestep"][:, None]).chunk(2, dim=1)
        x = tr.proj_out(tr.norm_out(x) * (1 + scale) + shift)
        out = unpack_patches(x, emb.grid, self.latent_patch(), tr.out_channels).squeeze(2)
        return out[:, :self.out_channels]                                           # drop learned sigma

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        out = transformer(hidden_states=x, encoder_hidden_states=cond["text"], timestep=timestep,
                          added_cond_kwargs=self._added_cond(x), encoder_attention_mask=cond.get("text_mask"),
                          return_dict=False)[0]
        return out[:, :self.out_channels]


FAMILY = PixArtFamily
PRESETS = PIXART_PRESETS
