"""LTX-Video 0.9.x (diffusers LTXVideoTransformer3DModel) with TREAD routing; not LTX-2.

Video tokens are routed with their RoPE rows and per-token modulation; the T5 text is never-routed context
(docs/families.md, "LTX-Video").
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from tread.models.families.base import Embedded, FamilyConfigError, Grid, RoutedFamily, cond32, mask_bias

_BLOCK = dict(activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads", norm_elementwise_affine=False,
              norm_eps=1e-6, attention_bias=True, attention_out_bias=True)

LTX_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 blocks, width 64 (4 heads x 16), T5 stand-in of width 32, 2x2 latent cells
    # per token (the released models: 1x1 on the 32x-compressed LTX latents).
    "tiny": dict(patch_size=2, patch_size_t=1, num_attention_heads=4, attention_head_dim=16, cross_attention_dim=64,
                 num_layers=8, caption_channels=32, **_BLOCK),
    # A mid-size model for GPU benchmarks (~0.35B parameters): width 1024, 20 blocks, T5-XXL text width; 2x2 cells
    # per token like the other families' mid presets.
    "mid": dict(patch_size=2, patch_size_t=1, num_attention_heads=16, attention_head_dim=64, cross_attention_dim=1024,
                num_layers=20, caption_channels=4096, **_BLOCK),
    # LTX-Video 2B: LTXVideoTransformer3DModel's defaults (1.92B). Real weights: model.pretrained.
    "ltxv-2b": dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                    attention_head_dim=64, cross_attention_dim=2048, num_layers=28, caption_channels=4096, **_BLOCK),
    # LTX-Video 13B (0.9.7 / 0.9.8 13B; 13.0B). Real weights: model.pretrained.
    "ltxv-13b": dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                     attention_head_dim=128, cross_attention_dim=4096, num_layers=48, caption_channels=4096, **_BLOCK),
}

VAE_TEMPORAL, VAE_SPATIAL = 8, 32   # AutoencoderKLLTXVideo's compression (LTXPipeline's defaults without a VAE too)
DEFAULT_FRAME_RATE = 25             # LTXPipeline.__call__(frame_rate=25)


class LTXVideoFamily(RoutedFamily):
    family = "ltx_video"
    hub_hint = "Lightricks/LTX-Video"
    diffusers_class = "LTXVideoTransformer3DModel"
    text_dim_key = "caption_channels"
    frames_axis = True
    i2v_mode = "frames"             # model.i2v: the given frames at per-token timestep 0 (first_frame.py)

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        """The packed token width C * pt * p * p (diffusers' defaults p = pt = 1); refuses a qk_norm LTXAttention
        does not build (it would raise NotImplementedError)."""
        if diffusers_config.get("qk_norm", "rms_norm_across_heads") != "rms_norm_across_heads":
            raise FamilyConfigError(f"model.diffusers_config.qk_norm={diffusers_config['qk_norm']!r} is not allowed; allowed: "
                                    f"'rms_norm_across_heads' (the only one LTXAttention implements).")
        cells = int(diffusers_config.get("patch_size", 1)) ** 2 * int(diffusers_config.get("patch_size_t", 1))
        return {"in_channels": in_channels * cells, "out_channels": in_channels * cells}

    def __init__(self, transformer: nn.Module, *, frame_rate: float = DEFAULT_FRAME_RATE,
                 expand_timesteps: bool = False, **kwargs: Any):
        if isinstance(frame_rate, bool) or not isinstance(frame_rate, (int, float)) or not frame_rate > 0:
            raise FamilyConfigError(f"model.frame_rate={frame_rate!r} is not allowed; allowed: a number > 0 (frames "
                                    f"per second of the video; LTXPipeline's default {DEFAULT_FRAME_RATE}).")
        self.frame_rate = float(frame_rate)
        self.expand_timesteps = bool(expand_timesteps)
        super().__init__(transformer, **kwargs)

    def latent_patch(self) -> tuple[int, int, int]:
        c = self.transformer.config
        return int(c.patch_size_t), int(c.patch_size), int(c.patch_size)

    def check_shapes(self) -> None:
        c = self.transformer.config
        pt, p, _ = self.latent_patch()
        cells = pt * p * p
        if c.in_channels != self.in_channels * cells:
            raise FamilyConfigError(
                f"model.config.in_channels={c.in_channels} must equal data.channels x patch_size_t x patch_size^2 = "
                f"{self.in_channels} x {pt} x {p}^2 = {self.in_channels * cells}: LTX packs {pt}x{p}x{p} latent cells "
                f"into one token (the LTX VAE has 128 latent channels; released models use patch 1).")
        if (c.out_channels or c.in_channels) != c.in_channels:
            raise FamilyConfigError(f"model.config.out_channels={c.out_channels} must equal in_channels="
                                    f"{c.in_channels}: LTX predicts the packed latent itself.")
        self._check_video_patch()
        inner = c.num_attention_heads * c.attention_head_dim
        if c.cross_attention_dim != inner:
            raise FamilyConfigError(
                f"model.config.cross_attention_dim={c.cross_attention_dim} must equal the width num_attention_heads x "
                f"attention_head_dim = {inner}: the captions are projected to the model width before attn2.")

    def group_attention_modules(self) -> list[nn.Module]:
        return [block.attn1 for block in self.routable_blocks()]

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    # noise_level = t * 1000 is what the LTX pipelines feed (scheduler timesteps): the default timestep().

    def rope_interpolation_scale(self) -> tuple[float, float, float]:
        """LTXPipeline.__call__'s (vae temporal ratio / frame_rate, vae spatial ratio, vae spatial ratio)."""
        return VAE_TEMPORAL / self.frame_rate, VAE_SPATIAL, VAE_SPATIAL

    # -- packing (LTXPipeline's conventions) --------------------------------------------------------
    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, F, H, W) -> (B, F/pt * H/p * W/p, C*pt*p*p), tokens in (f, h, w) order, features (C, pt, p, p)."""
        B, C, F, H, W = x.shape
        pt, p, _ = self.latent_patch()
        x = x.reshape(B, C, F // pt, pt, H // p, p, W // p, p).permute(0, 2, 4, 6, 1, 3, 5, 7)
        return x.reshape(B, (F // pt) * (H // p) * (W // p), C * pt * p * p)

    def unpack(self, tokens: torch.Tensor, grid: Grid) -> torch.Tensor:
        """pack's inverse: (B, f*h*w, C*pt*p*p) on token grid (f, h, w) -> (B, C, f*pt, h*p, w*p)."""
        f, h, w = grid
        pt, p, _ = self.latent_patch()
        B = tokens.shape[0]
        x = tokens.reshape(B, f, h, w, -1, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(B, -1, f * pt, h * p, w * p)

    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, B, grid = self.transformer, x.shape[0], self.grid_of(x)
        cos, sin = tr.rope(x, *grid, self.rope_interpolation_scale(), None)        # (B, N, D) each
        mask = mask_bias(cond.get("text_mask"), x.dtype)                           # (B, 1, L) as diffusers' forward
        hidden = tr.proj_in(self.pack(x))                                           # (B, N, D)
        timestep = self.token_timestep(timestep, hidden.shape[1])
        temb, embedded = tr.time_embed(timestep.flatten(), batch_size=B, hidden_dtype=hidden.dtype)
        temb, embedded = temb.view(B, -1, temb.shape[-1]), embedded.view(B, -1, embedded.shape[-1])
        context = tr.caption_projection(cond["text"]).view(B, -1, hidden.shape[-1])  # (B, L, D)
        per_token = {"rope_cos": cos, "rope_sin": sin}
        extra: dict[str, Any] = {"embedded_timestep": embedded, "mask": mask}
        if timestep.dim() == 2:
            per_token["temb"] = temb                                                # (B, N, 6D)
        else:
            extra["temb"] = temb                                                    # (B, 1, 6D)
        return Embedded(hidden, context, per_token, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        shared, mask = emb.extra.get("temb"), emb.extra["mask"]

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                temb = tok["temb"] if shared is None else shared
                x = block(hidden_states=x, encoder_hidden_states=context, temb=cond32(temb),
                          image_rotary_emb=(tok["rope_cos"], tok["rope_sin"]), encoder_attention_mask=mask)
                return x, context
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr = self.transformer
        values = tr.scale_shift_table[None, None] + emb.extra["embedded_timestep"][:, :, None]   # (B, 1|N, 2, D)
        shift, scale = values[:, :, 0], values[:, :, 1]
        x = tr.norm_out(x) * (1 + scale) + shift
        return self.unpack(tr.proj_out(x), emb.grid)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """transformer(...) on the inputs LTXPipeline builds: packed latents, the text mask, the token grid and
        rope_interpolation_scale (8 / frame_rate, 32, 32)."""
        grid = self.grid_of(x)
        f, h, w = grid
        out = transformer(hidden_states=self.pack(x), encoder_hidden_states=cond["text"],
                          timestep=self.token_timestep(timestep, f * h * w), encoder_attention_mask=cond.get("text_mask"),
                          num_frames=f, height=h, width=w, rope_interpolation_scale=self.rope_interpolation_scale(),
                          return_dict=False)[0]
        return self.unpack(out, grid)


FAMILY = LTXVideoFamily
PRESETS = LTX_PRESETS
