"""FLUX (diffusers FluxTransformer2DModel) with TREAD routing, and FLUX Kontext (`kontext=True`).

Routes count over the double-stream blocks, then the single-stream blocks. The image RoPE rows are per-token
tensors gathered with the kept tokens; Kontext's reference tokens are never-routed context (docs/families.md).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from tread.models.families.base import (Embedded, FamilyConfigError, Grid, RoutedFamily, cond32, pack_cells,
                                        unpack_cells)

FLUX_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 2 double + 6 single blocks, width 64 (paper route = blocks 2..4).
    "tiny": dict(patch_size=1, num_layers=2, num_single_layers=6, attention_head_dim=16, num_attention_heads=4,
                 joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=[4, 6, 6]),
    # A mid-size model for GPU benchmarks (~0.6B parameters).
    "mid": dict(patch_size=1, num_layers=4, num_single_layers=12, attention_head_dim=128, num_attention_heads=12,
                joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=False,
                axes_dims_rope=[16, 56, 56]),
    # FLUX.1-dev / schnell geometry: load the weights with model.pretrained.
    "dev": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=[16, 56, 56]),
}


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """FLUX's real-valued RoPE on x (B, S, H, Dh) (interleaved pairs), with cos/sin (S, Dh) or (B, S, Dh)."""
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    cos, sin = cos.to(x.device), sin.to(x.device)
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class BatchedRopeFluxAttnProcessor:
    """FLUX attention (diffusers' FluxAttnProcessor maths) whose RoPE table may be per sample.

    image_rotary_emb: (cos, sin), each (S, Dh) shared or (B, S, Dh) per sample, S = text + image length.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None,
                 image_rotary_emb: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> Any:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        heads = lambda t: t.unflatten(-1, (-1, attn.head_dim))
        query, key, value = heads(query), heads(key), heads(value)
        query, key = attn.norm_q(query), attn.norm_k(key)
        if attn.added_kv_proj_dim is not None and encoder_hidden_states is not None:
            if getattr(attn, "fused_projections", False):
                eq, ek, ev = attn.to_added_qkv(encoder_hidden_states).chunk(3, dim=-1)
            else:
                eq, ek, ev = (attn.add_q_proj(encoder_hidden_states), attn.add_k_proj(encoder_hidden_states),
                              attn.add_v_proj(encoder_hidden_states))
            eq, ek, ev = heads(eq), heads(ek), heads(ev)
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            query, key, value = torch.cat([eq, query], 1), torch.cat([ek, key], 1), torch.cat([ev, value], 1)
        if image_rotary_emb is not None:
            cos, sin = image_rotary_emb
            query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is not None:
            text_len = encoder_hidden_states.shape[1]
            context, out = out[:, :text_len], out[:, text_len:]
            out = attn.to_out[1](attn.to_out[0](out.contiguous()))
            return out, attn.to_add_out(context.contiguous())
        return out


class FluxFamily(RoutedFamily):
    family = "flux"
    hub_hint = "black-forest-labs/FLUX.1-dev"
    diffusers_class = "FluxTransformer2DModel"
    text_dim_key = "joint_attention_dim"
    pooled_dim_key = "pooled_projection_dim"
    PACK = 2   # the FLUX pipeline packs 2x2 latent cells into one token
    takes_references = True
    reference_advice = "use model=flux_kontext (or model.kontext=true)"

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        return {"in_channels": in_channels * cls.PACK ** 2}

    def __init__(self, transformer: nn.Module, *, guidance: Optional[float] = None, kontext: bool = False,
                 **kwargs: Any):
        self.guidance = guidance
        if not isinstance(kontext, bool):
            raise FamilyConfigError(f"model.kontext={kontext!r} is not allowed; allowed: true or false.")
        self.kontext = kontext
        super().__init__(transformer, **kwargs)
        if transformer.config.guidance_embeds and guidance is None:
            raise FamilyConfigError("model.guidance must be set for a guidance-distilled FLUX (guidance_embeds: "
                                    "true), e.g. model.guidance=3.5 (FLUX.1-dev's default); got null.")

    def latent_patch(self) -> tuple[int, int, int]:
        p = self.PACK * int(self.transformer.config.patch_size)
        return 1, p, p

    def check_shapes(self) -> None:
        c = self.transformer.config
        self._check_packed_io(c, "FLUX")
        if sum(c.axes_dims_rope) != c.attention_head_dim:
            raise FamilyConfigError(f"model.config.axes_dims_rope={list(c.axes_dims_rope)} must sum to "
                                    f"attention_head_dim={c.attention_head_dim}.")

    def install_processors(self) -> None:
        for module in self.transformer.modules():
            if hasattr(module, "set_processor") and hasattr(module, "norm_q"):
                module.set_processor(BatchedRopeFluxAttnProcessor())

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

    # context parallelism: the joint attention of both block kinds; the text and its RoPE rows split with the image
    joint_text, text_rows = True, ("text_cos", "text_sin")

    def group_attention_modules(self) -> list[nn.Module]:
        return [block.attn for block in self.routable_blocks()]

    def timestep(self, noise_level: torch.Tensor) -> torch.Tensor:
        return noise_level / 1000.0   # diffusers' FLUX takes t in [0, 1] and scales by 1000 itself

    # -- packing and ids (the FLUX pipeline's conventions) -----------------------------------------
    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return pack_cells(x, self.PACK)

    def unpack(self, tokens: torch.Tensor, grid: Grid) -> torch.Tensor:
        """(B, N, C*2*2) with features ordered (C, 2, 2) on token grid (1, h, w) -> (B, C, 2h, 2w): pack's inverse."""
        _, h, w = grid
        return unpack_cells(tokens, h, w, self.PACK)

    def image_ids(self, device: torch.device, grid: Grid) -> torch.Tensor:
        """(h * w, 3) ids (0, row, col) of token grid (1, h, w), row-major: FluxPipeline._prepare_latent_image_ids
        (latent height / 2, latent width / 2)."""
        _, h, w = grid
        ids = torch.zeros(h, w, 3, device=device)
        ids[..., 1] = torch.arange(h, device=device)[:, None]
        ids[..., 2] = torch.arange(w, device=device)[None, :]
        return ids.reshape(h * w, 3)

    def text_ids(self, text_len: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(text_len, 3, device=device)

    def reference_ids(self, device: torch.device, grid: Grid) -> torch.Tensor:
        """Kontext's reference image ids: the target's grid with first coordinate 1 (FluxKontextPipeline)."""
        ids = self.image_ids(device, grid)
        ids[:, 0] = 1
        return ids

    # -- Kontext: the reference latents ---------------------------------------------------------------
    def _guidance(self, batch: int, device: torch.device) -> Optional[torch.Tensor]:
        if not self.transformer.config.guidance_embeds:
            return None
        return torch.full((batch,), float(self.guidance), device=device)

    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, grid = self.transformer, self.grid_of(x)
        hidden = tr.x_embedder(self.pack(x))                                       # (B, N, D)
        t = timestep.to(hidden.dtype) * 1000
        guidance = self._guidance(x.shape[0], x.device)
        temb = tr.time_text_embed(t, cond["pooled"]) if guidance is None else \
            tr.time_text_embed(t, guidance.to(hidden.dtype) * 1000, cond["pooled"])
        context = tr.context_embedder(cond["text"])                                # (B, L, D)
        L, B, N = context.shape[1], x.shape[0], hidden.shape[1]
        ids = [self.text_ids(L, x.device), self.image_ids(x.device, grid)]
        if self.kontext:
            ids.append(self.reference_ids(x.device, grid))
        cos, sin = tr.pos_embed(torch.cat(ids))                                    # (L+N[+N], Dh)
        per_token = {"rope_cos": cos[L:L + N].unsqueeze(0).expand(B, N, -1),
                     "rope_sin": sin[L:L + N].unsqueeze(0).expand(B, N, -1)}
        extra = {"temb": temb, "text_cos": cos[:L], "text_sin": sin[:L]}
        if self.kontext:   # never routed: the reference tokens travel with the text as context
            context = (context, tr.x_embedder(self.pack(cond["reference"])))      # (B, L, D), (B, N, D)
            extra.update(ref_cos=cos[L + N:], ref_sin=sin[L + N:])
        return Embedded(hidden, context, per_token, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        temb, text_cos, text_sin = emb.extra["temb"], emb.extra["text_cos"], emb.extra["text_sin"]
        ref_rope = (emb.extra["ref_cos"], emb.extra["ref_sin"]) if self.kontext else None

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: Any, tok: Mapping[str, torch.Tensor]):
                text, ref = context if ref_rope is not None else (context, None)
                B, L, K = x.shape[0], text.shape[1], x.shape[1]
                cos = [text_cos.unsqueeze(0).expand(B, L, -1), tok["rope_cos"]]
                sin = [text_sin.unsqueeze(0).expand(B, L, -1), tok["rope_sin"]]
                if ref is not None:   # [kept target, reference] through the image weights, like diffusers
                    cos.append(ref_rope[0].unsqueeze(0).expand(B, -1, -1))
                    sin.append(ref_rope[1].unsqueeze(0).expand(B, -1, -1))
                    x = torch.cat([x, ref], dim=1)
                text, x = block(hidden_states=x, encoder_hidden_states=text, temb=cond32(temb),
                                image_rotary_emb=(torch.cat(cos, dim=1), torch.cat(sin, dim=1)))
                return (x, text) if ref is None else (x[:, :K], (text, x[:, K:]))
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr = self.transformer
        return self.unpack(tr.proj_out(tr.norm_out(x, emb.extra["temb"])), emb.grid)   # (B, C, H, W)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """diffusers' forward; with kontext on the inputs as FluxKontextPipeline builds them: hidden states
        [target, reference], ids [target ids, reference ids], the output's target part kept."""
        L, grid = cond["text"].shape[1], self.grid_of(x)
        hidden, img_ids = self.pack(x), self.image_ids(x.device, grid)
        if self.kontext:
            hidden = torch.cat([hidden, self.pack(cond["reference"])], dim=1)
            img_ids = torch.cat([img_ids, self.reference_ids(x.device, grid)])
        out = transformer(hidden_states=hidden, encoder_hidden_states=cond["text"],
                          pooled_projections=cond["pooled"], timestep=timestep,
                          img_ids=img_ids, txt_ids=self.text_ids(L, x.device),
                          guidance=self._guidance(x.shape[0], x.device), return_dict=False)[0]
        return self.unpack(out[:, :grid[1] * grid[2]], grid)


FAMILY = FluxFamily
PRESETS = FLUX_PRESETS
