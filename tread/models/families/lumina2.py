"""Lumina-Image 2.0 (diffusers Lumina2Transformer2DModel) with TREAD routing.

Routes count over `transformer.layers`; both refiners run before them on all tokens. The joint sequence is
[padded caption, kept image tokens] with a key mask (docs/families.md, "Implementation notes").
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from tread.models.families.base import Embedded, FamilyConfigError, Grid, RoutedFamily, cond32, unpack_patches

LUMINA2_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 joint layers (+ 2 never-routed refiners each side), width 64 (4 heads x 16,
    # 2 key/value heads: GQA), a Gemma-2 stand-in of width 32.
    "tiny": dict(patch_size=2, hidden_size=64, num_layers=8, num_refiner_layers=2, num_attention_heads=4,
                 num_kv_heads=2, multiple_of=16, cap_feat_dim=32, axes_dim_rope=(4, 6, 6)),
    # A mid-size model for GPU benchmarks (~0.65B parameters): width 1536 (12 heads x 128, 4 kv heads), 12 joint
    # layers, Gemma-2-2B text width.
    "mid": dict(patch_size=2, hidden_size=1536, num_layers=12, num_refiner_layers=2, num_attention_heads=12,
                num_kv_heads=4, multiple_of=256, cap_feat_dim=2304, axes_dim_rope=(32, 48, 48)),
    # Lumina-Image-2.0 (Alpha-VLLM/Lumina-Image-2.0, transformer/config.json): 16-channel latents; model.pretrained.
    "lumina-image-2": dict(sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_layers=26,
                           num_refiner_layers=2, num_attention_heads=24, num_kv_heads=8, multiple_of=256,
                           ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(32, 32, 32),
                           axes_lens=(300, 512, 512), cap_feat_dim=2304),
}


class Lumina2Family(RoutedFamily):
    family = "lumina2"
    hub_hint = "Alpha-VLLM/Lumina-Image-2.0"
    diffusers_class = "Lumina2Transformer2DModel"
    text_dim_key = "cap_feat_dim"

    def check_shapes(self) -> None:
        c = self.transformer.config
        # RoutedFamily._check_patch_io's checks, written out: it also reads attention_head_dim, a key Lumina2 lacks
        if c.in_channels != self.in_channels:
            raise FamilyConfigError(f"model.config.in_channels={c.in_channels} must equal data.channels="
                                    f"{self.in_channels} (Lumina-Image-2.0 uses 16-channel VAE latents).")
        if (c.out_channels or c.in_channels) != self.in_channels:
            raise FamilyConfigError(f"model.config.out_channels={c.out_channels} must equal data.channels="
                                    f"{self.in_channels}: the model predicts a latent of the input's shape.")
        if self.input_size % c.patch_size:
            raise FamilyConfigError(f"data.resolution={self.input_size} must be a multiple of model.config."
                                    f"patch_size={c.patch_size}.")
        if c.num_layers < 1:
            raise FamilyConfigError(f"model.config.num_layers={c.num_layers}: Lumina2 needs at least one joint layer "
                                    f"(only there do the caption and the image meet); allowed: an integer >= 1.")
        if c.hidden_size % c.num_attention_heads:
            raise FamilyConfigError(f"model.config.hidden_size={c.hidden_size} must be a multiple of "
                                    f"num_attention_heads={c.num_attention_heads} (head dim = hidden_size / heads).")
        if c.num_kv_heads is None or c.num_kv_heads < 1 or c.num_attention_heads % c.num_kv_heads:
            raise FamilyConfigError(f"model.config.num_kv_heads={c.num_kv_heads} must divide num_attention_heads="
                                    f"{c.num_attention_heads} (grouped-query attention).")
        head_dim = c.hidden_size // c.num_attention_heads
        axes = list(c.axes_dim_rope)
        if len(axes) != 3 or sum(axes) != head_dim or any(d % 2 for d in axes):
            raise FamilyConfigError(f"model.config.axes_dim_rope={axes} must be 3 even sizes summing to the head dim "
                                    f"hidden_size / num_attention_heads = {head_dim} (RoPE on caption index, row, "
                                    f"column).")
        side = self.input_size // c.patch_size
        if side > min(c.axes_lens[1], c.axes_lens[2]):
            raise FamilyConfigError(f"model.config.axes_lens={list(c.axes_lens)}: the {side}x{side} token grid needs "
                                    f"axes_lens[1] and axes_lens[2] >= {side} (RoPE table rows).")

    def check_grid(self, grid: Grid) -> None:
        """Lumina2RotaryPosEmbed looks rows and columns up in tables of axes_lens[1] / axes_lens[2] positions."""
        _, h, w = grid
        c = self.transformer.config
        if h > c.axes_lens[1] or w > c.axes_lens[2]:
            raise FamilyConfigError(
                f"model.family=lumina2: latents {h * c.patch_size}x{w * c.patch_size} make a {h}x{w} token grid, "
                f"beyond the RoPE tables (model.config.axes_lens={list(c.axes_lens)}); allowed: rows <= "
                f"axes_lens[1]={c.axes_lens[1]} and columns <= axes_lens[2]={c.axes_lens[2]}.")

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.layers)   # the refiners run before, in embed: never routed

    def timestep(self, noise_level: torch.Tensor) -> torch.Tensor:
        return noise_level / 1000.0   # sigma; the transformer gets 1 - sigma (Lumina2Pipeline), see embed

    # -- patches and positions -------------------------------------------------------------------------
    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, h*w, p*p*C), features ordered (p_row, p_col, C) as Lumina2RotaryPosEmbed.forward."""
        B, C, H, W = x.shape
        p = int(self.transformer.config.patch_size)
        return x.view(B, C, H // p, p, W // p, p).permute(0, 2, 4, 3, 5, 1).flatten(3).flatten(1, 2)

    def rope(self, cap_len: torch.Tensor, L: int, grid: tuple[int, int], device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cap_len (B,), padded caption length L, token grid (h, w) -> (caption rows (B, L, Dh/2), image rows
        (B, h*w, Dh/2), caption keep-mask (B, L)), looked up in diffusers' tables."""
        tr = self.transformer
        if L >= tr.config.axes_lens[0]:
            raise FamilyConfigError(f"text of {L} tokens needs model.config.axes_lens[0] > {L} (it is "
                                    f"{tr.config.axes_lens[0]}): the image's first RoPE id is the caption length.")
        h, w = grid
        B, N = cap_len.shape[0], h * w
        pos = torch.arange(L, device=device)
        valid = pos[None, :] < cap_len[:, None]                                   # (B, L)
        cap_ids = torch.zeros(B, L, 3, dtype=torch.long, device=device)
        cap_ids[..., 0] = torch.where(valid, pos[None, :], 0)
        img_ids = torch.stack([cap_len[:, None].expand(B, N),
                               torch.arange(h, device=device).repeat_interleave(w)[None].expand(B, N),
                               torch.arange(w, device=device).repeat(h)[None].expand(B, N)], dim=-1)
        freqs = tr.rope_embedder._get_freqs_cis(torch.cat([cap_ids, img_ids], dim=1))   # (B, L+N, Dh/2) complex
        cap = torch.where(valid[..., None], freqs[:, :L], torch.zeros((), dtype=freqs.dtype, device=device))
        return cap, freqs[:, L:], valid

    # -- the three steps ---------------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr = self.transformer
        text, mask = cond["text"], cond.get("text_mask")
        B, L = text.shape[:2]
        # Lumina2Pipeline: timestep = 1 - sigma (t = 1 is the image)
        temb, caption = tr.time_caption_embed(x, 1 - timestep, text)              # (B, Dt), (B, L, D)
        mask = None if mask is None else mask.to(device=x.device, dtype=torch.bool)
        cap_len = torch.full((B,), L, device=x.device) if mask is None else mask.sum(dim=1)
        grid = self.grid_of(x)
        cap_rope, img_rope, valid = self.rope(cap_len, L, grid[1:], x.device)
        hidden = tr.x_embedder(self.patchify(x))                                  # (B, N, D)
        for layer in tr.context_refiner:          # never routed: the caption alone, with its own mask
            caption = layer(caption, mask, cap_rope)
        for layer in tr.noise_refiner:            # never routed: all image tokens
            hidden = layer(hidden, None, img_rope, temb)
        if mask is not None:                      # padding rows: hidden from every query below; no NaN carried
            caption = torch.where(valid[..., None], caption, torch.zeros((), dtype=caption.dtype, device=x.device))
        extra = {"temb": temb, "cap_rope": cap_rope, "cap_valid": None if mask is None else valid}
        return Embedded(hidden, caption, {"rope": img_rope}, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        temb, cap_rope, cap_valid = emb.extra["temb"], emb.extra["cap_rope"], emb.extra["cap_valid"]

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                L, K = context.shape[1], x.shape[1]
                mask = None
                if cap_valid is not None:   # [caption keep-mask, all (kept) image tokens]
                    mask = torch.cat([cap_valid, cap_valid.new_ones(cap_valid.shape[0], K)], dim=1)
                h = block(torch.cat([context, x], dim=1), mask, torch.cat([cap_rope, tok["rope"]], dim=1),
                          cond32(temb))
                return h[:, L:], h[:, :L]
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr = self.transformer
        out = unpack_patches(tr.norm_out(x, emb.extra["temb"]), emb.grid, self.latent_patch(),
                             tr.out_channels).squeeze(2)
        return -out   # Lumina predicts x0 - noise (the pipeline steps with -noise_pred); we predict noise - x0

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """diffusers' forward as Lumina2Pipeline calls it: timestep 1 - sigma, the text's attention mask (all ones
        without one), the prediction negated."""
        text, mask = cond["text"], cond.get("text_mask")
        if mask is None:
            mask = torch.ones(text.shape[:2], dtype=torch.long, device=text.device)
        out = transformer(hidden_states=x, timestep=1 - timestep, encoder_hidden_states=text,
                          encoder_attention_mask=mask, return_dict=False)[0]
        return -out


FAMILY = Lumina2Family
PRESETS = LUMINA2_PRESETS
