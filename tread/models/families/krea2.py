"""Krea 2 (diffusers Krea2Transformer2DModel, Krea2Pipeline) with TREAD routing: text-to-image.

One single-stream sequence [text, image] through every block (full attention, a key mask over the text padding).
The text fusion (Krea2TextFusion: per-token attention across the 12 tapped encoder layers, a projector collapsing
them, then refiner blocks over the text sequence) and txt_in run on the text alone before the blocks and are never
routed; routes count over transformer_blocks and drop image tokens only, each kept token with its own RoPE row
(text rows are all-zero ids). The data stores the tapped hidden states flattened: text (L, num_text_layers x
text_hidden_dim), unflattened here (docs/families.md).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _checkpoint

from tread.models.families.base import (Embedded, FamilyConfigError, Grid, RoutedFamily, cond32, pack_cells,
                                        unpack_cells)
from tread.models.families.flux import _rotate

_FUSION = dict(num_text_layers=12, num_layerwise_text_blocks=2, num_refiner_text_blocks=2)
# Qwen3-VL-4B-Instruct's text width and Krea 2's fusion blocks (Krea2Transformer2DModel's defaults)
_QWEN3_VL_4B = dict(text_hidden_dim=2560, text_num_attention_heads=20, text_num_key_value_heads=20,
                    text_intermediate_size=6912, **_FUSION)

KREA2_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 blocks, width 64 (4 query heads x 16, 2 key/value heads: GQA as released),
    # the 12 tapped layers of a 32-wide Qwen3-VL stand-in (tiny_text's 36-layer encoder: the pipeline's own taps).
    "tiny": dict(num_layers=8, attention_head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, timestep_embed_dim=32, text_hidden_dim=32, text_num_attention_heads=4,
                 text_num_key_value_heads=2, text_intermediate_size=64, axes_dims_rope=(4, 6, 6), **_FUSION),
    # A mid-size model for GPU benchmarks (~0.5B parameters, ~0.35B of it the full-width text fusion): width 1024
    # (8 heads x 128, 2 key/value heads), 12 blocks, Krea 2's RoPE axes, on the real Qwen3-VL-4B taps (2560 x 12).
    "mid": dict(num_layers=12, attention_head_dim=128, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=2816, axes_dims_rope=(32, 48, 48), **_QWEN3_VL_4B),
    # krea/Krea-2-Raw and krea/Krea-2-Turbo (12.8B parameters as built; one geometry, Turbo the step-distilled one):
    # Krea2Transformer2DModel's defaults (transformer_krea2.py: 28 blocks at width 6144, Qwen3-VL-4B tapped at 12
    # layers; the checkpoints' config.json could not be read offline); 16-channel Qwen-Image VAE latents x 2 x 2.
    "krea2": dict(in_channels=64, num_layers=28, attention_head_dim=128, num_attention_heads=48, num_key_value_heads=12,
                  intermediate_size=16384, timestep_embed_dim=256, axes_dims_rope=(32, 48, 48), rope_theta=1000.0,
                  norm_eps=1e-5, **_QWEN3_VL_4B),
}


def _heads_error(key: str, heads: int, width: int, kv_key: str, kv: int) -> Optional[str]:
    if heads < 1 or width % heads:
        return f"model.config.{key}={heads} must divide the width {width} (diffusers' Krea2Attention)."
    if kv < 1 or heads % kv:
        return (f"model.config.{kv_key}={kv} must divide {key}={heads}: grouped-query attention repeats each "
                f"key/value head {key} / {kv_key} times.")
    return None


class BatchedRopeKrea2AttnProcessor:
    """diffusers' Krea2AttnProcessor (GQA, q/k RMSNorm, sigmoid output gate), same maths and calls, whose RoPE table
    (cos, sin) may be per sample: (S, Dh) shared or (B, S, Dh)."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 image_rotary_emb: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn   # deferred: diffusers is optional

        query = attn.to_q(hidden_states).unflatten(-1, (attn.num_heads, attn.head_dim))
        key = attn.to_k(hidden_states).unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        value = attn.to_v(hidden_states).unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        gate = attn.to_gate(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            cos, sin = image_rotary_emb
            query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        groups = attn.num_heads // attn.num_kv_heads
        if groups > 1:   # as diffusers: repeated heads rather than enable_gqa (a mask is always possible)
            key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        return attn.to_out[0](out.flatten(2, 3) * torch.sigmoid(gate))


class Krea2Family(RoutedFamily):
    family = "krea2"
    hub_hint = "krea/Krea-2-Raw"
    diffusers_class = "Krea2Transformer2DModel"
    text_dim_key = "text_hidden_dim"   # the data's text is num_text_layers x this wide (text_dim)
    PACK = 2   # Krea2Pipeline(patch_size=2), its default and the released in_channels 64 = 16 x 2 x 2
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "to_gate")

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        """in_channels = 4 x data.channels (the transformer has no out_channels / sample_size keys). Also checks
        here, with a FamilyConfigError, what diffusers' constructors would only raise as ValueError: the RoPE axes
        against the head dim and the head counts against the widths."""
        c = {**_DEFAULTS, **diffusers_config}
        head, heads = int(c["attention_head_dim"]), int(c["num_attention_heads"])
        axes = list(c["axes_dims_rope"])
        if len(axes) != 3 or sum(axes) != head or any(a % 2 for a in axes):
            raise FamilyConfigError(f"model.config.axes_dims_rope={axes} must be 3 even numbers summing to "
                                    f"attention_head_dim={head} (RoPE on the (t, h, w) ids, pair by pair).")
        for error in (_heads_error("num_attention_heads", heads, head * heads, "num_key_value_heads",
                                   int(c["num_key_value_heads"])),
                      _heads_error("text_num_attention_heads", int(c["text_num_attention_heads"]),
                                   int(c["text_hidden_dim"]), "text_num_key_value_heads",
                                   int(c["text_num_key_value_heads"]))):
            if error:
                raise FamilyConfigError(error)
        return {"in_channels": in_channels * cls.PACK ** 2}

    # -- geometry and checks ----------------------------------------------------------------------------
    @property
    def text_dim(self) -> int:
        c = self.transformer.config
        return int(c.num_text_layers * c.text_hidden_dim)

    def latent_patch(self) -> tuple[int, int, int]:
        return 1, self.PACK, self.PACK

    def check_shapes(self) -> None:
        c, C = self.transformer.config, self.in_channels
        if c.in_channels != C * self.PACK ** 2:
            raise FamilyConfigError(
                f"model.config.in_channels={c.in_channels} does not fit data.channels={C}: Krea2Pipeline packs 2x2 "
                f"latent cells into one token (patch_size 2), so in_channels must be 4 x data.channels = {4 * C} "
                f"(released: 64 for the 16-channel Qwen-Image VAE).")
        if self.input_size % self.PACK:
            raise FamilyConfigError(f"data.resolution={self.input_size} must be even: Krea 2 packs 2x2 latent cells.")
        if c.num_layers < 1 or c.num_text_layers < 1:
            raise FamilyConfigError(f"model.config.num_layers={c.num_layers}, num_text_layers={c.num_text_layers}: "
                                    f"both must be at least 1.")

    def check_text_data(self, conditioning: Mapping[str, Any], where: str) -> None:
        text, c = conditioning.get("text"), self.transformer.config
        if text is not None and int(text[1]) != self.text_dim:
            raise FamilyConfigError(
                f"the text embeddings of the data at {where} are {text[1]} wide, but Krea 2 takes num_text_layers x "
                f"text_hidden_dim = {c.num_text_layers} x {c.text_hidden_dim} = {self.text_dim} (the tapped Qwen3-VL "
                f"layers, flattened): encode the captions with this model's text encoder (--text-family krea2), or "
                f"set model.config.num_text_layers / text_hidden_dim to fit for a fresh model.")
        super().check_text_data(conditioning, where)

    def install_processors(self) -> None:
        for block in self.blocks_of(self.transformer):
            block.attn.set_processor(BatchedRopeKrea2AttnProcessor())

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def timestep(self, noise_level: torch.Tensor) -> torch.Tensor:
        return noise_level / 1000.0   # the pipeline feeds t / num_train_timesteps; Krea2TimestepEmbedding x 1000

    # -- the pipeline's inputs ----------------------------------------------------------------------------
    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return pack_cells(x, self.PACK)   # Krea2Pipeline._pack_latents: (C, 2, 2) features, row-major

    def stacked_text(self, cond: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(B, L, K * D) data text -> the pipeline's prompt_embeds (B, L, K, D), and its bool mask (or None)."""
        c, mask = self.transformer.config, cond.get("text_mask")
        text = cond["text"].unflatten(-1, (c.num_text_layers, c.text_hidden_dim))
        return text, None if mask is None else mask.to(device=text.device, dtype=torch.bool)

    def image_ids(self, grid: Grid, device: torch.device) -> torch.Tensor:
        """(h * w, 3) RoPE ids (0, row, col), row-major (Krea2Pipeline.prepare_position_ids' image rows)."""
        _, h, w = grid
        ids = torch.zeros(h, w, 3, device=device)
        ids[..., 1] = torch.arange(h, device=device)[:, None]
        ids[..., 2] = torch.arange(w, device=device)[None, :]
        return ids.reshape(h * w, 3)

    def _fuse(self, text: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Krea2TextFusion then txt_in on the text alone (never routed); recomputed in backward with checkpointing."""
        tr, key_mask = self.transformer, None if mask is None else mask[:, None, None, :]
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return tr.txt_in(_checkpoint(tr.text_fusion, text, key_mask, use_reentrant=False))
        return tr.txt_in(tr.text_fusion(text, attention_mask=key_mask))

    # -- the three steps ----------------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, grid = self.transformer, self.grid_of(x)
        text, mask = self.stacked_text(cond)
        hidden = tr.img_in(self.pack(x))                                           # (B, N, D)
        temb = tr.time_embed(timestep, dtype=hidden.dtype)                         # (B, 1, D)
        context = self._fuse(text, mask)                                           # (B, L, D)
        (B, N), L = hidden.shape[:2], context.shape[1]
        ids = torch.cat([torch.zeros(L, 3, device=x.device), self.image_ids(grid, x.device)])
        cos, sin = tr.rotary_emb(ids)                                              # (L + N, Dh)
        per_token = {"rope_cos": cos[L:].unsqueeze(0).expand(B, N, -1),
                     "rope_sin": sin[L:].unsqueeze(0).expand(B, N, -1)}
        extra = {"temb": temb, "temb_mod": tr.time_mod_proj(F.gelu(temb, approximate="tanh")),
                 "text_cos": cos[:L], "text_sin": sin[:L], "mask": mask}
        return Embedded(hidden, context, per_token, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        e = emb.extra
        text_cos, text_sin, mask = e["text_cos"], e["text_sin"], e["mask"]

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                (B, K), L = x.shape[:2], context.shape[1]
                rope = (torch.cat([text_cos.unsqueeze(0).expand(B, L, -1), tok["rope_cos"]], dim=1),
                        torch.cat([text_sin.unsqueeze(0).expand(B, L, -1), tok["rope_sin"]], dim=1))
                keys = None if mask is None else torch.cat([mask, mask.new_ones(B, K)], dim=1)[:, None, None, :]
                out = block(torch.cat([context, x], dim=1), cond32(e["temb_mod"]), rope, keys)
                return out[:, L:], out[:, :L]
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        _, h, w = emb.grid
        out = self.transformer.final_layer(x, cond32(emb.extra["temb"]))           # (B, N, C*2*2)
        return unpack_cells(out, h, w, self.PACK)                                  # (B, C, H, W)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """diffusers' forward on Krea2Pipeline's inputs: packed latents, prompt_embeds (B, L, K, D) and its mask, t /
        1000, the pipeline's own prepare_position_ids; its velocity is the pipeline's noise_pred (no sign change)."""
        from diffusers import Krea2Pipeline   # deferred: diffusers (and transformers) are optional

        text, mask = self.stacked_text(cond)
        _, h, w = self.grid_of(x)
        ids = Krea2Pipeline.prepare_position_ids(text.shape[1], h, w, x.device)
        out = transformer(hidden_states=self.pack(x), encoder_hidden_states=text, timestep=timestep,
                          position_ids=ids, encoder_attention_mask=mask, return_dict=False)[0]
        return unpack_cells(out, h, w, self.PACK)


# Krea2Transformer2DModel's defaults for the keys data_config checks (a preset or override may leave them out).
_DEFAULTS = dict(attention_head_dim=128, num_attention_heads=48, num_key_value_heads=12, axes_dims_rope=(32, 48, 48),
                 text_hidden_dim=2560, text_num_attention_heads=20, text_num_key_value_heads=20)

FAMILY = Krea2Family
PRESETS = KREA2_PRESETS
