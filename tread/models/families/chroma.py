"""Chroma (diffusers ChromaTransformer2DModel, ChromaPipeline) with TREAD routing.

FLUX's block layout, RoPE and packing (imported from flux.py) with Chroma's pruned modulation (the
approximator's rows, sliced per block) and a boolean [text, image] attention mask (docs/families.md).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from tread.models.families.base import Embedded, RoutedFamily, cond32
from tread.models.families.flux import FluxFamily

_APPROX = dict(approximator_num_channels=64)

CHROMA_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 2 dual + 6 single blocks, width 64 (4 heads x 16), T5 stand-in of width 32,
    # a 2-layer approximator of width 32.
    "tiny": dict(patch_size=1, num_layers=2, num_single_layers=6, attention_head_dim=16, num_attention_heads=4,
                 joint_attention_dim=32, axes_dims_rope=[4, 6, 6], approximator_hidden_dim=32,
                 approximator_layers=2, **_APPROX),
    # A mid-size model for GPU benchmarks (~0.6B parameters): width 1536, 4 + 12 blocks, T5-XXL text width.
    "mid": dict(patch_size=1, num_layers=4, num_single_layers=12, attention_head_dim=128, num_attention_heads=12,
                joint_attention_dim=4096, axes_dims_rope=[16, 56, 56], approximator_hidden_dim=1536,
                approximator_layers=5, **_APPROX),
    # Chroma1-HD / Chroma1-Base geometry (8.9B; 16-channel FLUX VAE latents): load weights with model.pretrained.
    "chroma1-hd": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                       num_attention_heads=24, joint_attention_dim=4096, axes_dims_rope=[16, 56, 56],
                       approximator_hidden_dim=5120, approximator_layers=5, **_APPROX),
}


class ChromaFamily(RoutedFamily):
    family = "chroma"
    hub_hint = "lodestones/Chroma1-HD"
    diffusers_class = "ChromaTransformer2DModel"
    text_dim_key = "joint_attention_dim"
    pooled_dim_key = None            # T5 only: no pooled text embedding
    PACK = FluxFamily.PACK           # the pipeline packs 2x2 latent cells into one token, as FLUX's

    # FLUX's conventions, shared: 2x2 packing, ids (0, row, col) / zeros, processors, block order, t / 1000.
    data_config = classmethod(FluxFamily.data_config.__func__)
    latent_patch = FluxFamily.latent_patch
    pack, unpack = FluxFamily.pack, FluxFamily.unpack
    image_ids, text_ids = FluxFamily.image_ids, FluxFamily.text_ids
    install_processors = FluxFamily.install_processors
    blocks_of = FluxFamily.blocks_of
    timestep = FluxFamily.timestep

    def check_shapes(self) -> None:
        FluxFamily.check_shapes(self)   # the packed IO (patch_size 1, 4 x data channels, out_channels, even side), RoPE

    # -- the approximator's per-block modulation -------------------------------------------------------
    def modulation(self, pooled_temb: torch.Tensor, index: int) -> torch.Tensor:
        """The rows of pooled_temb (B, M, D) that block `index` (route index: dual blocks, then single) gets,
        sliced as ChromaTransformer2DModel.forward slices them: (B, 12, D) for a dual block, (B, 3, D) single."""
        tr = self.transformer
        D, S = len(tr.transformer_blocks), len(tr.single_transformer_blocks)
        if index >= D:
            j = 3 * (index - D)
            return pooled_temb[:, j:j + 3]
        img, txt = 3 * S + 6 * index, 3 * S + 6 * D + 6 * index
        return torch.cat([pooled_temb[:, img:img + 6], pooled_temb[:, txt:txt + 6]], dim=1)

    # -- the text mask ---------------------------------------------------------------------------------
    @staticmethod
    def attention_mask(text_mask: Optional[torch.Tensor], num_image: int) -> Optional[torch.Tensor]:
        """(B, L) keep-mask -> the (B, L + num_image) bool mask over [text, image] the blocks take; image tokens
        always attend (ChromaPipeline._prepare_attention_mask appends ones). None: no mask."""
        if text_mask is None:
            return None
        text_mask = text_mask.to(torch.bool)
        ones = torch.ones(text_mask.shape[0], num_image, dtype=torch.bool, device=text_mask.device)
        return torch.cat([text_mask, ones], dim=1)

    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, grid = self.transformer, self.grid_of(x)
        hidden = tr.x_embedder(self.pack(x))                                       # (B, N, D)
        t = timestep.to(hidden.dtype) * 1000
        pooled_temb = tr.distilled_guidance_layer(tr.time_text_embed(t))           # (B, M, D)
        context = tr.context_embedder(cond["text"])                                # (B, L, D)
        L, B, N = context.shape[1], x.shape[0], hidden.shape[1]
        cos, sin = tr.pos_embed(torch.cat([self.text_ids(L, x.device), self.image_ids(x.device, grid)]))
        per_token = {"rope_cos": cos[L:].unsqueeze(0).expand(B, N, -1),
                     "rope_sin": sin[L:].unsqueeze(0).expand(B, N, -1)}
        mask = cond.get("text_mask")
        extra = {"pooled_temb": pooled_temb, "text_cos": cos[:L], "text_sin": sin[:L],
                 "text_mask": None if mask is None else mask.to(device=x.device, dtype=torch.bool)}
        return Embedded(hidden, context, per_token, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        pooled_temb, text_mask = emb.extra["pooled_temb"], emb.extra["text_mask"]
        text_cos, text_sin = emb.extra["text_cos"], emb.extra["text_sin"]
        dual = len(self.transformer.transformer_blocks)

        def run(index: int, block: nn.Module) -> Callable[..., Any]:
            temb = self.modulation(pooled_temb, index)

            def fn(x: torch.Tensor, text: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                B, L, K = x.shape[0], text.shape[1], x.shape[1]
                rope = (torch.cat([text_cos.unsqueeze(0).expand(B, L, -1), tok["rope_cos"]], dim=1),
                        torch.cat([text_sin.unsqueeze(0).expand(B, L, -1), tok["rope_sin"]], dim=1))
                mask = self.attention_mask(text_mask, K)
                if index < dual:
                    text, x = block(hidden_states=x, encoder_hidden_states=text, temb=cond32(temb),
                                    image_rotary_emb=rope, attention_mask=mask)
                    return x, text
                h = block(hidden_states=torch.cat([text, x], dim=1), temb=cond32(temb), image_rotary_emb=rope,
                          attention_mask=mask)
                return h[:, L:], h[:, :L]
            return fn

        return [run(i, b) for i, b in enumerate(self.routable_blocks())]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr = self.transformer
        return self.unpack(tr.proj_out(tr.norm_out(x, emb.extra["pooled_temb"][:, -2:])), emb.grid)   # (B, C, H, W)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """diffusers' forward on the inputs ChromaPipeline builds: packed latents, ids, t / 1000, and the
        [text, image] attention mask (as booleans)."""
        L, grid = cond["text"].shape[1], self.grid_of(x)
        mask = cond.get("text_mask")
        mask = None if mask is None else self.attention_mask(mask.to(x.device), grid[1] * grid[2])
        out = transformer(hidden_states=self.pack(x), encoder_hidden_states=cond["text"], timestep=timestep,
                          img_ids=self.image_ids(x.device, grid), txt_ids=self.text_ids(L, x.device),
                          attention_mask=mask, return_dict=False)[0]
        return self.unpack(out, grid)


FAMILY = ChromaFamily
PRESETS = CHROMA_PRESETS
