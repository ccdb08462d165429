"""ERNIE-Image (diffusers ErnieImageTransformer2DModel, ErnieImagePipeline) with TREAD routing.

One stream: every block runs on [image tokens, text tokens] with one shared AdaLN modulation (computed once per
forward from the timestep) and a key mask hiding the text padding. Routes count over `transformer.layers`; only
image tokens are routed, the text is never-routed context. The pipeline's prompt enhancer (`pe`) plays no part in
training. docs/families.md has the facts and where they are pinned.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.nn as nn

from tread.models.families.base import Embedded, FamilyConfigError, Grid, RoutedFamily, cond32, pack_cells, \
    unpack_cells

ERNIE_IMAGE_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 blocks, width 64 (4 heads x 16; RoPE axes 4 + 6 + 6), FFN 128, text width
    # 32 (the tiny Mistral3Model's).
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_layers=8, ffn_hidden_size=128, patch_size=1,
                 text_in_dim=32, rope_axes_dim=[4, 6, 6]),
    # A mid-size model for GPU benchmarks (~0.39B parameters): width 1536 (12 heads x 128, the released RoPE axes),
    # 12 blocks, FFN 3x width as released, Ministral-3 3B's text width 3072.
    "mid": dict(hidden_size=1536, num_attention_heads=12, num_layers=12, ffn_hidden_size=4608, patch_size=1,
                text_in_dim=3072, rope_axes_dim=[32, 48, 48]),
    # ERNIE-Image and ERNIE-Image-Turbo (baidu/ERNIE-Image*, ~8B): transformer/config.json as published (copies of
    # the hub file); 32-channel FLUX.2 VAE latents packed 2x2 to 128 channels. Weights: model.pretrained.
    "ernie-image": dict(hidden_size=4096, num_attention_heads=32, num_layers=36, ffn_hidden_size=12288,
                        in_channels=128, out_channels=128, patch_size=1, text_in_dim=3072, rope_theta=256,
                        rope_axes_dim=[32, 48, 48], eps=1e-6, qk_layernorm=True),
}


class ErnieImageFamily(RoutedFamily):
    family = "ernie_image"
    hub_hint = "baidu/ERNIE-Image"
    diffusers_class = "ErnieImageTransformer2DModel"
    text_dim_key = "text_in_dim"
    PACK = 2   # ErnieImagePipeline._patchify_latents: 2x2 latent cells -> 4C channels, features (C, 2, 2)
    # the layers diffusers' constructor zeroes (adaLN-Zero): the shared modulation's projection and the output layer
    ZEROED = ("adaLN_modulation.1", "final_linear")

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        packed = in_channels * cls.PACK ** 2
        return {"in_channels": packed, "out_channels": packed}

    @classmethod
    def init_fresh(cls, transformer: nn.Module) -> None:
        """Fresh weights: the zeroed layers get nn.Linear's default init. With diffusers' zeros every block starts as
        the identity (gate 0) and the output at 0, so dense, routed and diffusers' forwards agree trivially and only
        the output layer gets a gradient at step 0; CompVis/tread's DiT likewise redraws its zeroed layers."""
        for name in cls.ZEROED:
            transformer.get_submodule(name).reset_parameters()

    # -- geometry and checks ------------------------------------------------------------------------------
    def latent_patch(self) -> tuple[int, int, int]:
        return 1, self.PACK, self.PACK

    def check_shapes(self) -> None:
        c = self.transformer.config
        self._check_packed_io(c, "ERNIE-Image")
        axes, heads = list(c.rope_axes_dim), c.num_attention_heads
        head_dim = c.hidden_size // heads if c.hidden_size % heads == 0 else None
        if head_dim is None or len(axes) != 3 or any(a % 2 for a in axes) or sum(axes) > head_dim:
            raise FamilyConfigError(
                f"model.config.rope_axes_dim={axes} is not allowed with hidden_size={c.hidden_size} and "
                f"num_attention_heads={heads}; allowed: 3 even numbers (text position, row, column) summing to at most "
                f"the head dim hidden_size / num_attention_heads (a whole number).")

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.layers)

    @contextlib.contextmanager
    def shape_only(self) -> Iterator[None]:
        """For a count on the meta device: the RoPE table without rope()'s autocast guard, which the meta device
        does not take (_embed_nd_shapes: the same ops)."""
        embed = self.transformer.pos_embed
        embed.forward = functools.partial(_embed_nd_shapes, embed)
        try:
            yield
        finally:
            del embed.forward

    # -- packing (ErnieImagePipeline._patchify_latents / _unpatchify_latents) -------------------------------
    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> the pipeline's patchified latents (B, 4C, H/2, W/2), channels ordered (C, 2, 2)."""
        tokens = pack_cells(x, self.PACK)                                   # (B, h*w, 4C)
        B, _, H, W = x.shape
        return tokens.transpose(1, 2).reshape(B, -1, H // self.PACK, W // self.PACK)

    def unpack(self, tokens: torch.Tensor, grid: Grid) -> torch.Tensor:
        """(B, h*w, 4C) output tokens (the packed channels, row-major) -> (B, C, 2h, 2w)."""
        _, h, w = grid
        return unpack_cells(tokens, h, w, self.PACK)

    # -- text and positions (the transformer's forward) ----------------------------------------------------
    @staticmethod
    def text_rows(cond: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """(text (B, L, Dt) with each prompt's real rows first, valid (B, L) or None (no padding), lengths (B,)):
        what ErnieImagePipeline._pad_text gives (real rows, zero rows after them, text_lens)."""
        text, mask = cond["text"], cond.get("text_mask")
        B, L = text.shape[:2]
        if mask is None:
            return text, None, torch.full((B,), L, dtype=torch.long, device=text.device)
        order = torch.sort((~mask.bool()).to(torch.uint8), dim=1, stable=True).indices
        text = torch.gather(text, 1, order[..., None].expand_as(text))
        lengths = mask.sum(1).long()
        return text, torch.arange(L, device=text.device)[None, :] < lengths[:, None], lengths

    def image_ids(self, lengths: torch.Tensor, grid: Grid) -> torch.Tensor:
        """(B, N, 3) ids (text length of the sample, row, col), row-major."""
        _, h, w = grid
        dev, B = lengths.device, lengths.shape[0]
        rows = torch.arange(h, device=dev, dtype=torch.float32).repeat_interleave(w)
        cols = torch.arange(w, device=dev, dtype=torch.float32).repeat(h)
        ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).expand(B, -1, -1).clone()
        ids[..., 0] = lengths.float()[:, None]
        return ids

    @staticmethod
    def text_ids(length: int, device: torch.device) -> torch.Tensor:
        """(1, L, 3) ids (l, 0, 0): the text position on the first axis, the same for every sample."""
        ids = torch.zeros(1, length, 3, device=device)
        ids[..., 0] = torch.arange(length, device=device, dtype=torch.float32)
        return ids

    # -- the three steps ----------------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, grid = self.transformer, self.grid_of(x)
        text, valid, lengths = self.text_rows(cond)
        hidden = tr.x_embedder(self.pack(x))                                     # (B, N, D)
        context = tr.text_proj(text) if tr.text_proj is not None else text      # (B, L, D)
        c = tr.time_embedding(tr.time_proj(timestep).to(x.dtype))               # (B, D): sigma * 1000 as fed
        # the shared modulation, once per forward: (1, B, D) each, broadcast over the block's (S, B, D) sequence
        mods = [m.unsqueeze(0) for m in tr.adaLN_modulation(c).chunk(6, dim=-1)]
        rope = tr.pos_embed(self.image_ids(lengths, grid))                      # (B, N, 1, head_dim)
        extra = {"c": c, "mods": mods, "text_rope": tr.pos_embed(self.text_ids(text.shape[1], x.device)),
                 "text_valid": valid}
        return Embedded(hidden, context, {"rope": rope}, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        mods, text_rope, valid = emb.extra["mods"], emb.extra["text_rope"], emb.extra["text_valid"]

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                B, K = x.shape[:2]
                seq = torch.cat([x, context], 1).transpose(0, 1)                 # [kept image, text], (S, B, D)
                rope = torch.cat([tok["rope"], text_rope.expand(B, -1, -1, -1)], 1)
                mask = None if valid is None else torch.cat([valid.new_ones(B, K), valid], 1)[:, None, None, :]
                out = block(seq, rope, [cond32(m) for m in mods], mask).transpose(0, 1)
                return out[:, :K], out[:, K:]
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr = self.transformer
        h = x.transpose(0, 1)                                                    # final_norm broadcasts over (S, B, D)
        out = tr.final_linear(tr.final_norm(h, emb.extra["c"]).type_as(h)).transpose(0, 1)
        return self.unpack(out, emb.grid)                                        # velocity noise - x0, as fed

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """diffusers' forward on ErnieImagePipeline's inputs, built with the pipeline's own helpers: its
        _patchify_latents, each prompt's real rows (the mask's, in order) through its _pad_text (zero rows up to the
        batch's longest, text_lens), t = sigma * 1000 as fed; the output through its _unpatchify_latents."""
        from diffusers import ErnieImagePipeline   # deferred: diffusers (and transformers) are optional

        text, mask = cond["text"], cond.get("text_mask")
        rows = list(text) if mask is None else [t[m.bool()] for t, m in zip(text, mask)]
        text_bth, text_lens = ErnieImagePipeline._pad_text(rows, x.device, x.dtype, transformer.config.text_in_dim)
        out = transformer(hidden_states=ErnieImagePipeline._patchify_latents(x), timestep=timestep, text_bth=text_bth,
                          text_lens=text_lens, return_dict=False)[0]              # (B, 4C, h, w)
        return ErnieImagePipeline._unpatchify_latents(out)

def _embed_nd_shapes(embed: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ErnieImageEmbedND3.forward with its rope() inlined but no autocast guard: the same ops, value-free."""
    parts = []
    for i, dim in enumerate(embed.axes_dim):
        omega = 1.0 / embed.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=ids.device) / dim)
        parts.append(torch.einsum("...n,d->...nd", ids[..., i], omega).float())
    emb = torch.cat(parts, dim=-1).unsqueeze(2)
    return torch.stack([emb, emb], dim=-1).reshape(*emb.shape[:-1], -1)


FAMILY = ErnieImageFamily
PRESETS = ERNIE_IMAGE_PRESETS
