"""Wan 2.1 / 2.2 (diffusers WanTransformer3DModel) with TREAD routing.

All T*H*W video tokens form the routed sequence; their RoPE rows and per-token modulation are gathered with
them, and diffusers' own attention processor applies the per-sample tables (docs/families.md).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from tread.models.families.base import Embedded, FamilyConfigError, Grid, RoutedFamily, cond32, unpack_patches

WAN_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 blocks, width 64 (4 heads x 16), umT5 stand-in of width 32.
    "tiny": dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, text_dim=32, freq_dim=64,
                 ffn_dim=128, num_layers=8, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6),
    # A mid-size model for GPU benchmarks (~0.28B parameters): width 1024, 16 blocks, umT5-XXL text width.
    "mid": dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=128, text_dim=4096, freq_dim=256,
                ffn_dim=4096, num_layers=16, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6),
    # Wan2.1-T2V-1.3B geometry (Wan 2.1 VAE: 16 latent channels): load the weights with model.pretrained.
    "wan2.1-1.3b": dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    # Wan2.2-TI2V-5B geometry (Wan 2.2 VAE: 48 latent channels); its pipeline uses per-token timesteps
    # (model.expand_timesteps=true reproduces that; a (B, N) noise level is always accepted).
    "wan2.2-5b": dict(patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128, in_channels=48,
                      out_channels=48, text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30,
                      cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
}


class WanFamily(RoutedFamily):
    family = "wan"
    hub_hint = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    diffusers_class = "WanTransformer3DModel"
    text_dim_key = "text_dim"
    frames_axis = True
    i2v_mode = "frames"             # model.i2v: the given frames at per-token timestep 0 (first_frame.py)

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        return {"in_channels": in_channels, "out_channels": in_channels}

    def __init__(self, transformer: nn.Module, *, expand_timesteps: bool = False, **kwargs: Any):
        self.expand_timesteps = bool(expand_timesteps)
        super().__init__(transformer, **kwargs)

    def latent_patch(self) -> tuple[int, int, int]:
        pt, ph, pw = (int(p) for p in self.transformer.config.patch_size)
        return pt, ph, pw

    def check_shapes(self) -> None:
        c = self.transformer.config
        if len(c.patch_size) != 3:
            raise FamilyConfigError(f"model.config.patch_size={list(c.patch_size)} must be 3 numbers (pt, ph, pw).")
        pt, ph, pw = self.latent_patch()
        if c.in_channels != self.in_channels:
            raise FamilyConfigError(
                f"model.config.in_channels={c.in_channels} does not match data.channels={self.in_channels}; "
                f"allowed: equal (the Wan 2.1 VAE has 16 latent channels, Wan 2.2's 48).")
        if (c.out_channels or c.in_channels) != self.in_channels:
            raise FamilyConfigError(f"model.config.out_channels={c.out_channels} must equal data.channels="
                                    f"{self.in_channels}: Wan predicts the latent itself.")
        self._check_video_patch()
        if max(self.frames // pt, self.input_size // ph, self.input_size // pw) > c.rope_max_seq_len:
            raise FamilyConfigError(f"model.config.rope_max_seq_len={c.rope_max_seq_len} is smaller than the token "
                                    f"grid {self.token_grid}; allowed: >= its largest side.")
        if c.image_dim is not None or c.added_kv_proj_dim is not None:
            raise FamilyConfigError(
                f"model.config.image_dim={c.image_dim} / added_kv_proj_dim={c.added_kv_proj_dim}: image-conditioned "
                f"Wan (I2V, CLIP image tokens) is not supported; allowed: null (text-to-video / TI2V models).")

    def check_grid(self, grid: Grid) -> None:
        """WanRotaryPosEmbed slices its rope_max_seq_len rows per axis: no side (frames included) may exceed it."""
        limit, (pt, ph, pw), (t, h, w) = self.transformer.config.rope_max_seq_len, self.latent_patch(), grid
        if max(grid) > limit:
            raise FamilyConfigError(
                f"model.family=wan: latents {h * ph}x{w * pw} x {t * pt} frames make a {h}x{w} x {t} token grid, "
                f"beyond the RoPE table (model.config.rope_max_seq_len={limit}); allowed: token grid sides (frames "
                f"included) <= {limit}.")

    def group_attention_modules(self) -> list[nn.Module]:
        return [block.attn1 for block in self.routable_blocks()]

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.blocks)

    # noise_level = t * 1000 is already Wan's convention (flow-matching sigma * 1000): the default timestep().

    def _text(self, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The text embeddings with masked positions zeroed (the Wan pipeline's padding convention)."""
        text, mask = cond["text"], cond.get("text_mask")
        if mask is None:
            return text
        return text * mask.to(text.dtype).unsqueeze(-1)

    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, B, grid = self.transformer, x.shape[0], self.grid_of(x)
        cos, sin = tr.rope(x)                                                        # (1, N, 1, Dh) each
        hidden = tr.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()       # (B, N, D)
        N = hidden.shape[1]
        timestep = self.token_timestep(timestep, N)
        per_tok = timestep.dim() == 2
        temb, proj, context, _ = tr.condition_embedder(timestep.flatten() if per_tok else timestep, self._text(cond),
                                                       None, timestep_seq_len=N if per_tok else None)
        per_token = {"rope_cos": cos.expand(B, -1, -1, -1), "rope_sin": sin.expand(B, -1, -1, -1)}
        extra: dict[str, Any] = {"temb": temb}
        if per_tok:
            per_token["timestep_proj"] = proj.unflatten(2, (6, -1))                  # (B, N, 6, D)
        else:
            extra["timestep_proj"] = proj.unflatten(1, (6, -1))                      # (B, 6, D)
        return Embedded(hidden, context, per_token, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        shared_proj = emb.extra.get("timestep_proj")

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                proj = tok["timestep_proj"] if shared_proj is None else shared_proj
                return block(x, context, cond32(proj), (tok["rope_cos"], tok["rope_sin"])), context
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr, temb = self.transformer, emb.extra["temb"]
        if temb.dim() == 3:     # per token (B, N, D)
            shift, scale = (tr.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:                   # per sample (B, D)
            shift, scale = (tr.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = (tr.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        return unpack_patches(tr.proj_out(x), emb.grid, self.latent_patch(), self.out_channels)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        T, h, w = self.grid_of(x)
        N = T * h * w
        return transformer(hidden_states=x, timestep=self.token_timestep(timestep, N),
                           encoder_hidden_states=self._text(cond), return_dict=False)[0]


FAMILY = WanFamily
PRESETS = WAN_PRESETS
