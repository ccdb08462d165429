"""Qwen-Image and Qwen-Image-Edit (diffusers QwenImageTransformer2DModel) with TREAD routing.

Routes count over the dual-stream blocks; the image RoPE rows (and `zero_cond_t`'s modulation index) are
per-token tensors, the text and edit image never-routed context (docs/families.md).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from tread.models.families.base import (Embedded, FamilyConfigError, Grid, RoutedFamily, cond32, pack_cells,
                                        unpack_cells)

_ROPE = dict(axes_dims_rope=(16, 56, 56))

QWEN_IMAGE_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: 8 dual-stream blocks, width 64 (4 heads x 16), Qwen2.5-VL stand-in width 32.
    "tiny": dict(patch_size=2, num_layers=8, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                 axes_dims_rope=(4, 6, 6)),
    # A mid-size model for GPU benchmarks (~0.46B parameters): width 1024, 12 blocks, Qwen2.5-VL-7B text width.
    "mid": dict(patch_size=2, num_layers=12, attention_head_dim=128, num_attention_heads=8, joint_attention_dim=3584,
                **_ROPE),
    # Qwen/Qwen-Image geometry (diffusers' class defaults; 16-channel Qwen-Image VAE latents): model.pretrained.
    "qwen-image": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                       num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, **_ROPE),
    # Qwen/Qwen-Image-Edit-2511 geometry: the same with zero_cond_t (t = 0 modulation of the conditioning image).
    "qwen-image-edit-2511": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                                 num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                                 zero_cond_t=True, **_ROPE),
}


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers' apply_rotary_emb_qwen(use_real=False) on x (B, S, H, Dh) with complex freqs (S, Dh/2) shared by the
    batch or (B, S, Dh/2) per sample."""
    freqs = freqs[None, :, None, :] if freqs.dim() == 2 else freqs[:, :, None, :]
    rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(rotated * freqs.to(x.device)).flatten(3).type_as(x)


class BatchedRopeQwenAttnProcessor:
    """Qwen-Image joint attention (diffusers' QwenDoubleStreamAttnProcessor2_0 maths) whose image RoPE table may be
    per sample: image_rotary_emb = (img_freqs (S_img or B x S_img, Dh/2), txt_freqs (L, Dh/2)), complex."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 encoder_hidden_states_mask: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None,
                 image_rotary_emb: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> Any:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if encoder_hidden_states is None or attention_mask is not None:
            raise ValueError("BatchedRopeQwenAttnProcessor needs encoder_hidden_states and no attention_mask "
                             "(the joint mask is built from encoder_hidden_states_mask), as diffusers' processor.")
        if encoder_hidden_states_mask is not None:
            image_mask = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
            attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
        head_dim = attn.inner_dim // attn.heads
        heads = lambda t: t.unflatten(-1, (-1, head_dim))
        img_q, img_k, img_v = (heads(p(hidden_states)) for p in (attn.to_q, attn.to_k, attn.to_v))
        txt_q, txt_k, txt_v = (heads(p(encoder_hidden_states)) for p in (attn.add_q_proj, attn.add_k_proj,
                                                                           attn.add_v_proj))
        if attn.norm_q is not None:
            img_q = attn.norm_q(img_q)
        if attn.norm_k is not None:
            img_k = attn.norm_k(img_k)
        if attn.norm_added_q is not None:
            txt_q = attn.norm_added_q(txt_q)
        if attn.norm_added_k is not None:
            txt_k = attn.norm_added_k(txt_k)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_q, img_k = _rotate(img_q, img_freqs), _rotate(img_k, img_freqs)
            txt_q, txt_k = _rotate(txt_q, txt_freqs), _rotate(txt_k, txt_freqs)
        query, key = torch.cat([txt_q, img_q], dim=1), torch.cat([txt_k, img_k], dim=1)
        value = torch.cat([txt_v, img_v], dim=1)
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend, parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        seq_txt = encoder_hidden_states.shape[1]
        img_out = attn.to_out[0](out[:, seq_txt:].contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(out[:, :seq_txt].contiguous())


class QwenImageFamily(RoutedFamily):
    family = "qwen_image"
    hub_hint = "Qwen/Qwen-Image"
    diffusers_class = "QwenImageTransformer2DModel"
    text_dim_key = "joint_attention_dim"
    PACK = 2   # QwenImagePipeline packs 2x2 latent cells into one token
    takes_references = True

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        return {"in_channels": in_channels * cls.PACK ** 2, "out_channels": in_channels}

    def __init__(self, transformer: nn.Module, *, kontext: bool = False, **kwargs: Any):
        if not isinstance(kontext, bool):
            raise FamilyConfigError(f"model.kontext={kontext!r} is not allowed; allowed: true or false.")
        self.kontext = kontext   # model.kontext: the key FLUX Kontext and FLUX.2 use for the same reference latents
        super().__init__(transformer, **kwargs)

    @property
    def zero_cond_t(self) -> bool:
        return bool(self.transformer.config.zero_cond_t)

    def latent_patch(self) -> tuple[int, int, int]:
        return 1, self.PACK, self.PACK

    def check_shapes(self) -> None:
        c, C = self.transformer.config, self.in_channels
        if c.patch_size != self.PACK:
            raise FamilyConfigError(f"model.config.patch_size={c.patch_size} is not allowed; allowed: 2 (the "
                                    f"Qwen-Image pipeline packs 2x2 latent cells per token and unpacks proj_out's "
                                    f"2*2*out_channels features the same way).")
        if c.in_channels != C * self.PACK ** 2:
            raise FamilyConfigError(
                f"model.config.in_channels={c.in_channels} does not fit data.channels={C}: Qwen-Image packs 2x2 latent "
                f"cells into one token, so in_channels must be 4 x data.channels = {4 * C} (released model: 64 for the "
                f"16-channel Qwen-Image VAE).")
        if (c.out_channels or c.in_channels) != C:
            raise FamilyConfigError(f"model.config.out_channels={c.out_channels} must equal data.channels={C}: the "
                                    f"model predicts a latent of the input's shape (2x2 packed).")
        if self.input_size % self.PACK:
            raise FamilyConfigError(f"data.resolution={self.input_size} must be even: Qwen-Image packs 2x2 latent "
                                    f"cells.")
        axes = list(c.axes_dims_rope)
        if len(axes) != 3 or sum(axes) != c.attention_head_dim:
            raise FamilyConfigError(f"model.config.axes_dims_rope={axes} must be 3 even numbers summing to "
                                    f"attention_head_dim={c.attention_head_dim}.")
        if c.guidance_embeds:
            raise FamilyConfigError("model.config.guidance_embeds=true is not allowed; allowed: false (diffusers' "
                                    "QwenImageTransformer2DModel builds no guidance embedder and its forward cannot "
                                    "take a guidance value; the released Qwen-Image models have false).")
        for key in ("use_additional_t_cond", "use_layer3d_rope"):
            if c.get(key):
                raise FamilyConfigError(f"model.config.{key}=true (Qwen-Image-Layered) is not supported; allowed: "
                                        f"false (its layer stacks are not this trainer's data).")

    def install_processors(self) -> None:
        for block in self.blocks_of(self.transformer):
            block.attn.set_processor(BatchedRopeQwenAttnProcessor())

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    # context parallelism: joint attention; the text, its RoPE rows and its mask split with the image tokens
    joint_text, text_rows, text_columns = True, ("txt_freqs",), ("mask",)

    def group_attention_modules(self) -> list[nn.Module]:
        return [block.attn for block in self.routable_blocks()]

    def timestep(self, noise_level: torch.Tensor) -> torch.Tensor:
        return noise_level / 1000.0   # the pipelines feed t / 1000; Timesteps(scale=1000) scales back

    # -- packing and positions (the Qwen-Image pipelines' conventions) ----------------------------------
    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return pack_cells(x, self.PACK)

    def unpack(self, tokens: torch.Tensor, grid: Grid) -> torch.Tensor:
        """(B, N, C*2*2) with features ordered (C, 2, 2) on token grid (1, h, w) -> (B, C, 2h, 2w): pack's inverse."""
        _, h, w = grid
        return unpack_cells(tokens, h, w, self.PACK)

    def img_shapes(self, grid: Grid) -> list[tuple[int, int, int]]:
        """One sample's img_shapes: the target's (1, h, w) token grid, then the reference's with edit (the same:
        the pipelines' (1, latent height / 2, latent width / 2))."""
        _, h, w = grid
        return [(1, h, w)] * (2 if self.kontext else 1)

    # -- editing: the conditioning image's latents ----------------------------------------------------
    def _temb(self, timestep: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """temb (B, D); with zero_cond_t (2B, D): the rows of t, then of t = 0 (diffusers' forward)."""
        t = timestep.to(like.dtype)
        if self.zero_cond_t:
            t = torch.cat([t, t * 0], dim=0)
        return self.transformer.time_text_embed(t, like)

    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        tr, grid = self.transformer, self.grid_of(x)
        hidden = tr.img_in(self.pack(x))                                             # (B, N, D)
        temb = self._temb(timestep, hidden)
        context = tr.txt_in(tr.txt_norm(cond["text"]))                               # (B, L, D)
        B, N, L = hidden.shape[0], hidden.shape[1], context.shape[1]
        mask = cond.get("text_mask")
        img_freqs, txt_freqs = tr.pos_embed([self.img_shapes(grid)], max_txt_seq_len=L, device=x.device)
        per_token = {"rope": torch.view_as_real(img_freqs[:N]).unsqueeze(0).expand(B, -1, -1, -1)}  # (B,N,Dh/2,2)
        if self.zero_cond_t:     # the target's tokens take the t rows (index 0)
            per_token["modulate_index"] = torch.zeros(B, N, dtype=torch.int, device=x.device)
        extra = {"temb": temb, "txt_freqs": txt_freqs, "mask": None if mask is None else mask.to(torch.bool)}
        if self.kontext:            # never routed: the reference tokens travel with the text as context
            context = (context, tr.img_in(self.pack(cond["reference"])))             # (B, L, D), (B, N, D)
            extra["ref_freqs"] = img_freqs[N:]
        return Embedded(hidden, context, per_token, extra, grid)

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        temb, txt_freqs, mask = emb.extra["temb"], emb.extra["txt_freqs"], emb.extra["mask"]
        ref_freqs = emb.extra.get("ref_freqs")

        def run(block: nn.Module) -> Callable[..., Any]:
            def fn(x: torch.Tensor, context: Any, tok: Mapping[str, torch.Tensor]):
                text, ref = context if self.kontext else (context, None)
                B, K = x.shape[:2]
                freqs = torch.view_as_complex(tok["rope"].float().contiguous())      # (B, K, Dh/2)
                index = tok.get("modulate_index")
                if ref is not None:   # [kept target, reference] through the image weights, like diffusers
                    x = torch.cat([x, ref], dim=1)
                    freqs = torch.cat([freqs, ref_freqs.unsqueeze(0).expand(B, -1, -1)], dim=1)
                    if index is not None:   # the reference's tokens take the t = 0 rows (index 1)
                        index = torch.cat([index, torch.ones_like(index[:, :1]).expand(-1, ref.shape[1])], dim=1)
                text, x = block(hidden_states=x, encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                                temb=cond32(temb), image_rotary_emb=(freqs, txt_freqs), modulate_index=index)
                return (x, text) if ref is None else (x[:, :K], (text, x[:, K:]))
            return fn

        return [run(b) for b in self.routable_blocks()]

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        tr, temb = self.transformer, emb.extra["temb"]
        if self.zero_cond_t:
            temb = temb.chunk(2, dim=0)[0]
        return self.unpack(tr.proj_out(tr.norm_out(x, temb)), emb.grid)             # (B, C, H, W)

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """diffusers' forward on the inputs as QwenImagePipeline builds them (with edit: QwenImageEditPlusPipeline's
        hidden states [target, reference] and img_shapes, the output's target part kept)."""
        hidden, grid = self.pack(x), self.grid_of(x)
        if self.kontext:
            hidden = torch.cat([hidden, self.pack(cond["reference"])], dim=1)
        mask = cond.get("text_mask")
        out = transformer(hidden_states=hidden, encoder_hidden_states=cond["text"],
                          encoder_hidden_states_mask=None if mask is None else mask.to(torch.bool),
                          timestep=timestep, img_shapes=[self.img_shapes(grid)] * x.shape[0], return_dict=False)[0]
        return self.unpack(out[:, :grid[1] * grid[2]], grid)


FAMILY = QwenImageFamily
PRESETS = QWEN_IMAGE_PRESETS
